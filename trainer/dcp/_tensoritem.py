"""A tensor item of a DCP data file (one ``torch.save`` zip), read without unpickling it: its ``data.pkl`` goes to an
unpickler that knows only ``_rebuild_tensor_v2``, storage types and ``OrderedDict`` and builds nothing but a
description; ``zipfmt`` finds the zip records (no ``zipfile``: no CRC pass, no copy)."""

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

from ckptflow.trainer.dcp import _zipfmt as zipfmt
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


class _PlainPickle(pickle.Unpickler):
    """Builds numbers, strings, bytes, None, booleans, tuples, lists, dicts and sets; refuses any class, function or
    persistent reference."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not a plain value")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a storage reference is not a plain value")


NOT_PLAIN = object()
"""What :func:`plain_item` returns for an item that is not a plain value."""


def plain_item(item: bytes | memoryview) -> Any:
    """The plain Python value (numbers, strings, tuples of them: optimizer hyperparameters) a DCP byte item holds, or
    :data:`NOT_PLAIN`; much cheaper than ``torch.load``'s restricted loader, and builds nothing else."""
    try:
        entries = zipfmt.entries(item)
        pkl = next(n for n in entries if n.endswith("/data.pkl"))
        if any("/data/" in n for n in entries):
            return NOT_PLAIN  # holds a storage: torch's loader
        e = entries[pkl]
        return _PlainPickle(io.BytesIO(bytes(item[e.data : e.data + e.size]))).load()
    except Exception:  # anything this reader does not know goes to torch's own (which reports it)
        return NOT_PLAIN


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


class Locator:
    """:func:`tensor_item` for the many items of one load, most of which share a layout (a full parse is ~20 us).

    Items of one length with equal zip end records come from the same ``torch.save`` of one layout, so later ones
    reuse the first's once ``data.pkl`` and the records of ``data.pkl`` and of the storage (but for its CRC-32) match
    byte for byte; any difference parses in full. One per load."""

    def __init__(self) -> None:
        self._layouts: dict[tuple[int, bytes], tuple[TensorItem, list[tuple[int, int, bytes]]]] = {}
        self.hits = 0

    def locate(self, item: memoryview, source: str) -> TensorItem:
        try:
            key = (len(item), zipfmt.end_record(item))
        except ValueError:
            return tensor_item(item, source)  # reports what is wrong with it
        known = self._layouts.get(key)
        if known is not None and all(item[a:b] == want for a, b, want in known[1]):
            self.hits += 1
            return known[0]
        ti, _, pkl, _, data = _parse(item, source)
        self._layouts[key] = (ti, _layout_bytes(item, pkl, data))
        return ti


def _layout_bytes(item: memoryview, pkl: zipfmt.Entry, data: zipfmt.Entry) -> list[tuple[int, int, bytes]]:
    """The byte ranges a same-layout item has equal to ``item``: ``data.pkl``'s records and bytes whole, the
    storage's records but for their CRC-32 fields."""
    out = []
    for e, crc in ((pkl, None), (data, (zipfmt.LOCAL_CRC, zipfmt.CENTRAL_CRC))):
        spans = [(e.local, e.data), (e.central, zipfmt.record_end(item, e.central))]
        for (a, b), at in zip(spans, crc or (None, None), strict=True):
            cut = [(a, b)] if at is None else [(a, a + at), (a + at + 4, b)]
            out += [(x, y, bytes(item[x:y])) for x, y in cut]
    out.append((pkl.data, pkl.data + pkl.size, bytes(item[pkl.data : pkl.data + pkl.size])))
    return out


def tensor_item(item: memoryview, source: str) -> TensorItem:
    """The layout of the tensor a ``torch.save`` zip in ``item`` holds, found by unpickling only its ``data.pkl``
    with a reader that can construct nothing but a description."""
    return _parse(item, source)[0]


def _parse(item: memoryview, source: str) -> tuple[TensorItem, str, zipfmt.Entry, str, zipfmt.Entry]:
    """:func:`tensor_item`, and the records of ``data.pkl`` and of the storage (name, entry)."""
    try:
        entries = zipfmt.entries(item)
        pkl = next(n for n in entries if n.endswith("/data.pkl"))
        e = entries[pkl]
        dtype, key, numel, offset, size, stride = _describe(item[e.data : e.data + e.size].tobytes())
        data_name = f"{pkl[: -len('data.pkl')]}data/{key}"
        d = entries[data_name]
        if d.size != numel * dtype.itemsize:
            raise ValueError(f"storage holds {d.size} bytes, {numel} x {dtype.itemsize} expected")
        ti = TensorItem(d.data, d.size, dtype, offset, size, stride)
        if math.prod(size) and (
            offset < 0
            or min(stride, default=0) < 0
            or (offset + sum((n - 1) * st for n, st in zip(size, stride, strict=True)) + 1) * dtype.itemsize > d.size
        ):
            raise ValueError(f"size {size}, stride {stride} and offset {offset} run past the storage")
        return ti, pkl, e, data_name, d
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
