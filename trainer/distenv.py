"""Process-group set-up that survives torchrun restarts, and a group for checkpoints (gloo).

* Each attempt builds its group on a store prefixed with the attempt number, with an explicit timeout: on
  the plain agent store a restarted worker finds the previous attempt's keys and hangs on a dead address.
* Checkpointing has a group of its own, used only by the checkpoint background thread: async-save
  collectives on the default group beside training's mismatch and abort.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

__all__ = ["DistEnv", "exit_process", "gather", "init_distributed", "on_ranks", "shutdown"]


@dataclass(frozen=True, slots=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    attempt: int
    ckpt_group: dist.ProcessGroup
    ckpt_timeout_s: float = 600.0
    """The checkpoint group's timeout, also bounding each wait of a replica transfer (a lost peer ends a commit)."""

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0


def _store(timeout: timedelta, rank: int, world_size: int, attempt: int) -> dist.Store:
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        return dist.HashStore()
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ["MASTER_PORT"])
    # Under torchrun the agent already hosts a TCPStore on MASTER_PORT; elsewhere rank 0 hosts it.
    use_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    base = dist.TCPStore(
        host,
        port,
        world_size=None if use_agent else world_size,
        is_master=(rank == 0 and not use_agent),
        timeout=timeout,
        wait_for_workers=False,
    )
    return dist.PrefixStore(f"ckptflow/attempt{attempt}/", base)


def init_distributed(*, timeout_s: float = 120.0, ckpt_timeout_s: float = 600.0, threads: int | None = None) -> DistEnv:
    """Initialise the default (training) group and the checkpoint group, under torchrun or as a single
    process (world size 1), so the same code path, DCP's collectives included, runs everywhere."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    # One intra-op thread per core share: no oversubscription, and a fixed count keeps CPU math bitwise stable
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // max(1, local_world)))
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(
            "gloo", store=_store(timeout, rank, world, attempt), rank=rank, world_size=world, timeout=timeout
        )
    ckpt_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=ckpt_timeout_s))
    return DistEnv(rank, world, local_rank, local_world, attempt, ckpt_group, ckpt_timeout_s)


def gather(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``obj``, in rank order (``all_gather_object`` over ``group``; None: the default group)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


T = TypeVar("T")


def on_ranks(
    work: Callable[[], T], *, here: bool, group: dist.ProcessGroup | None, round_s: float, name: str
) -> list[tuple[T | None, str] | None]:
    """``work()`` on every rank where ``here`` (agreed per rank), in a thread, while every rank meets in agreed
    rounds at most ``round_s`` apart (no one collective outlasts the group's timeout however long the work
    takes). Every rank gets each rank's outcome, in rank order: (its result, "") or (None, why it failed); None
    where nothing ran. Without a process group (one process) it is ``work()`` here."""
    from ckptflow.trainer.errors import CkptflowError

    box: list[tuple[T | None, str]] = []

    def run() -> None:
        try:
            box.append((work(), ""))
        except CkptflowError as e:
            box.append((None, str(e)))
        except BaseException as e:  # noqa: BLE001 - any failure must reach the other ranks, not hang them
            box.append((None, f"{type(e).__name__}: {e}"))

    t = threading.Thread(target=run, name=f"ckptflow-{name}", daemon=True) if here else None
    if t is not None:
        t.start()
    many = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    while True:
        if t is not None:
            t.join(timeout=round_s)
        mine = (box[0] if box else None, here)
        every = gather(mine, group) if many else [mine]
        if all(outcome is not None for outcome, ran in every if ran):
            return [outcome if ran else None for outcome, ran in every]


def shutdown(env: DistEnv | None = None) -> None:
    """Tear down in a fixed order once every rank is done: barriers first (the checkpoint group's, whose last
    collectives ran on commit threads, then the default), so no rank destroys its gloo pairs while a peer
    still uses them, which aborts the process after all work succeeded."""
    if not dist.is_initialized():
        return
    for group in ([env.ckpt_group] if env is not None else []) + [None]:
        try:
            dist.barrier(group=group)
        except Exception:  # a peer is already gone: nothing left to coordinate
            pass
    if env is not None:
        dist.destroy_process_group(env.ckpt_group)
    dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End a worker process that finished normally, without interpreter finalization; called after
    :func:`shutdown`, when all it wrote is durable. Why: finalization can tear down torch's C++ threads (gloo
    workers) mid-call and SIGABRT a job that succeeded. Errors still take the normal path, with a traceback."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to lose
            pass
    logging.shutdown()
    os._exit(code)
