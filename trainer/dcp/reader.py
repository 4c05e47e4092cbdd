"""Loading a DCP checkpoint at disk speed, every byte verified in the same read, nothing unpickled.

:class:`VerifiedReader` replaces DCP's ``FileSystemReader`` (which unpickles); the files stay standard DCP.
``.metadata`` is checked against its digest and parsed by ``format/dcpmeta.py``'s allow-list; data files are mapped
and verified block by block on every core (``_verifiedcopy.py``, files without block digests whole first), and no
destination receives a byte of a block that has not matched. Tensor items are located without unpickling
(``_tensoritem.py``). A mismatch fails the load on every rank (``loader.load_local``). See docs/architecture.md,
"Resume".
"""

from __future__ import annotations

import functools
import io
import math
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.tensor import DTensor
from torch.futures import Future

from ckptflow.trainer import memcopy
from ckptflow.trainer._torch_private import (
    local_tensor,
    narrow_tensor_by_index,
)
from ckptflow.trainer.dcp._tensoritem import Locator, TensorItem
from ckptflow.trainer.dcp._verifiedcopy import (
    READAHEAD,
    Block,
    Copy,
    Pool,
    Schedule,
    Streamer,
    blocks_of,
    readahead,
    run_pieces,
    runs,
    verify,
    verify_run,
)
from ckptflow.trainer.errors import IntegrityError
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.dcpmeta import MAX_METADATA_BYTES, loads_dcp_metadata
from ckptflow.trainer.format.manifest import FileEntry, Manifest
from ckptflow.trainer.verify import resolve_member

__all__ = ["THREADS", "VerifiedReader"]


RECORD_PAGE = 8192  # the zip records of a tensor item lie in its first and last few KiB
THREADS = 4
"""Threads of the pool that verifies and copies."""
STREAM_FIRST_OF_MEMORY = 0.5
"""Cold files up to this share of available memory have items located behind their stream (``_ask_for_records``)."""
LOCATE_BATCH = 64
"""Items located per batch behind a stream; each batch's copies are scheduled before the next is located."""
WAKE_SECONDS = 0.05
"""How often a thread waiting for a stream looks whether the load stopped meanwhile."""

Item = tuple[ReadItem, Any]
"""A planned read and its item's record in ``.metadata`` (``storage_data``: file, offset, length)."""


class VerifiedReader(FileSystemReader):
    """A ``StorageReader`` for one local checkpoint directory and its (authenticated) manifest."""

    def __init__(self, path: str, manifest: Manifest, *, threads: int = THREADS, prefetch: Iterable[str] = ()) -> None:
        """``prefetch``: files this rank will most likely read (its own, at the saving world size), mapped by
        ``read_metadata`` and streamed in while DCP plans the load. Call :meth:`close` when done."""
        super().__init__(path)
        self.ckpt_dir = os.fspath(path)
        self.manifest = manifest
        self.threads = max(1, threads)
        self._md: Metadata | None = None
        self._prefetch = [n for n in prefetch if n in manifest.files]
        self._pool: Pool | None = None
        self._maps: dict[str, Any] = {}
        self._warm: set[str] = set()  # files found in the page cache when mapped
        self._stream_of: dict[str, Streamer] = {}
        self._stream_first: set[str] = set()  # cold files located behind their stream
        self.bytes_read = 0

    def close(self) -> None:
        """Stop the reader's threads; none touches a destination after this returns."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        for st in self._stream_of.values():
            st.stop()
        self._stream_of.clear()

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
            # The rank's own files first: they stream in on other threads while this one parses and plans.
            for name in self._prefetch:
                try:
                    self._mapped(name)
                except IntegrityError:
                    pass  # read_data reports it, if the load reads that file at all
            data = bytes(self._read_whole(layout.DCP_METADATA, limit=MAX_METADATA_BYTES))
            self._md = loads_dcp_metadata(data, source=os.path.join(self.ckpt_dir, layout.DCP_METADATA))
            self._ask_for_records(self._prefetch)
        return self._md

    def _ask_for_records(self, names: Iterable[str]) -> None:
        """For the cold files among ``names``, get the pages holding each item's zip records before it is located:
        behind the stream (``_locate_behind``: one sequential read) if they fit in the page cache with room to spare
        (``STREAM_FIRST_OF_MEMORY``), else every item's first and last page asked for at once."""
        assert self._md is not None
        wanted = {n for n in names if n in self._maps and n not in self._warm}
        if not wanted:
            return
        if sum(len(self._maps[n]) for n in wanted) <= STREAM_FIRST_OF_MEMORY * _available_memory():
            self._stream_first |= wanted
            return
        for info in self._md.storage_data.values():
            if info.relative_path in wanted:
                data = self._maps[info.relative_path]
                readahead(data, info.offset, RECORD_PAGE)
                readahead(data, info.offset + info.length - RECORD_PAGE, RECORD_PAGE)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # Each item's record looked up once: a MetadataIndex key hashes and compares in Python.
        per_file: dict[str, list[Item]] = {}
        records = self.storage_data
        for req in plan.items:
            info = records[req.storage_index]
            per_file.setdefault(info.relative_path, []).append((req, info))
        names = sorted(per_file, key=lambda n: -self._entry(n).size)
        maps = {name: self._mapped(name) for name in names}
        self._ask_for_records(set(names) - set(self._prefetch))
        blocks = {name: blocks_of(name, self._entry(name), len(maps[name])) for name in names}
        every = [b for name in names for b in blocks[name]]
        # Streamed and warm files are located behind their stream, while the threads verify their first blocks;
        # the rest (cold files too large to stream first) is located first, then verified.
        along = self._stream_first | self._warm
        behind = {n: st for n in names if n in along and (st := self._stream_of.get(n)) is not None}
        locator, resolve = Locator(), _Targets(planner)
        resolve.prepare(plan.items)  # before the threads start (a load at another world size)
        sched: Schedule | None = None
        try:
            try:
                copies, byte_items = self._locate(
                    {n: r for n, r in per_file.items() if n not in behind}, maps, locator, resolve
                )
            except IntegrityError:
                # A damaged file is reported as such, not as the parse it broke: verify, copy nothing.
                for name in names:
                    self._submit(maps[name], blocks[name], None)
                self._threads().drain()
                raise
            sched = Schedule(every, maps, self.threads)
            sched.add(copies)  # nothing has matched yet: every copy waits for its blocks
            # The threads verify, copy each block's pieces once it matched and queue what that made runnable;
            # this thread only waits (waking it per block would take the GIL from the threads).
            for name in names:
                self._submit(maps[name], blocks[name], sched, behind.get(name))
            try:
                for name, st in behind.items():
                    got, got_bytes = self._locate_behind(name, per_file[name], maps, st, sched, locator, resolve)
                    copies += got
                    byte_items += got_bytes
            except IntegrityError:
                self._threads().drain()  # a block that does not match is what to report, if one does
                raise
            self._threads().drain()
        finally:
            self.close()  # no thread touches a destination after this returns or raises,
            if sched is not None:
                sched.device.settle()  # and no copy to a device is still in flight
        self.bytes_read += sum(len(m) for m in maps.values())
        for req, data in byte_items:
            planner.load_bytes(req, io.BytesIO(data))
        for c in copies:
            planner.commit_tensor(c.req, c.dst)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    # -- verifying ----------------------------------------------------------------------
    def _threads(self) -> Pool:
        if self._pool is None:
            self._pool = Pool(self.threads)
        return self._pool

    def _submit(self, data: Any, blocks: list[Block], sched: Schedule | None, stream: Streamer | None = None) -> None:
        for run in runs(blocks):
            self._threads().submit(1, functools.partial(self._verify_run, data, run, sched, stream))

    def _verify_run(self, data: Any, run: list[Block], sched: Schedule | None, stream: Streamer | None) -> None:
        """Verify consecutive blocks, copying each one's pieces right after it matched and queueing what that made
        runnable. A mismatch raises: the pool stops and ``drain`` re-raises it on the caller's thread. ``stream``:
        the file is streaming in, and the run waits until it is in (not faulted in beside the stream)."""
        pool = self._threads()
        if stream is None:
            readahead(data, run[0].start + READAHEAD, run[-1].end - run[0].start)
        else:
            while not stream.wait_past(run[-1].end, timeout=WAKE_SECONDS):
                if pool.stopped:
                    return
        path = os.path.join(self.ckpt_dir, run[0].name)
        if sched is not None and memcopy.VERIFY_COPY and not run[0].whole:
            if pool.stopped:
                return
            n, tasks = verify_run(run, sched)
            for task in tasks:
                pool.submit(0, task)
            if n < len(run):
                raise verify(data, run[n], path) or IntegrityError(
                    f"{path}: block {run[n].index} did not match its digest, then did; not loading it", path=path
                )
            return
        for b in run:
            if pool.stopped:
                return  # another block failed: the load stops, nothing more is copied
            err = verify(data, b, path)
            if err is not None:
                raise err
            if sched is not None:
                pieces, tasks = sched.match(b)
                run_pieces(pieces, sched.device)
                for task in tasks:
                    pool.submit(0, task)

    def _locate_behind(
        self,
        name: str,
        items: list[Item],
        maps: dict[str, Any],
        stream: Streamer,
        sched: Schedule,
        locator: Locator,
        resolve: Callable[[ReadItem], torch.Tensor],
    ) -> tuple[list[Copy], list[tuple[ReadItem, bytes]]]:
        """:meth:`_locate` the items of a file streaming in as the stream passes their ends (their zip records are in
        their first and last bytes), and schedule their copies at once: those whose blocks matched run now."""
        todo = sorted(items, key=lambda it: it[1].offset + it[1].length)
        ends = [info.offset + info.length for _, info in todo]
        copies: list[Copy] = []
        byte_items: list[tuple[ReadItem, bytes]] = []
        pool = self._threads()
        i = 0
        while i < len(todo) and not pool.stopped:
            if not stream.wait_past(ends[i], timeout=WAKE_SECONDS):
                continue
            j, reached = i + 1, stream.reached
            while j < len(todo) and ends[j] <= reached and j - i < LOCATE_BATCH:
                j += 1
            got, got_bytes = self._locate({name: todo[i:j]}, maps, locator, resolve)
            for task in sched.add(got):
                pool.submit(0, task)
            copies += got
            byte_items += got_bytes
            i = j
        return copies, byte_items

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

    def _read_whole(self, name: str, limit: int | None = None) -> Any:
        """The file's bytes, refused unless they match the manifest (its whole-file digest)."""
        data = self._map(name, limit=limit)
        if len(data):
            err = verify(data, Block(name, 0, 0, len(data), self._entry(name).checksum, whole=True), self._path(name))
            if err is not None:
                raise err
        return data

    def _mapped(self, name: str) -> Any:
        if name not in self._maps:
            self._maps[name] = self._map(name)
            if len(self._maps[name]):  # a cold file streams from disk in order (a warm one: skipped)
                data = self._maps[name]
                st = Streamer(self._path(name), len(data), data)
                self._stream_of[name] = st
                if st.warm:
                    self._warm.add(name)
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
            with open(path, "rb", buffering=0) as f:
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


class _Targets:
    """``planner.resolve_tensor``, detached: where each read's bytes go; a dictionary look-up (no ``to_local()``,
    no autograd node) where the planner resolves as DCP's default does. :meth:`prepare` makes the narrows before the
    load's threads start, since a torch call made while they run must win the GIL back from them."""

    def __init__(self, planner: LoadPlanner) -> None:
        self._planner = planner
        self._early: dict[int, torch.Tensor] = {}
        direct = isinstance(planner, DefaultLoadPlanner) and all(
            getattr(type(planner), n) is getattr(DefaultLoadPlanner, n)
            for n in ("resolve_tensor", "lookup_tensor", "transform_tensor")
        )
        # Empty unless the planner resolves as DCP's default: each read then goes through its own resolve_tensor.
        self._state: Mapping[str, Any] = (
            planner.state_dict if direct and isinstance(planner, DefaultLoadPlanner) else {}
        )

    def prepare(self, reqs: Iterable[ReadItem]) -> None:
        """Resolve now (before the load's threads start) each tensor read in ``reqs`` that is not a whole plain
        tensor; the others are looked up as they are located."""
        for req in reqs:
            if req.type != LoadItemType.BYTE_IO and self._whole(req) is None:
                self._early[id(req)] = self._resolve(req)

    def __call__(self, req: ReadItem) -> torch.Tensor:
        obj = self._whole(req)
        if obj is not None:
            return obj.detach() if obj.requires_grad else obj
        early = self._early.pop(id(req), None)
        return early if early is not None else self._resolve(req)

    def _whole(self, req: ReadItem) -> torch.Tensor | None:
        """The destination if it is a whole plain tensor (or DTensor shard) and the planner DCP's default, by a
        look-up (no torch call that waits for the GIL); None otherwise."""
        obj = self._local(req)
        if obj is None or any(req.dest_offsets) or tuple(req.lengths) != tuple(obj.shape):
            return None
        return obj

    def _local(self, req: ReadItem) -> torch.Tensor | None:
        idx = req.dest_index
        obj = self._state.get(idx.fqn)
        if type(obj) is DTensor and not any(p.is_partial() for p in obj.placements):  # (DCP refuses those)
            obj = local_tensor(obj)
        if type(obj) is not torch.Tensor or (idx.offset is not None and any(idx.offset)):
            return None
        return obj

    def _resolve(self, req: ReadItem) -> torch.Tensor:
        obj = self._local(req)
        if obj is None:
            return self._planner.resolve_tensor(req).detach()  # and its errors
        # DCP's narrow, of the detached tensor
        return narrow_tensor_by_index(obj.detach() if obj.requires_grad else obj, req.dest_offsets, req.lengths)


def _available_memory() -> int:
    """``MemAvailable`` (bytes): what the page cache can hold without evicting much; 0 if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _close_maps(maps: list[mmap.mmap]) -> None:
    for m in maps:
        try:
            m.close()
        except BufferError:  # a view of it is still alive (an error's traceback): unmapped with it
            pass
