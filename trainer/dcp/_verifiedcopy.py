"""Copying a mapped checkpoint file into live tensors, each byte only once its digest matched.

The reader (``trainer/dcp/reader.py``) hands this module two things: the file's *blocks* (byte
ranges with the digests the manifest records for them) and the *copies* (which bytes of the
file go to which destination tensor). A pool of threads then verifies block after block, and
as soon as a block matched copies its bytes to their destinations while they are still in
cache. A destination never receives a byte whose block has not matched; a block that does
not match stops the load (the copies already made came from blocks that did match).

Files whose manifest entry predates block digests are one block: the whole file under its
``checksum`` digest, copied once it matched.
"""

from __future__ import annotations

import functools
import itertools
import mmap
import os
import queue
import threading
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.planner import ReadItem

from ckptflow.trainer import memcopy
from ckptflow.trainer.devicecopy import DeviceCopies, Span, staged
from ckptflow.trainer.errors import IntegrityError
from ckptflow.trainer.format.checksum import CHUNK, block_digest, new_hasher
from ckptflow.trainer.format.manifest import FileEntry

READAHEAD = 256 << 20
"""How far ahead of the digests a cold file is asked for (``MADV_WILLNEED``): it then streams
from disk while DCP plans and the digests and copies run, instead of one page fault at a time
(cold medium loads: 0.78x a raw read with 256 MiB, 0.74x with 64 MiB, the same without)."""
TASK_BYTES = 8 << 20
"""Blocks are verified in runs of about this many bytes per task (a task costs ~20 us)."""
FAULT_AROUND = 64 << 10
"""What one page fault on a mapped file maps of its resident pages (Linux's default
``fault_around_bytes``; where it is less, the digests fault in the rest themselves)."""
STREAM_CHUNK = 32 << 20
"""What a cold file's stream brings in per step (``Streamer``), up to where the pool's threads may then
verify. Each step ends in a wait for the GIL (up to 5 ms while the load is planned): a cold 167 MB
load, 31 interleaved rounds here, took 1.29x a raw cold read in 8 MiB steps with the sendfile and the
page mapping apart, 1.24x in one C call, 1.18x in one C call of 32 MiB (its stream 1.09 -> 0.96x)."""
MAP_PIECE = 256 << 20
"""Bytes whose pages one torch op maps (4 Ki reads, below torch's grain for parallel ops; ~25 ms
each at most, so a stop waits no longer)."""


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
    """What is verified of a file, piece by piece: its blocks where the manifest records their
    digests, else the whole file as one piece."""
    if not size:
        return []
    if not entry.block_size:
        return [Block(name, 0, 0, size, entry.checksum, whole=True)]
    starts = range(0, size, entry.block_size)
    return [
        Block(name, k, a, min(a + entry.block_size, size), d)
        for k, (a, d) in enumerate(zip(starts, entry.block_digests(), strict=True))
    ]


def runs(blocks: list[Block]) -> list[list[Block]]:
    """Consecutive blocks in runs of about ``TASK_BYTES`` (one task each)."""
    out: list[list[Block]] = []
    n = 0
    for b in blocks:
        if not out or n >= TASK_BYTES or b.whole:
            out.append([])
            n = 0
        out[-1].append(b)
        n += b.end - b.start
    return out


def verify(data: Any, b: Block, path: str) -> IntegrityError | None:
    """None if the block's bytes in ``data`` (the mapped file) have their digest, else the error
    (returned, so the pool's threads never raise)."""
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
    """One tensor item: bytes ``[lo, hi)`` of file ``name`` go to ``dst``. ``src``: the view to
    copy where they are not one contiguous run in ``dst``'s layout (else built only if needed)."""

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
        """The bytes as a tensor of the item's dtype and the destination's shape (no copy). Made
        at its own offset: an item may start at any byte of a DCP file, too odd for a typed view."""
        if self.src is not None:
            return self.src
        flat = torch.frombuffer(data, dtype=torch.uint8, count=self.nbytes, offset=self.lo)
        return flat.view(self.dtype).view(self.dst.shape)


Piece = tuple[Any, Any, int]
"""``(dst, src, n)``: ``n`` bytes from address ``src`` to ``dst`` — an address (host memory: ``memcopy.copy``)
or ``(flat, at)``, byte ``at`` of a CUDA tensor viewed as flat uint8 (staged in pinned memory, then copied
asynchronously: ``trainer/devicecopy.py``) — or (``n == 0``) the tensor ``src`` copied into the tensor
``dst`` (any other device)."""


class Schedule:
    """Which copies may run once a given block has matched its digest.

    A copy of one contiguous run of bytes into a contiguous destination of the same dtype is
    split at the block boundaries into pieces, each run as soon as its own block has matched
    (by whichever thread verified it: :meth:`match`). Any other copy (a resharding narrow with
    strides, a dtype cast) runs whole once every block its source spans has matched, and a file
    verified whole releases all its copies at once, in ``threads`` batches of about equal bytes.

    Copies may be added while blocks are being verified (:meth:`add`: a cold file's items are
    located behind its stream, after their blocks may have matched): what was added before its
    block matched runs at the match, what was added after runs at once. Either way no byte is
    copied before its block matched (one lock orders the two).

    Copies to a CUDA device are enqueued on the copying thread's stream and not waited for:
    :meth:`settle` waits for them all (``device``)."""

    def __init__(self, blocks: list[Block], maps: dict[str, Any], threads: int) -> None:
        self.threads = threads
        self.maps = maps
        self._lock = threading.Lock()
        self.pieces: dict[tuple[str, int], list[Piece]] = {}
        self.waits: dict[tuple[str, int], list[list[Any]]] = {}  # block -> [[blocks left, task]]
        self.whole: dict[str, list[Copy]] = {}
        self.matched: set[tuple[str, int]] = set()
        self._geometry = {b.name: (b.whole, b.end - b.start) for b in blocks if b.index == 0}
        self._bases = {n: torch.frombuffer(maps[n], dtype=torch.uint8) for n in self._geometry}
        self.device = DeviceCopies()

    def settle(self) -> None:
        """Wait for the device copies enqueued so far (call before handing the tensors on, or returning)."""
        self.device.settle()

    def add(self, copies: list[Copy]) -> list[Callable[[], Any]]:
        """Schedule ``copies``; returns those whose blocks all matched already, as tasks to run."""
        now: list[Piece] = []
        tasks: list[Callable[[], Any]] = []
        with self._lock:
            for c in copies:
                if c.hi <= c.lo:
                    continue
                whole, bs = self._geometry[c.name]
                if whole:
                    if (c.name, 0) in self.matched:
                        tasks.append(functools.partial(_copy_batch, [c], self.maps[c.name]))
                    else:
                        self.whole.setdefault(c.name, []).append(c)
                    continue
                ks = range(c.lo // bs, (c.hi - 1) // bs + 1)
                if c.src is None and c.dst.is_contiguous() and c.dst.dtype == c.dtype:
                    base = self._bases[c.name]
                    host = c.dst.device.type == "cpu"
                    flat = None if host else c.dst.reshape(-1).view(torch.uint8)
                    pinned = flat is not None and staged(flat)
                    for k in ks:
                        a, b = max(c.lo, k * bs), min(c.hi, (k + 1) * bs)
                        piece: Piece
                        if flat is None:  # host memory: a plain copy of addresses (no GIL; no tensor views to make)
                            piece = (c.dst.data_ptr() + a - c.lo, base.data_ptr() + a, b - a)
                        elif pinned:
                            piece = ((flat, a - c.lo), base.data_ptr() + a, b - a)
                        else:
                            piece = (flat[a - c.lo : b - c.lo], base[a:b], 0)
                        if (c.name, k) in self.matched:
                            now.append(piece)
                        else:
                            self.pieces.setdefault((c.name, k), []).append(piece)
                else:
                    task = functools.partial(c.dst.copy_, c.source(self.maps[c.name]))
                    left = [k for k in ks if (c.name, k) not in self.matched]
                    if not left:
                        tasks.append(task)
                    wait = [len(left), task]
                    for k in left:
                        self.waits.setdefault((c.name, k), []).append(wait)
        return tasks + [functools.partial(run_pieces, batch, self.device) for batch in _by_bytes(now, TASK_BYTES)]

    def base(self, name: str) -> int:
        """The address of file ``name``'s mapped bytes."""
        return self._bases[name].data_ptr()

    def claim(self, blocks: list[Block]) -> list[list[Piece]]:
        """The pieces waiting for each of ``blocks``, taken by a caller that copies each block's right
        after it matched (:func:`verify_run`); pieces added for them later wait for :meth:`match`."""
        with self._lock:
            return [self.pieces.pop((b.name, b.index), []) for b in blocks]

    def match(self, *blocks: Block) -> tuple[list[Piece], list[Callable[[], Any]]]:
        """``blocks`` matched (call once for each): the pieces that lie in them, for the caller to copy
        now (:func:`run_pieces`), and the other copies their match makes runnable, as tasks."""
        pieces: list[Piece] = []
        tasks: list[Callable[[], Any]] = []
        with self._lock:  # the threads that verified a copy's blocks count them down together
            for b in blocks:
                self.matched.add((b.name, b.index))
                pieces += self.pieces.pop((b.name, b.index), [])
                if b.whole:
                    data = self.maps[b.name]
                    batches = balanced(self.whole.pop(b.name, []), self.threads)
                    tasks += [functools.partial(_copy_batch, batch, data) for batch in batches]
                for wait in self.waits.pop((b.name, b.index), []):
                    wait[0] -= 1
                    if wait[0] == 0:
                        tasks.append(wait[1])
        return pieces, tasks


def verify_run(run: list[Block], sched: Schedule) -> tuple[int, list[Callable[[], Any]]]:
    """Verify a run of consecutive blocks of one file (not ``whole``) in one call of the C extension
    (:func:`memcopy.verify_copy`, only where :data:`memcopy.VERIFY_COPY`), each block's pieces copied
    right after it matched, while its bytes are in cache. Returns how many blocks matched (a block
    that does not match stops the run: nothing of it or after it is copied) and the tasks their
    match made runnable.

    Per block, the Python loop (digest, compare, :meth:`Schedule.match`, copies) took the GIL three or
    four times, while the thread planning and locating the load holds it most of the time (each
    wait for it can last a switch interval, 5 ms); here a run (``TASK_BYTES``) costs one round.
    Interleaved A/B, this host: an 835 MB warm load 89.0 -> 82.5 ms, a 167 MB one 27.3 -> 25.8 ms.

    Pieces bound for a CUDA tensor are copied by the same call into one pinned buffer (a host copy
    like the others, right after their block matched), and their device copies are enqueued once
    it returned, for the blocks that matched only."""
    digests = array("Q", [int(b.digest, 16) for b in run])  # 16 hex digits each (Manifest.from_json)
    bs = run[0].end - run[0].start
    claimed = sched.claim(run)
    to_device = sum(p[2] for pieces in claimed for p in pieces if p[2] and type(p[0]) is not int)
    buf = sched.device.buffer(to_device) if to_device else None
    pinned, off = (buf.data_ptr() if buf is not None else 0), 0
    counts, host = array("Q"), array("Q")
    tensors: list[list[Piece]] = []  # (other devices) copied by torch once their block matched
    spans: list[list[Span]] = []  # (CUDA) out of buf, enqueued once their block matched
    for pieces in claimed:
        mine = 0
        tensors_k: list[Piece] = []
        spans_k: list[Span] = []
        for dst, src, n in pieces:
            if not n:
                tensors_k.append((dst, src, n))
                continue
            if type(dst) is not int:  # a CUDA tensor: its bytes go to buf first
                spans_k.append((dst[0], dst[1], off, n))
                dst = pinned + off
                off += n
            host.extend((dst, src, n))
            mine += 1
        counts.append(mine)
        tensors.append(tensors_k)
        spans.append(spans_k)
    n = memcopy.verify_copy(sched.base(run[0].name), run[0].start, run[-1].end, bs, digests, counts, host)
    if buf is not None:
        sched.device.issue(buf, [s for batch in spans[:n] for s in batch])
    run_pieces([p for batch in tensors[:n] for p in batch], sched.device)
    late, tasks = sched.match(*run[:n])  # pieces added while the run was verified: copied now
    run_pieces(late, sched.device)
    return n, tasks


def run_pieces(pieces: list[Piece], device: DeviceCopies) -> None:
    """Copy ``pieces`` (their blocks matched); CUDA ones through ``device`` (staged, enqueued)."""
    to_device = []
    for p in pieces:
        dst, src, n = p
        if not n:
            dst.copy_(src)
        elif type(dst) is int:
            memcopy.copy(dst, src, n)  # streaming stores: nothing reads the model's bytes soon
        else:
            to_device.append(p)
    if to_device:
        device.copy(to_device)


def _by_bytes(pieces: list[Piece], size: int) -> list[list[Piece]]:
    """``pieces`` in consecutive batches of about ``size`` bytes (a tensor piece counts as its size)."""
    out: list[list[Piece]] = []
    n = size
    for p in pieces:
        if n >= size:
            out.append([])
            n = 0
        out[-1].append(p)
        n += p[2] or p[1].numel()
    return out


def _copy_batch(batch: list[Copy], data: Any) -> None:
    for c in batch:
        c.dst.copy_(c.source(data))


def balanced(copies: list[Copy], n: int) -> list[list[Copy]]:
    """``copies`` in ``n`` batches of about equal bytes (largest first, each to the lightest batch)."""
    batches: list[list[Copy]] = [[] for _ in range(n)]
    load = [0] * n
    for c in sorted(copies, key=lambda c: -c.nbytes):
        i = load.index(min(load))
        batches[i].append(c)
        load[i] += c.nbytes
    return [b for b in batches if b]


class Pool:
    """``n`` threads running tasks by priority (0 first: copies before further digests, so a
    block is copied while it is still in cache). ``drain`` waits for every task and raises the
    first error; ``close`` stops the threads, skipping whatever is still queued, and returns
    only when none runs."""

    def __init__(self, n: int) -> None:
        self._q: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._stop = threading.Event()
        self._pending = 0
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._threads = [threading.Thread(target=self._run, name=f"ckptflow-load-{i}", daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def submit(self, prio: int, fn: Callable[[], Any]) -> None:
        with self._cv:
            self._pending += 1
        self._q.put((prio, next(self._seq), fn))

    def _run(self) -> None:
        while True:
            _, _, fn = self._q.get()
            if fn is None:
                return
            try:
                if not self._stop.is_set():
                    fn()
            except BaseException as e:  # handed to drain(), which re-raises it on the caller's thread
                self._stop.set()
                with self._cv:
                    self._error = self._error or e
            finally:
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def drain(self) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._pending == 0)
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        self._stop.set()
        for _ in self._threads:
            self._q.put((9, next(self._seq), None))
        for t in self._threads:
            t.join()


class Streamer:
    """Brings a cold file into the page cache front to back, so the kernel's sequential readahead
    streams it at disk speed, ahead of the pool's threads (which fault pages at several places
    at once: on their own they read it at 0.7-0.8x a raw read). Each chunk goes to ``/dev/null``
    with ``sendfile``: the kernel reads it into the cache and copies nothing out (6 ms of CPU for
    167 MB against 28-140 ms for reads into a buffer, CPU the digests and copies need on a small
    host; for pages already in the cache it costs next to nothing). :meth:`wait_past` waits for
    it to pass an offset: the reader verifies, locates and copies behind it
    (``VerifiedReader._locate_behind``); ``streamed`` is set when it is through.

    Given the mapping, it also maps the file's pages into the process — each chunk's right after it
    came in, a warm file's all at once (``_map_pages``) — so the digests do not take a page fault
    every 64 KiB: 4 KiB pages cost 14.5 ms of faults per 167 MB here, a third of what hashing and
    copying them costs, and a warm file's are mapped while the caller still plans the load (the
    load's data phase: 26.4 -> 20 ms)."""

    def __init__(self, path: str, size: int, data: Any = None) -> None:
        """``data``: the file mapped, whose pages this thread then maps into the process too."""
        self._path, self._size, self._data = path, size, data
        # Decided on the caller's thread: each system call made on the streaming thread waits for
        # the GIL after it, up to 5 ms while the caller plans the load.
        self.warm = data is not None and _looks_resident(path, size)
        self.streamed = threading.Event()
        """Set once the file has been read front to back (or the stream stopped or failed)."""
        self._reached = 0
        self._moved = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptflow-stream", daemon=True)
        self._thread.start()

    @property
    def reached(self) -> int:
        """How many of the file's first bytes are in the page cache (all, once the stream is over:
        after a failure the rest is read by whoever touches it)."""
        return self._size if self.streamed.is_set() else self._reached

    def wait_past(self, offset: int, timeout: float | None = None) -> bool:
        """Wait until the first ``offset`` bytes are in (or the stream is over); False on timeout."""
        with self._moved:
            return self._moved.wait_for(lambda: self.reached >= offset, timeout)

    def _advance(self, off: int) -> None:
        with self._moved:
            self._reached = off
            self._moved.notify_all()

    def _run(self) -> None:
        mapped = 0
        try:
            mapped = self._stream()
        finally:
            self.streamed.set()  # whatever happened: nobody waits for a stream that is over
            self._advance(self._reached)
        if self._data is not None and not self._stop.is_set():
            _map_pages(self._data, self._stop, start=mapped)

    def _stream(self) -> int:
        """Stream the file in; how many of its first bytes have their pages mapped as well.

        Each chunk's pages are mapped right after it came in, while the disk reads the next: the
        pool's threads verify and copy behind the stream (``VerifiedReader._locate_behind``), and
        find them mapped."""
        if self.warm:
            return 0
        try:
            fd = os.open(self._path, os.O_RDONLY)
        except OSError:
            return 0  # the load reports it
        sink = _null()
        flat = torch.frombuffer(self._data, dtype=torch.uint8) if self._data is not None else None
        addr = flat.data_ptr() if flat is not None else 0  # where stream_in maps the pages (0: it does not)
        off = 0
        try:
            buf: memoryview | None = None
            while off < self._size and not self._stop.is_set():
                n = min(STREAM_CHUNK, self._size - off)
                mapped = False
                if sink is not None:
                    try:
                        if memcopy.STREAM_IN:  # sent and mapped in one call: one wait for the GIL, not two
                            got = memcopy.stream_in(fd, sink, off, n, addr, FAULT_AROUND)
                            mapped = flat is not None
                        else:
                            got = os.sendfile(sink, fd, off, n)
                    except OSError:  # a file system without splice: plain reads from here on
                        os.close(sink)
                        sink = None
                        continue
                else:
                    buf = buf or memoryview(bytearray(STREAM_CHUNK))
                    got = os.preadv(fd, [buf[:n]], off)
                if got <= 0:
                    return off
                if flat is not None and not mapped:
                    _map_range(flat, off, got)
                off += got
                self._advance(off)
            return off
        except OSError:
            return off  # only a hint: the load reads the file itself
        finally:
            os.close(fd)
            if sink is not None:
                os.close(sink)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def join(self, timeout: float | None = None) -> None:
        """Until the file is streamed and its pages mapped (or the thread stopped)."""
        self._thread.join(timeout)


def _null() -> int | None:
    try:
        return os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return None


def _looks_resident(path: str, size: int) -> bool:
    """Whether the file's first, middle and last bytes are in the page cache (``mincore`` of
    every page cost ~5 ms per 167 MB here)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        probe = memoryview(bytearray(1))
        return all(os.preadv(fd, [probe], off, os.RWF_NOWAIT) > 0 for off in {0, size // 2, max(0, size - 1)})
    except OSError:  # BlockingIOError: not resident
        return False
    finally:
        os.close(fd)


def _map_pages(data: Any, stop: threading.Event | None = None, start: int = 0) -> None:
    """Map every page of ``data`` (a mapped file in the page cache) from ``start`` on into the
    process: one read a ``FAULT_AROUND`` apart, each fault mapping that many bytes of resident pages.

    Done by torch ops, which run without the GIL; a loop of system calls here would wait up to
    5 ms for the GIL after each one while the caller plans the load. Not ``MADV_POPULATE_READ``:
    it holds the process's ``mmap_lock`` for the whole range, and every ``mmap`` meanwhile — any
    large allocation on any thread — waited for it (15 ms per 167 MB here); faults take only
    the mapping's own lock."""
    flat = torch.frombuffer(data, dtype=torch.uint8)
    step = MAP_PIECE // FAULT_AROUND * FAULT_AROUND
    for a in range(start, len(flat), step):  # pieces below torch's parallel grain: one thread each
        if stop is not None and stop.is_set():
            return
        _map_range(flat, a, step)


def _map_range(flat: torch.Tensor, start: int, length: int) -> None:
    """Map the (resident) pages of ``flat[start:start + length]`` into the process: one read a
    ``FAULT_AROUND`` apart, by a torch op (which holds no GIL)."""
    flat[start : start + length : FAULT_AROUND].sum()
