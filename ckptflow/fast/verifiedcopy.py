"""Copying a mapped checkpoint file into live tensors, each byte only once its digest matched.

The acceleration layer's reader (``reader.py``) hands over the file's *blocks* (byte ranges with their manifest
digests) and the *copies* (which bytes go to which tensor). A pool of threads verifies block after block and copies
each matched block's bytes while they are still in cache. A destination never receives a byte whose block has not
matched; a block that does not match stops the load. A file whose manifest entry has no block digests is one block
(its ``checksum`` digest).
"""

from __future__ import annotations

import functools
import itertools
import os
import queue
import threading
from array import array
from collections.abc import Callable
from typing import Any

import torch

from ckptflow.fast import memcopy
from ckptflow.fast.devicecopy import DeviceCopies, Span, staged
from ckptflow.trainer.dcp.reader import Block, Copy
from ckptflow.trainer.errors import IntegrityError
from ckptflow.trainer.safeopen import open_regular_fd

TASK_BYTES = 8 << 20
"""Blocks are verified in runs of about this many bytes per task (a task costs ~20 us)."""
FAULT_AROUND = 64 << 10
"""What one page fault on a mapped file maps of resident pages (Linux's default ``fault_around_bytes``; where it is
less, the digests fault in the rest themselves)."""
STREAM_CHUNK = 32 << 20
"""What a cold file's stream brings in per step (``Streamer``) before the pool's threads may verify it; large, as each
step ends in a wait for the GIL (up to 5 ms while the load is planned)."""
MAP_PIECE = 256 << 20
"""Bytes whose pages one torch op maps (below torch's grain for parallel ops; short, so a stop waits little)."""


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


Piece = tuple[Any, Any, int]
"""``(dst, src, n)``: ``n`` bytes from address ``src`` to ``dst``, an address (host: ``memcopy.copy``) or
``(flat, at)``, byte ``at`` of a CUDA tensor as flat uint8 (staged, copied asynchronously: ``devicecopy.py``); or,
with ``n == 0``, tensor ``src`` copied into tensor ``dst`` (any other device)."""


class Schedule:
    """Which copies may run once a given block has matched its digest.

    A copy of one contiguous byte run into a contiguous destination of the same dtype is split at block boundaries
    into pieces, each run by whichever thread verified its block (:meth:`match`). Any other copy (a strided narrow,
    a cast) runs whole once every block it spans matched; a file verified whole releases all its copies at once, in
    ``threads`` batches of about equal bytes. Copies may be added while blocks are verified (:meth:`add`); one lock
    ensures no byte is copied before its block matched. CUDA copies are not waited for until ``device.settle()``."""

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
        """The pieces waiting for each of ``blocks``, taken by a caller that copies each block's right after it matched
        (:func:`verify_run`); pieces added for them later wait for :meth:`match`."""
        with self._lock:
            return [self.pieces.pop((b.name, b.index), []) for b in blocks]

    def match(self, *blocks: Block) -> tuple[list[Piece], list[Callable[[], Any]]]:
        """``blocks`` matched (call once for each): the pieces in them, for the caller to copy now
        (:func:`run_pieces`), and the other copies their match makes runnable, as tasks."""
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
    """Verify a run of consecutive blocks of one file (not ``whole``) in one C call (:func:`memcopy.verify_copy`, only
    where :data:`memcopy.VERIFY_COPY`: the GIL taken once per run, not per block), copying each block's pieces right
    after it matched. Returns how many blocks matched (a mismatch stops the run: nothing of it or after it is copied)
    and the tasks their match made runnable. CUDA pieces go into one pinned buffer in the same call; their device
    copies are enqueued afterwards, for matched blocks only."""
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
    """``n`` threads running tasks by priority (0 first: copies before further digests, while a block is in cache).
    ``drain`` waits for every task and raises the first error; ``close`` stops the threads, skipping whatever is
    still queued, and returns only when none runs."""

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
    """Brings a cold file into the page cache front to back (``sendfile`` to ``/dev/null``: nothing copied out), so
    readahead streams it at disk speed ahead of the pool's threads, and maps its pages into the process (a warm
    file's all at once: ``_map_pages``), so the digests take no page fault every ``FAULT_AROUND``. :meth:`wait_past`
    waits for it to pass an offset (``FastReader._locate_behind``); ``streamed`` is set when it is through."""

    def __init__(self, path: str, size: int, data: Any = None) -> None:
        """``data``: the file mapped, whose pages this thread then maps into the process too."""
        self._path, self._size, self._data = path, size, data
        # Decided here: a system call on the streaming thread waits for the GIL after it while the caller plans.
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
        """How many of the file's first bytes are in the page cache (all, once the stream is over: after a failure
        the rest is read by whoever touches it)."""
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
        """Stream the file in, mapping each chunk's pages while the disk reads the next; returns how many of its first
        bytes have their pages mapped."""
        if self.warm:
            return 0
        try:
            fd = open_regular_fd(self._path)
        except (OSError, IntegrityError):
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
    """Whether the file's first, middle and last bytes are in the page cache (``mincore`` of every page costs more)."""
    try:
        fd = open_regular_fd(path)
    except (OSError, IntegrityError):
        return False
    try:
        probe = memoryview(bytearray(1))
        return all(os.preadv(fd, [probe], off, os.RWF_NOWAIT) > 0 for off in {0, size // 2, max(0, size - 1)})
    except OSError:  # BlockingIOError: not resident
        return False
    finally:
        os.close(fd)


def _map_pages(data: Any, stop: threading.Event | None = None, start: int = 0) -> None:
    """Map every page of ``data`` (a mapped file in the page cache) from ``start`` on into the process, one read a
    ``FAULT_AROUND`` apart, by torch ops (no GIL; a loop of system calls would wait for it after each). Not
    ``MADV_POPULATE_READ``: it holds the ``mmap_lock`` for the whole range, stalling every large allocation
    meanwhile; faults take only the mapping's own lock."""
    flat = torch.frombuffer(data, dtype=torch.uint8)
    step = MAP_PIECE // FAULT_AROUND * FAULT_AROUND
    for a in range(start, len(flat), step):  # pieces below torch's parallel grain: one thread each
        if stop is not None and stop.is_set():
            return
        _map_range(flat, a, step)


def _map_range(flat: torch.Tensor, start: int, length: int) -> None:
    """Map the (resident) pages of ``flat[start:start + length]`` into the process: one read a ``FAULT_AROUND``
    apart, by a torch op (which holds no GIL)."""
    flat[start : start + length : FAULT_AROUND].sum()
