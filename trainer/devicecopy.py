"""Verified bytes into GPU tensors: staged in pinned host memory, copied asynchronously, one stream a thread.

A load verifies each block of a mapped checkpoint file and then copies its bytes to their
destination (``trainer/dcp/_verifiedcopy.py``). For a tensor on a CUDA device, ``dst.copy_(src)``
from the mapped file is a copy from *pageable* memory: the driver stages it through a bounce
buffer of its own and returns only when it is done, and every thread's copies queue on the one
default stream. Each 1 MiB piece was such a synchronous copy (measured on an H200:
a load into CUDA took 1.5x the same load into host memory).

Here the load's threads copy each matched block's bytes into page-locked (pinned) memory
instead, right after its digest, while they are in cache — a host copy like any other
(``memcopy``), in the same C call as the digest — and then enqueue the host-to-device copies on
a stream of their own, without waiting: the DMA engines move the bytes while the thread verifies
the next run. :meth:`DeviceCopies.settle` waits for every stream before the load hands anything
on (and on failure, before it returns: nothing writes a destination after the load is over).

Each thread stages into two pinned buffers of its own, in turn (it waits, before refilling one,
for the copies out of it: they were enqueued a whole run earlier and are long done). Pinning is
slow (``cudaHostAlloc``), and a resume pays it once: a buffer per run, taken from PyTorch's caching
host allocator, made a fresh load of 2.1 GB 165 ms slower than the next one on the H200; two per
thread pin ~two runs' bytes each (``TASK_BYTES``). A piece is ``(flat, at)``: the destination tensor
viewed as bytes and where in it, and the pieces of one tensor that lie next to each other in a run
are one copy (one ``cudaMemcpyAsync`` per tensor and run, not per 1 MiB block).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ckptflow.trainer import memcopy

Dest = tuple[torch.Tensor, int]
"""``(flat, at)``: byte ``at`` of ``flat``, a destination tensor on a CUDA device viewed as flat uint8."""
Span = tuple[torch.Tensor, int, int, int]
"""``(flat, at, off, n)``: ``n`` bytes at ``off`` of a staging buffer go to byte ``at`` of ``flat``."""


def staged(dst: torch.Tensor) -> bool:
    """Whether bytes bound for ``dst`` go through pinned staging (a CUDA tensor)."""
    return dst.device.type == "cuda"


class DeviceCopies:
    """The asynchronous host-to-device copies of one load, for :meth:`settle` to wait for."""

    def __init__(self) -> None:
        self._local = threading.local()  # each thread's staging buffers and streams
        self._streams: list[Any] = []
        self._lock = threading.Lock()

    def buffer(self, n: int) -> torch.Tensor:
        """This thread's next pinned staging buffer, ``n`` bytes or more, free to overwrite."""
        ring = getattr(self._local, "ring", None)
        if ring is None:
            ring = self._local.ring = [[None, []], [None, []]]  # [buffer, events after its copies]
        slot = ring[0]
        ring.reverse()
        buf, done = slot
        for event in done:
            if not event.query():  # its copies, enqueued a run ago, are almost always done
                event.synchronize()
        slot[1] = []
        if buf is None or buf.numel() < n:
            buf = slot[0] = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        return buf

    def issue(self, buf: torch.Tensor, spans: list[Span]) -> None:
        """Enqueue the copies of ``spans`` out of ``buf`` (this thread's latest :meth:`buffer`) on the
        thread's stream for their device, without waiting; adjacent spans of a tensor are one copy."""
        merged: list[list[Any]] = []
        for flat, at, off, n in spans:
            last = merged[-1] if merged else None
            if last is not None and last[0] is flat and last[1] + last[3] == at and last[2] + last[3] == off:
                last[3] += n
            else:
                merged.append([flat, at, off, n])
        by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for flat, at, off, n in merged:
            dsts, srcs = by_device.setdefault(flat.device, ([], []))
            dsts.append(flat[at : at + n])
            srcs.append(buf[off : off + n])
        done = self._local.ring[1][1]  # the slot buffer() handed out last (now second)
        for device, (dsts, srcs) in by_device.items():
            stream = self._stream(device)
            with torch.cuda.stream(stream):
                # One call for them all: each torch op lets go of the GIL and waits to take it back, up
                # to a switch interval (5 ms) while the load's main thread locates items in Python.
                torch._foreach_copy_(dsts, srcs, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            done.append(event)

    def copy(self, pieces: list[tuple[Dest, int, int]]) -> None:
        """``((flat, at), src address, n)`` pieces of verified host bytes: staged, then enqueued."""
        buf = self.buffer(sum(n for _, _, n in pieces))
        base, off, spans = buf.data_ptr(), 0, []
        for (flat, at), src, n in pieces:
            memcopy.copy(base + off, src, n)
            spans.append((flat, at, off, n))
            off += n
        self.issue(buf, spans)

    def settle(self) -> None:
        """Wait until every copy enqueued so far has run."""
        with self._lock:
            streams = list(self._streams)
        for s in streams:
            s.synchronize()

    def _stream(self, device: torch.device) -> Any:
        mine = getattr(self._local, "streams", None)
        if mine is None:
            mine = self._local.streams = {}
        s = mine.get(device)
        if s is None:
            s = mine[device] = torch.cuda.Stream(device=device)
            with self._lock:
                self._streams.append(s)
        return s
