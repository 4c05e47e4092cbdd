"""A tensor item of a DCP data file — one ``torch.save`` zip — read without unpickling it.

DCP writes each tensor as a ``torch.save`` zip. Its tiny ``data.pkl`` says dtype, storage key,
offset, size and stride; it is read by a restricted reader that only knows
``_rebuild_tensor_v2``, storage types and ``OrderedDict`` and can construct nothing but a
description. The zip records are found by ``zipfmt`` (no ``zipfile``: no CRC pass, no copy).
"""

from __future__ import annotations

import functools
import io
import math
import pickle
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from ckptflow.trainer import zipfmt
from ckptflow.trainer.errors import IntegrityError


class _StorageType:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


_STORAGE_TYPES = {
    f"{n}Storage": d
    for n, d in (
        ("Float", torch.float32),
        ("Double", torch.float64),
        ("Half", torch.float16),
        ("BFloat16", torch.bfloat16),
        ("Long", torch.int64),
        ("Int", torch.int32),
        ("Short", torch.int16),
        ("Char", torch.int8),
        ("Byte", torch.uint8),
        ("Bool", torch.bool),
        ("ComplexFloat", torch.complex64),
        ("ComplexDouble", torch.complex128),
    )
}


def _rebuild(storage: tuple, offset: int, size: tuple, stride: tuple, *_rest: Any) -> tuple:
    return ("tensor", storage, offset, tuple(size), tuple(stride))


class _TensorPickle(pickle.Unpickler):
    """Reads a tensor's ``data.pkl`` into a description; can construct nothing but that."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in _STORAGE_TYPES:
            return _StorageType(_STORAGE_TYPES[name])
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a plain tensor")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise pickle.UnpicklingError(f"unexpected storage reference {pid!r:.80}")
        return ("storage", pid[1].dtype, str(pid[2]), int(pid[4]))


@functools.lru_cache(maxsize=4096)
def _describe(pkl: bytes) -> tuple:
    """A ``data.pkl``'s description; the same bytes recur for every tensor of a layout."""
    desc = _TensorPickle(io.BytesIO(pkl)).load()
    kind, (_, dtype, key, numel), offset, size, stride = desc
    if kind != "tensor" or len(size) != len(stride) or not all(isinstance(x, int) for x in (*size, *stride, offset)):
        raise ValueError("not a tensor")
    return dtype, key, numel, offset, size, stride


@dataclass(frozen=True, slots=True)
class TensorItem:
    """Where a tensor item (a ``torch.save`` zip) keeps its storage, and the tensor's layout."""

    data: int
    """Offset of the storage's first byte within the item."""
    nbytes: int
    dtype: torch.dtype
    offset: int
    """Storage offset, in elements."""
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def contiguous(self) -> bool:
        expect = 1
        for n, st in zip(reversed(self.size), reversed(self.stride), strict=True):
            if n != 1 and st != expect:
                return False
            expect *= n
        return True

    def view(self, item: memoryview, source: str) -> torch.Tensor:
        """The tensor, as a view of ``item``'s bytes."""
        try:
            if not self.nbytes:
                return torch.empty(0, dtype=self.dtype).as_strided(self.size, self.stride, self.offset)
            flat = torch.frombuffer(item, dtype=torch.uint8, count=self.nbytes, offset=self.data)
            return flat.view(self.dtype).as_strided(self.size, self.stride, self.offset)
        except RuntimeError as e:  # a layout that does not fit its storage
            raise IntegrityError(
                f"{source}: not a plain tensor item ({e}); the checkpoint is damaged", path=source
            ) from None


def tensor_item(item: memoryview, source: str) -> TensorItem:
    """The layout of the tensor a ``torch.save`` zip in ``item`` holds — found without unpickling
    anything but its ``data.pkl``, by a reader that can construct nothing but a description."""
    try:
        entries = zipfmt.entries(item)
        pkl = next(n for n in entries if n.endswith("/data.pkl"))
        e = entries[pkl]
        dtype, key, numel, offset, size, stride = _describe(item[e.data : e.data + e.size].tobytes())
        d = entries[f"{pkl[: -len('data.pkl')]}data/{key}"]
        if d.size != numel * dtype.itemsize:
            raise ValueError(f"storage holds {d.size} bytes, {numel} x {dtype.itemsize} expected")
        ti = TensorItem(d.data, d.size, dtype, offset, size, stride)
        if math.prod(size) and (
            offset < 0
            or min(stride, default=0) < 0
            or (offset + sum((n - 1) * st for n, st in zip(size, stride, strict=True)) + 1) * dtype.itemsize > d.size
        ):
            raise ValueError(f"size {size}, stride {stride} and offset {offset} run past the storage")
        return ti
    except (
        ValueError,
        KeyError,
        StopIteration,
        struct.error,
        pickle.UnpicklingError,
        RuntimeError,
        UnicodeDecodeError,
        IndexError,
        TypeError,
    ) as e:
        raise IntegrityError(
            f"{source}: not a plain tensor item ({type(e).__name__}: {e}); the checkpoint is "
            "damaged or was not written by DCP",
            path=source,
        ) from None
