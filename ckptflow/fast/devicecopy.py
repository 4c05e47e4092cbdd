"""Verified bytes into GPU tensors: staged in pinned host memory, copied asynchronously, one stream a thread.

``dst.copy_(src)`` from a mapped file into a CUDA tensor is a synchronous copy from pageable memory on the default
stream. Instead each load thread copies a matched block's bytes into a pinned buffer (in the digest's C call) and
enqueues the host-to-device copies on its own stream without waiting. :meth:`DeviceCopies.settle` waits for them
before the load hands anything on or, on failure, returns: nothing writes a destination after the load is over.
Each thread alternates two pinned buffers (pinning is slow); adjacent pieces of one tensor in a run are one copy.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ckptflow.fast import memcopy

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
        """Enqueue the copies of ``spans`` out of ``buf`` (this thread's latest :meth:`buffer`) on the thread's
        stream for their device, without waiting; adjacent spans of a tensor are one copy."""
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
                # One call for all: each torch op releases the GIL and may wait a switch interval to take it back.
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
