"""Loading a DCP checkpoint with every byte verified before it is handed on, nothing unpickled.

:class:`VerifiedReader` replaces DCP's ``FileSystemReader`` (which unpickles); the files stay standard DCP.
``.metadata`` is checked against its digest and parsed by ``format/dcpmeta.py``'s allow-list. The data files a load
reads are mapped and verified block by block (a file without block digests: whole) on a pool of threads (xxHash
releases the GIL) before any item in them is located (``_tensoritem.py``, zip records only) or copied: a damaged file
is reported as such, and no destination receives a byte that did not match. A mismatch fails the load on every rank
(``loader.load_local``).

:func:`open_reader` gives the optional acceleration layer's reader where it is on (``ckptflow/fast/``: each block
copied right after it matched, files streamed in while DCP plans; ``CKPTFLOW_NO_ACCEL=1`` turns it off). See
docs/architecture.md, "Resume".
"""

from __future__ import annotations

import io
import math
import mmap
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ckptflow.trainer._torch_private import narrow_tensor_by_index
from ckptflow.trainer.dcp._tensoritem import Locator, TensorItem
from ckptflow.trainer.errors import IntegrityError
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.checksum import CHUNK, block_digest, new_hasher
from ckptflow.trainer.format.dcpmeta import MAX_METADATA_BYTES, loads_dcp_metadata
from ckptflow.trainer.format.manifest import FileEntry, Manifest
from ckptflow.trainer.safeopen import open_regular
from ckptflow.trainer.verify import resolve_member

__all__ = ["THREADS", "RangeReader", "VerifiedReader", "open_reader"]


THREADS = 4
"""Threads that verify (and, in the acceleration layer, copy)."""
READAHEAD = 256 << 20
"""How far ahead of the digests a cold file is asked for (``MADV_WILLNEED``), so it streams from disk instead of
arriving one page fault at a time."""

Item = tuple[ReadItem, Any]
"""A planned read and its item's record in ``.metadata`` (``storage_data``: file, offset, length)."""


def open_reader(
    path: str, manifest: Manifest, *, prefetch: Iterable[str] = (), threads: int = THREADS
) -> VerifiedReader:
    """The reader for a load of ``path``: the acceleration layer's (``ckptflow.fast.reader``) unless
    ``CKPTFLOW_NO_ACCEL=1``, else this module's. ``prefetch``: files this rank will most likely read, streamed in
    early by the acceleration layer. Call ``close()`` and ``unmap()`` when done."""
    if os.environ.get("CKPTFLOW_NO_ACCEL", "") in ("", "0"):
        from ckptflow.fast.reader import FastReader

        return FastReader(path, manifest, threads=threads, prefetch=prefetch)
    return VerifiedReader(path, manifest, threads=threads)


@dataclass(frozen=True, slots=True)
class Block:
    name: str
    index: int
    start: int
    end: int
    digest: str
    whole: bool = False
    """The whole file under its ``checksum.ALGORITHM`` digest (no block digests recorded)."""


def blocks_of(name: str, entry: FileEntry, size: int) -> list[Block]:
    """What is verified of a file: its blocks where the manifest records their digests, else the whole file."""
    if not size:
        return []
    if not entry.block_size:
        return [Block(name, 0, 0, size, entry.checksum, whole=True)]
    starts = range(0, size, entry.block_size)
    return [
        Block(name, k, a, min(a + entry.block_size, size), d)
        for k, (a, d) in enumerate(zip(starts, entry.block_digests(), strict=True))
    ]


def verify(data: Any, b: Block, path: str) -> IntegrityError | None:
    """None if the block's bytes in ``data`` (the mapped file) have their digest, else the error (returned, so the
    pool's threads never raise)."""
    view = memoryview(data)
    try:
        if b.whole:
            h = new_hasher()
            for i in range(b.start, b.end, CHUNK):
                if i % READAHEAD == 0:
                    readahead(data, i + READAHEAD, READAHEAD)
                h.update(view[i : min(i + CHUNK, b.end)])
            got = h.hexdigest()
        else:
            got = block_digest(view[b.start : b.end])
    finally:
        view.release()
    if got == b.digest:
        return None
    where = "" if b.whole else f" in bytes {b.start}-{b.end} (block {b.index})"
    return IntegrityError(
        f"{path}: checksum {got} != {b.digest} in the manifest{where} (bytes corrupted); not loading it",
        path=path,
    )


def readahead(data: Any, start: int, length: int) -> None:
    """Ask the kernel to read ``[start, start + length)`` of a mapped file in the background."""
    if hasattr(data, "madvise") and hasattr(mmap, "MADV_WILLNEED") and 0 <= start < len(data):
        start -= start % mmap.PAGESIZE
        data.madvise(mmap.MADV_WILLNEED, start, min(length, len(data) - start))


@dataclass(slots=True)
class Copy:
    """One tensor item: bytes ``[lo, hi)`` of file ``name`` go to ``dst``. ``src``: the view to copy where they are
    not one contiguous run in ``dst``'s layout (else built only if needed)."""

    req: ReadItem
    dst: torch.Tensor
    name: str
    lo: int
    hi: int
    dtype: torch.dtype
    src: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo

    def source(self, data: Any) -> torch.Tensor:
        """The bytes as a tensor of the item's dtype and the destination's shape (no copy), made at its own offset:
        an item may start at any byte of a DCP file, too odd for a typed view."""
        if self.src is not None:
            return self.src
        flat = torch.frombuffer(data, dtype=torch.uint8, count=self.nbytes, offset=self.lo)
        return flat.view(self.dtype).view(self.dst.shape)


class VerifiedReader(FileSystemReader):
    """A ``StorageReader`` for one local checkpoint directory and its (authenticated) manifest."""

    read_ahead = True
    """Ask the kernel for each mapped file's first ``READAHEAD`` bytes at once (a load reads files whole)."""

    def __init__(self, path: str, manifest: Manifest, *, threads: int = THREADS) -> None:
        super().__init__(path)
        self.ckpt_dir = os.fspath(path)
        self.manifest = manifest
        self.threads = max(1, threads)
        self._md: Metadata | None = None
        self._maps: dict[str, Any] = {}
        self.bytes_read = 0

    def close(self) -> None:
        """Stop what the reader still runs; none of its threads touches a destination after this returns."""

    def unmap(self) -> None:
        """Unmap the files on a thread of their own (``munmap`` is slow and runs without the GIL, so another core does
        it while the caller applies the loaded state). Call after :meth:`close`."""
        maps = [m for m in self._maps.values() if isinstance(m, mmap.mmap)]
        self._maps.clear()
        if maps:
            threading.Thread(target=_close_maps, args=(maps,), name="ckptflow-unmap", daemon=True).start()

    # -- StorageReader ------------------------------------------------------------------
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._md is None:
            # the bytes copied out of the map are the ones checked and parsed (the file may change under a map)
            data = bytes(self._map(layout.DCP_METADATA, limit=MAX_METADATA_BYTES))
            path = self._path(layout.DCP_METADATA)
            if data:
                err = verify(
                    data,
                    Block(layout.DCP_METADATA, 0, 0, len(data), self._entry(layout.DCP_METADATA).checksum, whole=True),
                    path,
                )
                if err is not None:
                    raise err
            self._md = loads_dcp_metadata(data, source=path, signed=self.manifest.authenticated)
        return self._md

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file = self._per_file(plan)
        maps = {name: self._mapped(name) for name in per_file}
        blocks = [b for name in per_file for b in blocks_of(name, self._entry(name), len(maps[name]))]
        # Every block first, then the zip records: a damaged file is reported as such, not as the parse it broke.
        with ThreadPoolExecutor(self.threads, thread_name_prefix="ckptflow-verify") as pool:
            for err in pool.map(lambda b: verify(maps[b.name], b, self._path(b.name)), blocks):
                if err is not None:
                    pool.shutdown(cancel_futures=True)
                    raise err
        # DCP's own resolve, as its FileSystemReader does it
        copies, byte_items = self._locate(per_file, maps, Locator(), lambda req: planner.resolve_tensor(req).detach())
        for c in copies:
            if c.hi > c.lo:
                c.dst.copy_(c.source(maps[c.name]))
        self.bytes_read += sum(len(m) for m in maps.values())
        return self._hand_on(planner, copies, byte_items)

    def _per_file(self, plan: LoadPlan) -> dict[str, list[Item]]:
        """The plan's reads by file, each with its item's record (looked up once: a ``MetadataIndex`` key hashes and
        compares in Python)."""
        per_file: dict[str, list[Item]] = {}
        records = self.storage_data
        for req in plan.items:
            info = records[req.storage_index]
            per_file.setdefault(info.relative_path, []).append((req, info))
        return per_file

    @staticmethod
    def _hand_on(planner: LoadPlanner, copies: list[Copy], byte_items: list[tuple[ReadItem, bytes]]) -> Future[None]:
        """Give the planner what was read (every byte of it verified)."""
        for req, data in byte_items:
            planner.load_bytes(req, io.BytesIO(data))
        for c in copies:
            planner.commit_tensor(c.req, c.dst)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    # -- locating -----------------------------------------------------------------------
    def _locate(
        self,
        per_file: dict[str, list[Item]],
        maps: dict[str, Any],
        locator: Locator,
        resolve: Callable[[ReadItem], torch.Tensor],
    ) -> tuple[list[Copy], list[tuple[ReadItem, bytes]]]:
        """Where each wanted item's bytes lie in its file and where they go (only the zip records are read), or the
        bytes themselves for byte items."""
        copies: list[Copy] = []
        byte_items: list[tuple[ReadItem, bytes]] = []
        for name, items in per_file.items():
            buf = memoryview(maps[name]) if len(maps[name]) else memoryview(b"")
            where = os.path.join(self.ckpt_dir, name)
            for req, info in items:
                if info.transform_descriptors:
                    raise IntegrityError(
                        f"{name}: item {req.storage_index.fqn} uses storage transforms "
                        f"{info.transform_descriptors}, which ckptflow's reader does not read"
                    )
                source = f"{where}@{info.offset}"
                if info.offset < 0 or info.length < 0 or info.offset + info.length > len(buf):
                    raise IntegrityError(f"{source}: the item runs past the end of the file", path=source)
                item = buf[info.offset : info.offset + info.length]
                if req.type == LoadItemType.BYTE_IO:
                    byte_items.append((req, item.tobytes()))
                    continue
                ti = locator.locate(item, source)
                target = resolve(req)
                if not any(req.storage_offsets) and tuple(req.lengths) == ti.size and ti.contiguous():
                    src = None  # the common case: one run of bytes, no tensor built
                    lo = info.offset + ti.data + ti.offset * ti.dtype.itemsize
                    size = ti.size
                    span = math.prod(size)
                elif ti.contiguous() and (first := _run_start(ti, req.storage_offsets, req.lengths)) is not None:
                    src = None  # a region of it that is one run of bytes (resharding by rows): likewise
                    lo = info.offset + ti.data + (ti.offset + first) * ti.dtype.itemsize
                    size = tuple(req.lengths)
                    span = math.prod(size)
                else:  # a strided or narrowed (resharding) source: a view of the mapped bytes
                    src = narrow_tensor_by_index(ti.view(item, source), req.storage_offsets, req.lengths)
                    lo = info.offset + ti.data + src.storage_offset() * ti.dtype.itemsize
                    size = tuple(src.shape)
                    span = sum((n - 1) * st for n, st in zip(size, src.stride(), strict=True)) + 1
                if tuple(target.shape) != size:
                    raise IntegrityError(
                        f"{source}: {req.storage_index.fqn} has size {size} here, the model wants "
                        f"{tuple(target.shape)}",
                        path=source,
                    )
                hi = lo + span * ti.dtype.itemsize if math.prod(size) else lo
                copies.append(Copy(req, target, name, lo, hi, ti.dtype, src))
        return copies, byte_items

    # -- reading ------------------------------------------------------------------------
    def _entry(self, name: str) -> FileEntry:
        entry = self.manifest.files.get(name)
        if entry is None:
            raise IntegrityError(
                f"{self.ckpt_dir}: the load reads {name}, which the manifest does not list",
                path=os.path.join(self.ckpt_dir, name),
            )
        return entry

    def _mapped(self, name: str) -> Any:
        if name not in self._maps:
            self._maps[name] = self._map(name)
        return self._maps[name]

    def _path(self, name: str) -> str:
        return os.path.join(self.ckpt_dir, name)

    def _map(self, name: str, limit: int | None = None) -> Any:
        """The file's bytes, mapped (digests and copies read the page cache directly, no buffer is allocated), its
        size checked, not yet its digest."""
        entry = self._entry(name)
        path = resolve_member(self.ckpt_dir, name)
        if limit is not None and entry.size > limit:
            raise IntegrityError(f"{path}: {entry.size} bytes, more than any such file holds", path=path)
        try:
            with open_regular(path, buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                if size != entry.size:
                    raise IntegrityError(
                        f"{path}: size {size} differs from the {entry.size} bytes in the manifest "
                        "(truncated or replaced); not loading it",
                        path=path,
                    )
                if size == 0:
                    return bytearray()
                # ACCESS_COPY: private and writable (torch.frombuffer wants that), copied only if written
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                if hasattr(mmap, "MADV_SEQUENTIAL"):
                    data.madvise(mmap.MADV_SEQUENTIAL)
                if self.read_ahead:
                    readahead(data, 0, READAHEAD)  # the first window; each run of blocks asks for the next
                return data
        except FileNotFoundError:
            raise IntegrityError(f"{path}: missing", path=path) from None


def _run_start(ti: TensorItem, offsets: Any, lengths: Any) -> int | None:
    """The first element (from the storage offset) of region ``offsets`` + ``lengths`` of a contiguous saved tensor,
    if it is one run of bytes (dimensions before one have length 1, those after it are whole: rows, a first-dim
    shard); None if not, or if it does not lie inside the tensor (``narrow`` then says so)."""
    size = ti.size
    if len(offsets) != len(size) or len(lengths) != len(size):
        return None
    if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, size, strict=True)):
        return None
    k = 0
    while k < len(size) and lengths[k] == 1:
        k += 1
    if any(offsets[d] or lengths[d] != size[d] for d in range(k + 1, len(size))):
        return None
    return sum(o * st for o, st in zip(offsets, ti.stride, strict=True))


def _close_maps(maps: list[mmap.mmap]) -> None:
    for m in maps:
        try:
            m.close()
        except BufferError:  # a view of it is still alive (an error's traceback): unmapped with it
            pass


class RangeReader(VerifiedReader):
    """For many small reads of large files (the bounded sanity step: one module's tensors at a time): each read
    verifies only the blocks under the items it reads (a file without block digests: whole) and maps the files
    for that read alone, so what stays resident is what was asked for, not the files. A file with one digest for
    all of it (no block digests) is verified whole, once per reader."""

    read_ahead = False  # a few items of a file per read: the kernel's own readahead is enough

    def __init__(self, path: str, manifest: Manifest, *, threads: int = THREADS) -> None:
        super().__init__(path, manifest, threads=threads)
        self._whole_verified: set[str] = set()

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file = self._per_file(plan)
        maps = {name: self._map(name) for name in per_file}  # not kept: unmapped once the copies are made
        blocks: list[Block] = []
        for name, items in per_file.items():
            every = blocks_of(name, self._entry(name), len(maps[name]))
            if not every or every[0].whole:
                if name not in self._whole_verified:
                    blocks += every
                continue
            size = every[0].end - every[0].start
            under = {
                k
                for _, info in items
                if info.length
                for k in range(info.offset // size, (info.offset + info.length - 1) // size + 1)
            }
            blocks += [every[k] for k in sorted(under) if k < len(every)]
        for b in blocks:
            err = verify(maps[b.name], b, self._path(b.name))
            if err is not None:
                raise err
        self._whole_verified.update(b.name for b in blocks if b.whole)
        copies, byte_items = self._locate(per_file, maps, Locator(), lambda req: planner.resolve_tensor(req).detach())
        for c in copies:
            if c.hi > c.lo:
                c.dst.copy_(c.source(maps[c.name]))
            c.src = None  # the last view of the map: it goes with the dict below
        self.bytes_read += sum(b.end - b.start for b in blocks)
        maps.clear()
        return self._hand_on(planner, copies, byte_items)
