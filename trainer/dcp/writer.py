"""DCP's data files written without a ``torch.save`` per tensor, each file hashed as it is written.

DCP's ``FileSystemWriter`` pickles each tensor and the commit then rereads every byte: CPU taken from training. Here
each layout (dtype, shape, stride, offset, storage size) gets a template from one ``torch.save`` under
``skip_data()``; later saves write its head, the tensor's bytes and its tail, the CRC-32 (ISA-L, else zlib) patched
in, and hash the same buffers. The files are ``torch.save``'s own container at DCP's offsets, differing only in the
serialization id (tests/integration/test_fastwrite.py); what templates do not cover (a tensor subclass, hooks, a
stream transform) goes through ``torch.save`` as DCP's writer would. See docs/architecture.md, "One save, per rank".
"""

from __future__ import annotations

import io
import math
import os
import queue
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from ckptflow.trainer._torch_private import _StorageInfo, local_tensor
from ckptflow.trainer.dcp import _zipfmt as zipfmt
from ckptflow.trainer.format.checksum import FileDigest, block_size_for

__all__ = ["HashingStream", "HashingWriter", "storage_bytes", "template", "write_tensor"]


try:  # the same CRC-32 as zlib's, faster (carry-less multiplication)
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - a platform without isal's wheels
    _crc32 = zlib.crc32


DATA_RECORD = "archive/data/0"
"""A lone tensor's one storage, as ``torch.save`` names it in a stream."""

MAX_TEMPLATES = 8192
"""Layouts kept (a few KB each); a model has one per distinct parameter/optimizer shape."""


class _Template:
    """A layout's container: the bytes before and after the data, and where its CRC-32 goes."""

    __slots__ = ("prefix", "suffix", "crc_in_prefix", "crc_in_suffix")

    def __init__(self, prefix: bytes, suffix: bytes, crc_in_prefix: list[int], crc_in_suffix: list[int]) -> None:
        self.prefix, self.suffix = prefix, suffix
        self.crc_in_prefix, self.crc_in_suffix = crc_in_prefix, crc_in_suffix


_templates: OrderedDict[tuple, _Template | None] = OrderedDict()
_lock = threading.Lock()
_count_lock = threading.Lock()
"""Module-level, not on the writer: one cache for every save of the process."""


def _layout(t: torch.Tensor) -> tuple | None:
    """What a tensor's container depends on besides its bytes; None where templates don't apply."""
    if (
        type(t) is not torch.Tensor
        or t.layout is not torch.strided
        or t.device.type != "cpu"
        or t.requires_grad
        or t.is_quantized
        or t.is_conj()
        or t.is_neg()
        or t.__dict__  # Python attributes are pickled with the tensor
        or t._backward_hooks
    ):
        return None
    return (t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.untyped_storage().nbytes())


def _make_template(t: torch.Tensor) -> _Template | None:
    buf = io.BytesIO()
    with torch.serialization.skip_data():  # thread-local: the data is left as a gap
        torch.save(t, buf)
    raw = buf.getbuffer()
    try:
        ents = zipfmt.entries(raw)
    except ValueError:
        return None
    e = ents.get(DATA_RECORD)
    if e is None or len(ents) < 2 or e.size != t.untyped_storage().nbytes():
        return None  # not the one-storage container this module knows
    end = e.data + e.size
    crc_in_prefix, crc_in_suffix = [], [e.central + zipfmt.CENTRAL_CRC - end]
    (flags,) = struct.unpack_from("<H", raw, e.local + 6)
    if flags & 0x8:  # streamed: the CRC follows the data, in a descriptor (miniz writes one)
        if bytes(raw[end : end + 4]) != b"PK\x07\x08":
            return None
        crc_in_suffix.append(4)
    else:
        crc_in_prefix.append(e.local + zipfmt.LOCAL_CRC)
    return _Template(bytes(raw[: e.data]), bytes(raw[end:]), crc_in_prefix, crc_in_suffix)


def template(t: torch.Tensor) -> _Template | None:
    """The container template of ``t``'s layout (made on first use), or None."""
    key = _layout(t)
    if key is None:
        return None
    with _lock:
        if key in _templates:
            _templates.move_to_end(key)
            return _templates[key]
    made = _make_template(t)
    with _lock:
        _templates[key] = made
        while len(_templates) > MAX_TEMPLATES:
            _templates.popitem(last=False)
    return made


def storage_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of ``t``'s whole storage, without a copy (what ``torch.save`` writes)."""
    s = t.untyped_storage()
    u8 = torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),), (1,))
    return memoryview(cast(Any, u8.numpy())).cast("B")


class HashingStream:
    """Write-only file wrapper tracking the file's digest and its blocks' (``FileDigest``), and the position."""

    def __init__(self, raw: Any, expected_bytes: int = 0) -> None:
        self.raw = raw
        self.hasher = FileDigest(block_size_for(expected_bytes))
        self.pos = 0

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        self.hasher.update(mv)
        self.raw.write(mv)
        self.pos += len(mv)
        return len(mv)

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        self.raw.flush()

    def writable(self) -> bool:
        return True


def write_tensor(out: HashingStream, t: torch.Tensor) -> bool:
    """Append ``t`` as ``torch.save`` would (CRC-32 included); True if via a template, False if via ``torch.save``."""
    tpl = template(t)
    if tpl is None:
        torch.save(t, cast(IO[bytes], out))  # it only calls write/flush/tell
        return False
    data = storage_bytes(t)
    crc = _crc32(data)
    pre, suf = bytearray(tpl.prefix), bytearray(tpl.suffix)
    for at in tpl.crc_in_prefix:
        struct.pack_into("<I", pre, at, crc)
    for at in tpl.crc_in_suffix:
        struct.pack_into("<I", suf, at, crc)
    out.write(pre)
    out.write(data)
    out.write(suf)
    return True


class HashingWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` (same files, names and metadata), writing tensors from templates and recording
    each data file's ``(xxh3, size)`` in ``digests``."""

    def __init__(self, path: str | os.PathLike, **kw: Any) -> None:
        super().__init__(path, **kw)
        self.digests: dict[str, FileDigest] = {}
        self.items_templated = 0
        self.items_saved = 0
        self._written: set[str] = set()
        self._all_written: set[str] | None = None

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        fut = super().write_data(plan, planner)
        self._written.update(_paths(fut.wait()))  # written synchronously: already done
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self._all_written = {p for rs in results for p in _paths(rs)}  # the coordinator's: every rank's
        super().finish(metadata, results)

    def referenced(self, metadata: Metadata) -> set[str]:
        """Every data file ``metadata`` (what ``dcp.save`` returned) references: from its ``storage_data``, else from
        the write results this writer saw (the coordinator's: every rank's, at ``finish``; another rank's: its own).
        Needed as torch 2.11's ``FileSystemWriter.finish`` fills ``storage_data`` into a copy of the metadata."""
        if metadata.storage_data is not None:
            return {sd.relative_path for sd in metadata.storage_data.values()}
        return set(self._all_written if self._all_written is not None else self._written)

    def _write_data(self, planner: SavePlanner, file_queue: queue.Queue) -> Future:
        if self.transforms.extensions or self.serialization_format != SerializationFormat.TORCH_SAVE:
            return super()._write_data(planner, file_queue)  # what this module does not cover
        jobs = []
        while not file_queue.empty():
            jobs.append(file_queue.get_nowait())
        if len(jobs) <= 1:
            per_file = [self._write_file(planner, *j) for j in jobs]
        else:  # one thread per file, as DCP's own writer
            with ThreadPoolExecutor(len(jobs), thread_name_prefix="ckptflow-write") as ex:
                per_file = list(ex.map(lambda j: self._write_file(planner, *j), jobs))
        fut: Future = Future()
        fut.set_result([r for rs in per_file for r in rs])
        return fut

    def _write_file(self, planner: SavePlanner, path: Any, storage_key: str, items: list[WriteItem]) -> list:
        results: list[WriteResult] = []
        templated = 0
        with self.fs.create_stream(path, "wb") as raw:
            out = HashingStream(raw, sum(_nbytes(w) for w in items))
            for wi in (w for w in items if w.type == WriteItemType.BYTE_IO):
                data = cast(io.BytesIO, planner.resolve_data(wi))
                off = out.tell()
                out.write(data.getbuffer())
                results.append(_result(wi, storage_key, off, out.tell() - off))
            resolve = _resolver(planner)
            for wi in (w for w in items if w.type != WriteItemType.BYTE_IO):
                t = resolve(wi).detach().cpu()
                if t.untyped_storage().nbytes() != t.nbytes:  # as DCP: a view saves only itself
                    t = t.clone()
                off = out.tell()
                templated += write_tensor(out, t)
                results.append(_result(wi, storage_key, off, out.tell() - off))
            raw.flush()
            if self.sync_files:
                os.fsync(raw.fileno())
        with _count_lock:  # files are written by several threads
            self.digests[storage_key] = out.hasher
            self.items_templated += templated
            self.items_saved += sum(w.type != WriteItemType.BYTE_IO for w in items) - templated
        return results


def _resolver(planner: SavePlanner) -> Callable[[WriteItem], torch.Tensor]:
    """``planner.resolve_data`` for tensor items. For DCP's default planner (look-up not overridden), a ``DTensor``'s
    local shard is taken as it is, not through ``to_local()``, an autograd function that costs CPU on every save
    (docs/benchmarks.md). Anything else goes through the planner."""
    names = ("resolve_data", "lookup_object", "transform_object")
    if not isinstance(planner, DefaultSavePlanner) or any(
        getattr(type(planner), n) is not getattr(DefaultSavePlanner, n) for n in names
    ):
        return lambda wi: cast(torch.Tensor, planner.resolve_data(wi))
    flat: dict[str, Any] = planner.state_dict

    def resolve(wi: WriteItem) -> torch.Tensor:
        obj = flat.get(wi.index.fqn)
        if isinstance(obj, DTensor) and not any(p.is_partial() for p in obj.placements):
            local = local_tensor(obj)
            if type(local) is torch.Tensor:
                return local
        return cast(torch.Tensor, planner.resolve_data(wi))

    return resolve


def _nbytes(wi: WriteItem) -> int:
    """A tensor item's data bytes, from its plan (byte items are small: 0)."""
    td = wi.tensor_data
    return 0 if td is None else math.prod(td.chunk.sizes) * td.properties.dtype.itemsize


def _paths(results: list[WriteResult]) -> set[str]:
    return {r.storage_data.relative_path for r in results}


def _result(wi: WriteItem, storage_key: str, offset: int, length: int) -> WriteResult:
    return WriteResult(index=wi.index, size_in_bytes=length, storage_data=_StorageInfo(storage_key, offset, length))
