"""Process-group set-up that survives torchrun restarts, and a group for checkpoints.

Two things learned the hard way on gloo:

* After ``torchrun --max-restarts`` replaces a killed worker, a group built on the
  plain agent store found the *previous* attempt's keys and hung connecting to the
  dead worker's old address. Each attempt therefore builds its group on a store
  prefixed with the attempt number, and with an explicit timeout.
* ``dcp.async_save`` running its collectives on the default group while training
  runs its own collectives crashed (collective mismatch, SIGABRT). Checkpointing
  gets a group of its own, used only by the checkpoint background thread.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    attempt: int
    ckpt_group: dist.ProcessGroup
    ckpt_timeout_s: float = 600.0
    """The checkpoint group's timeout, also the bound on each wait of a replica transfer: a
    peer gone or a link down ends a commit after this long, naming the phase."""

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0


def _store(timeout: timedelta, rank: int, world_size: int, attempt: int) -> dist.Store:
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        return dist.HashStore()
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ["MASTER_PORT"])
    # Under torchrun the agent already hosts a TCPStore on MASTER_PORT; elsewhere
    # rank 0 hosts it.
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
    """Initialise the default (training) group and the checkpoint group.

    Works under torchrun (env vars) and as a plain single process (world size 1),
    so the same code path — including DCP's collectives — runs everywhere.
    """
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    # One intra-op thread per core share: ranks on one node must not oversubscribe,
    # and a fixed count keeps CPU math bitwise reproducible across attempts.
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // max(1, local_world)))
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(
            "gloo", store=_store(timeout, rank, world, attempt), rank=rank, world_size=world, timeout=timeout
        )
    ckpt_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=ckpt_timeout_s))
    return DistEnv(rank, world, local_rank, local_world, attempt, ckpt_group, ckpt_timeout_s)


def shutdown(env: DistEnv | None = None) -> None:
    """Tear down in a fixed order once every rank is done.

    Without the barrier a rank that finished first destroyed its gloo pairs while a
    peer was still tearing down, and gloo's worker threads aborted the process
    ("terminate called without an active exception") after all work had succeeded.
    The checkpoint group gets its own barrier first: its last collectives ran on commit
    threads, so a rank must not close its pairs until every peer is past them too.
    """
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
    """End a worker process that finished normally, without interpreter finalization.

    Called after :func:`shutdown`, when everything the process wrote is durable (commits
    fsync). Finalization would run while torch's C++ threads (gloo's workers, which can
    still hold the last collective's tensors) are alive; one that needs the GIL then is
    torn down mid-call and the process dies with SIGABRT ("terminate called without an
    active exception"), a failed exit for a job that succeeded. Seen about once in a few
    hundred 2-rank jobs here. Errors still take the normal path, with their traceback.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to lose
            pass
    logging.shutdown()
    os._exit(code)
