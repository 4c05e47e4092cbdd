"""A pickle-free encoding for the non-tensor state ckptflow saves (RNG, scheduler, sampler, ...).

A checkpoint's bytes come from storage and unpickling runs whatever they say, so ckptflow's own state entries
are this tree instead: a JSON header for the structure plus a blob of raw bytes for tensors, arrays and
``bytes``, stored as one ``uint8`` tensor per rank (plain DCP readers see a tensor; ``decode(bytes(t.numpy()))``
gives the state back).

It holds ``None``, ``bool``, ``int``, ``float`` (NaN, infinities), ``str``, ``bytes``, ``list``, ``tuple``,
``dict`` (any of these as keys), ``torch.Tensor`` (CPU, any dtype and layout: saved contiguous),
``numpy.ndarray`` and numpy scalars. Anything else is refused at save time with the path to the value, so the
problem shows when it is made, not at a resume.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import torch

from ckptflow.trainer.errors import CkptflowError, IntegrityError

MAGIC = b"CKPTTREE1\n"
_LEN = struct.Struct("<Q")
_TORCH_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}


class UnsupportedStateError(CkptflowError, TypeError):
    """A state dict holds a value the safe encoding does not (the message names where)."""


def encode(obj: Any) -> bytes:
    blob = bytearray()
    header = _enc(obj, blob, "state")
    head = json.dumps(header, separators=(",", ":"), allow_nan=True).encode()
    return MAGIC + _LEN.pack(len(head)) + head + bytes(blob)


PAD = 4096
"""``encode_tensor`` pads its length to a multiple of this (zeros ``decode`` never reads). Why: an entry's JSON
text grows and shrinks by a few bytes between saves (RNG state, a data position), and a size change changes
the rank's save plan, defeating DCP's plan caching (``dcp.planner.canonical_planner``); cost ≤ 4 KiB per rank."""


def encode_tensor(obj: Any) -> torch.Tensor:
    """``encode`` as a ``uint8`` tensor (what goes into the DCP state dict), padded to ``PAD``."""
    raw = encode(obj)
    buf = bytearray(-(-len(raw) // PAD) * PAD)
    buf[: len(raw)] = raw
    return torch.frombuffer(buf, dtype=torch.uint8)


def decode(data: bytes | bytearray | memoryview, *, source: str = "state") -> Any:
    view = memoryview(data).cast("B")
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise IntegrityError(f"{source}: not a ckptflow state entry (no {MAGIC!r} header)", path=source)
    try:
        (n,) = _LEN.unpack(view[len(MAGIC) : len(MAGIC) + _LEN.size])
        start = len(MAGIC) + _LEN.size
        header = json.loads(bytes(view[start : start + n]))
        return _dec(header, view[start + n :], source)
    except IntegrityError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, struct.error) as e:
        raise IntegrityError(f"{source}: the state entry is malformed ({type(e).__name__}: {e})", path=source) from None


def _blob(blob: bytearray, data: bytes | memoryview) -> list[int]:
    off = len(blob)
    blob += data
    return [off, len(data)]


def _enc(x: Any, blob: bytearray, path: str) -> Any:
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, int):
        return x if -(2**63) <= x < 2**63 else {"I": str(x)}  # JSON ints beyond 64 bits: as text
    if isinstance(x, float):
        return {"F": x} if x != x or x in (float("inf"), float("-inf")) else x
    if isinstance(x, (bytes, bytearray)):
        return {"B": _blob(blob, bytes(x))}
    if isinstance(x, list):
        return {"L": [_enc(v, blob, f"{path}[{i}]") for i, v in enumerate(x)]}
    if isinstance(x, tuple):
        return {"T": [_enc(v, blob, f"{path}[{i}]") for i, v in enumerate(x)]}
    if isinstance(x, dict):
        return {"D": [[_enc(k, blob, f"{path}.<key>"), _enc(v, blob, f"{path}.{k}")] for k, v in x.items()]}
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous()
        name = str(t.dtype).removeprefix("torch.")
        if name not in _TORCH_DTYPES:
            raise UnsupportedStateError(f"{path}: a tensor of dtype {t.dtype} cannot be saved in ckptflow's state")
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"X": [name, list(t.shape), *_blob(blob, raw)]}
    if isinstance(x, np.ndarray):
        a = np.ascontiguousarray(x)
        if a.dtype.hasobject:
            raise UnsupportedStateError(f"{path}: a numpy array of Python objects cannot be saved safely")
        return {"N": [a.dtype.str, list(a.shape), *_blob(blob, a.tobytes())]}
    if isinstance(x, np.generic):
        return {"n": [x.dtype.str, *_blob(blob, x.tobytes())]}
    raise UnsupportedStateError(
        f"{path} is a {type(x).__module__}.{type(x).__qualname__}: ckptflow saves state without pickle and "
        "holds only None, bool, int, float, str, bytes, list, tuple, dict, tensors and numpy arrays; make that "
        "state_dict() return those"
    )


def _dec(h: Any, blob: memoryview, source: str) -> Any:
    if h is None or isinstance(h, (bool, str, int, float)):
        return h
    if not isinstance(h, dict) or len(h) != 1:
        raise ValueError(f"unexpected node {type(h).__name__}")
    ((kind, v),) = h.items()
    if kind == "L":
        return [_dec(e, blob, source) for e in v]
    if kind == "T":
        return tuple(_dec(e, blob, source) for e in v)
    if kind == "D":
        return {_key(_dec(k, blob, source)): _dec(e, blob, source) for k, e in v}
    if kind == "I":
        return int(v)
    if kind == "F":
        return float(v)
    if kind == "B":
        off, n = v
        return bytes(_slice(blob, off, n))
    if kind == "X":
        name, shape, off, n = v
        dt = _TORCH_DTYPES[name]
        raw = bytearray(_slice(blob, off, n))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dt).reshape(shape) if flat.numel() else torch.empty(shape, dtype=dt)
    if kind == "N":
        dts, shape, off, n = v
        return np.frombuffer(bytes(_slice(blob, off, n)), dtype=np.dtype(dts)).reshape(shape).copy()
    if kind == "n":
        dts, off, n = v
        return np.frombuffer(bytes(_slice(blob, off, n)), dtype=np.dtype(dts))[0]
    raise ValueError(f"unknown node kind {kind!r}")


def _key(k: Any) -> Any:
    if isinstance(k, list):  # a list cannot be a dict key; only a tuple could have been
        raise ValueError("a list as a dict key")
    return k


def _slice(blob: memoryview, off: int, n: int) -> memoryview:
    if off < 0 or n < 0 or off + n > len(blob):
        raise ValueError(f"blob range {off}+{n} outside {len(blob)} bytes")
    return blob[off : off + n]
