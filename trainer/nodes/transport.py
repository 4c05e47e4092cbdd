"""Moving checkpoint files between nodes over the checkpoint process group.

Why the process group: it already connects every rank, is authenticated by the rendezvous, needs no extra
port, daemon or credentials, and the commit thread owns it, so transfers run in the background in the same
order on every rank, never beside training collectives. Bytes are checked against the manifest on arrival:
the transport is trusted for nothing.

A plan is a list of :class:`Transfer` every rank computed from the same gathered facts. It runs in rounds in
which each rank sends at most one file and receives at most one (pairs matched by construction: no round can
deadlock). A round moves in *steps*, in lock-step on every rank: each transfer of the round moves at most one
chunk, every ``isend``/``irecv`` is waited on with the timeout, and a small all-reduce ends the step, so a rank
with nothing to move waits one step at a time, never for a whole file. The chunk follows the link
(:class:`Pace`, from the slowest transfer of each step, a value every rank has): no single wait grows with the
checkpoint's size, and the group's timeout only has to cover one step on the slowest link. A sender that
cannot read or a receiver that cannot write keeps the byte count (zeros sent, bytes drained) so the rounds
stay in step, and reports the problem; the caller decides from everyone's problems, gathered.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ckptflow.trainer.errors import IntegrityError
from ckptflow.trainer.format.checksum import new_hasher
from ckptflow.trainer.fsutil import fsync_dir
from ckptflow.trainer.safeopen import open_regular

FIRST_CHUNK = 1 << 20
"""The chunk of a plan's first step: small enough that a slow link's first wait stays short."""
MIN_CHUNK, MAX_CHUNK = 64 << 10, 64 << 20
"""The chunk's bounds (loopback gloo, per direction: 4 MiB 298, 16 MiB 270, 64 MiB 358 MB/s)."""
STEP_SHARE = 8
"""A step should take at most ``timeout / STEP_SHARE``: the link may get that much slower mid-step."""


@dataclass(slots=True)
class Pace:
    """The chunk each transfer moves per step. Updated from the slowest transfer of each step, a value every
    rank agreed on (the step's all-reduce), so every rank computes the same chunks: halved (or cut to fit)
    while a step takes more than its share of the timeout, doubled while it takes under a quarter of it."""

    timeout_s: float
    chunk: int = FIRST_CHUNK

    def after(self, slowest_s: float) -> None:
        target = self.timeout_s / STEP_SHARE
        if slowest_s > target:
            fit = int(self.chunk * target / slowest_s)
            self.chunk = max(MIN_CHUNK, min(self.chunk // 2, 1 << max(fit, 1).bit_length() - 1))
        elif slowest_s < target / 4:
            self.chunk = min(MAX_CHUNK, self.chunk * 2)


@dataclass(frozen=True, slots=True, order=True)
class Transfer:
    name: str
    """The file's name in the checkpoint (the manifest's key)."""
    src: int
    dst: int
    size: int
    checksum: str
    """The manifest's digest: what the received bytes must hash to."""


def rounds(plan: list[Transfer]) -> list[list[Transfer]]:
    """Greedy rounds in which no rank sends or receives twice (deterministic: input order)."""
    out: list[list[Transfer]] = []
    busy: list[tuple[set[int], set[int]]] = []
    for t in plan:
        for i, (senders, receivers) in enumerate(busy):
            if t.src not in senders and t.dst not in receivers:
                out[i].append(t)
                senders.add(t.src)
                receivers.add(t.dst)
                break
        else:
            out.append([t])
            busy.append(({t.src}, {t.dst}))
    return out


def run(
    plan: list[Transfer],
    *,
    rank: int,
    group: Any,
    source: Callable[[str], str],
    dest_dir: Callable[[str], str],
    timeout_s: float = 600.0,
    pace: Pace | None = None,
) -> tuple[list[str], int]:
    """Execute the part of ``plan`` that involves ``rank``; every rank calls this with the same plan (and a
    ``pace`` in the same state, or none: a fresh one). ``source(name)``: the local path of a file this rank
    sends; ``dest_dir(name)``: the folder a received file goes into (under a temporary name, fsynced, digest
    checked, then renamed: never a torn or wrong file under the real name). Returns (problems, bytes
    received)."""
    problems: list[str] = []
    received = 0
    pace = pace or Pace(timeout_s)
    timeout = timedelta(seconds=timeout_s)
    send_buf, recv_buf = _Buffer(), _Buffer()
    slowest = torch.zeros(1, dtype=torch.float64)
    for rnd in rounds(sorted(plan)):
        send = next((t for t in rnd if t.src == rank), None)
        recv = next((t for t in rnd if t.dst == rank), None)
        sender = _Sender(send, source, problems) if send is not None else None
        receiver = _Receiver(recv, dest_dir, problems) if recv is not None else None
        done = dict.fromkeys(rnd, 0)  # every rank tracks every transfer of the round: the same steps everywhere
        try:
            first = True
            while first or any(done[t] < t.size for t in rnd):
                # a transfer moves while it has bytes left; an empty file once, as one empty message
                moving = {t for t in rnd if done[t] < t.size or (first and not t.size)}
                first = False
                step = {t: min(pace.chunk, t.size - done[t]) for t in rnd}
                t0 = time.perf_counter()
                works = []
                if sender is not None and send in moving:
                    view = send_buf.view(step[send])
                    sender.fill(view)
                    works.append(dist.isend(view, dst=send.dst, group=group))
                rview = None
                if receiver is not None and recv in moving:
                    rview = recv_buf.view(step[recv])
                    works.append(dist.irecv(rview, src=recv.src, group=group))
                for w in works:
                    if w is not None:
                        w.wait(timeout)
                if receiver is not None and rview is not None:
                    receiver.take(rview)
                slowest[0] = time.perf_counter() - t0 if works else 0.0
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)  # the step's end, on every rank
                pace.after(float(slowest[0]))
                for t in rnd:
                    done[t] += step[t]
        finally:
            if sender is not None:
                sender.close()
        if receiver is not None:
            received += receiver.finish()
    return problems, received


class _Buffer:
    """A byte buffer grown to the largest chunk asked for; chunks are views of it."""

    def __init__(self) -> None:
        self._t = torch.empty(0, dtype=torch.uint8)

    def view(self, n: int) -> torch.Tensor:
        if n > len(self._t):
            self._t = torch.empty(n, dtype=torch.uint8)
        return self._t[:n]


class _Sender:
    def __init__(self, t: Transfer, source: Callable[[str], str], problems: list[str]) -> None:
        self.t, self.problems = t, problems
        self.f = None
        try:
            self.f = open_regular(source(t.name))  # closed in close(), after the last chunk
        except (OSError, IntegrityError) as e:
            problems.append(f"rank {t.src} cannot read {t.name} to send it: {e}")

    def fill(self, view: torch.Tensor) -> None:
        arr = view.numpy()
        # numpy's stub declares ndarray.__buffer__ only for Python 3.12+
        got = self.f.readinto(memoryview(arr)) if self.f is not None else 0  # type: ignore[arg-type]
        if got < len(arr):  # a short or unreadable file: zeros keep the peer in step
            arr[got:] = 0
            if self.f is not None:
                self.problems.append(
                    f"rank {self.t.src}: {self.t.name} is shorter than the {self.t.size} bytes the manifest lists"
                )
                self.f.close()
                self.f = None

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


class _Receiver:
    def __init__(self, t: Transfer, dest_dir: Callable[[str], str], problems: list[str]) -> None:
        self.t, self.problems = t, problems
        self.dir = dest_dir(t.name)
        self.final = os.path.join(self.dir, *t.name.split("/"))
        self.part = f"{self.final}.{uuid.uuid4().hex[:8]}.part"
        self.h = new_hasher()
        self.n = 0
        self.f = None
        try:
            os.makedirs(os.path.dirname(self.final), exist_ok=True)
            self.f = open(self.part, "wb")  # noqa: SIM115 - closed in finish()
        except OSError as e:
            problems.append(f"rank {t.dst} cannot write {self.part}: {e}")

    def take(self, view: torch.Tensor) -> None:
        data = memoryview(view.numpy())  # type: ignore[arg-type]  # numpy's stub: __buffer__ is 3.12+ only
        self.h.update(data)
        self.n += len(data)
        if self.f is not None:
            try:
                self.f.write(data)
            except OSError as e:  # keep draining: the sender does not know
                self.problems.append(f"rank {self.t.dst} could not write {self.part}: {e}")
                self._abandon()

    def _abandon(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None
        try:
            os.unlink(self.part)
        except OSError:
            pass

    def finish(self) -> int:
        if self.f is None:
            return 0
        try:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            self.f = None
            if self.n != self.t.size or self.h.hexdigest() != self.t.checksum:
                self.problems.append(
                    f"{self.t.name} arrived at rank {self.t.dst} with {self.n} bytes, digest "
                    f"{self.h.hexdigest()}; the manifest says {self.t.size} bytes, "
                    f"{self.t.checksum}: not kept"
                )
                self._abandon()
                return 0
            os.replace(self.part, self.final)
            fsync_dir(os.path.dirname(self.final))
            return self.n
        except OSError as e:
            self.problems.append(f"rank {self.t.dst} could not keep {self.final}: {e}")
            self._abandon()
            return 0
