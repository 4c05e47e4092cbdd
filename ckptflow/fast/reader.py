"""The acceleration layer's reader: the core reader's checks (``trainer/dcp/reader.py``), at disk speed.

Where the core reader verifies every block of a load's files and then copies, this one copies each block's bytes
right after it matched, while they are still in cache, on a pool of threads (``verifiedcopy.py``; the inner loop in C,
``memcopy.py``); streams each cold file in front to back while DCP plans the load (files this rank will most likely
read: from ``read_metadata`` on); locates the items of streamed and warm files behind the stream, while the first
blocks are verified; and stages copies into CUDA tensors in pinned memory (``devicecopy.py``). The guarantees are the
core reader's: no destination receives a byte of a block that has not matched, and a mismatch fails the load.
``benchmarks/bench_load.py`` measures both readers side by side (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.tensor import DTensor
from torch.futures import Future

from ckptflow.fast import memcopy
from ckptflow.fast.verifiedcopy import Pool, Schedule, Streamer, run_pieces, runs, verify_run
from ckptflow.trainer._torch_private import local_tensor, narrow_tensor_by_index
from ckptflow.trainer.dcp._tensoritem import Locator
from ckptflow.trainer.dcp.reader import (
    READAHEAD,
    THREADS,
    Block,
    Copy,
    Item,
    VerifiedReader,
    blocks_of,
    readahead,
    verify,
)
from ckptflow.trainer.errors import IntegrityError
from ckptflow.trainer.format.manifest import Manifest

__all__ = ["FastReader"]


RECORD_PAGE = 8192  # the zip records of a tensor item lie in its first and last few KiB
STREAM_FIRST_OF_MEMORY = 0.5
"""Cold files up to this share of available memory have items located behind their stream (``_ask_for_records``)."""
LOCATE_BATCH = 64
"""Items located per batch behind a stream; each batch's copies are scheduled before the next is located."""
WAKE_SECONDS = 0.05
"""How often a thread waiting for a stream looks whether the load stopped meanwhile."""


class FastReader(VerifiedReader):
    """:class:`~ckptflow.trainer.dcp.reader.VerifiedReader`, accelerated (this module's docstring says how)."""

    def __init__(self, path: str, manifest: Manifest, *, threads: int = THREADS, prefetch: Iterable[str] = ()) -> None:
        """``prefetch``: files this rank will most likely read (its own, at the saving world size), mapped by
        ``read_metadata`` and streamed in while DCP plans the load. Call :meth:`close` when done."""
        super().__init__(path, manifest, threads=threads)
        self._prefetch = [n for n in prefetch if n in manifest.files]
        self._pool: Pool | None = None
        self._warm: set[str] = set()  # files found in the page cache when mapped
        self._stream_of: dict[str, Streamer] = {}
        self._stream_first: set[str] = set()  # cold files located behind their stream

    def close(self) -> None:
        """Stop the reader's threads; none touches a destination after this returns."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        for st in self._stream_of.values():
            st.stop()
        self._stream_of.clear()

    # -- StorageReader ------------------------------------------------------------------
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._md is None:
            # The rank's own files first: they stream in on other threads while this one parses and plans.
            for name in self._prefetch:
                try:
                    self._mapped(name)
                except IntegrityError:
                    pass  # read_data reports it, if the load reads that file at all
            super().read_metadata()
            self._ask_for_records(self._prefetch)
        assert self._md is not None
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
        per_file = self._per_file(plan)
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
        return self._hand_on(planner, copies, byte_items)

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
