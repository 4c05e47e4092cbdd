"""Per-rank worker of ``benchmarks.bench_vs_dcp`` (launched by torchrun; not a CLI for people).

    python -m torch.distributed.run --standalone --nproc-per-node=2 \
        -m benchmarks._vs_dcp_worker --root DIR --out round.json --arms none,dcp,dcp_stager,ckptflow

One round of the comparison. The arms run one after another in the order given, and each
arm gets the same treatment:

1. a fresh model and optimizer (an FSDP2 ``fully_shard`` MLP, Adam; same seed and the same
   fixed batch in every arm, so every arm does the same arithmetic), ``WARMUP_STEPS``
   untimed steps so Adam's state exists, then the arm's checkpointer and one untimed,
   drained save at step 0 (steady state: no first-use costs in the window);
2. the timed loop: ``--steps`` training steps; after every optimizer step the loop offers
   the step to the checkpointer, which saves every ``--save-every`` steps. Timed per save:
   the save call on the training thread and the wait before the next ``optimizer.step()``
   (see ``run_loop``);
3. the drain: the last save is waited for, so that no background work of this arm runs
   into the next arm's window; process CPU time (all threads) is taken over loop + drain;
4. the resume: a second fresh model and optimizer, into which the last checkpoint is
   loaded (timed), then compared tensor by tensor with the trained state;
5. the arm's checkpoint folder is removed.

Rank 0 gathers every rank's records and writes them as JSON to ``--out``; the driver
combines ranks and rounds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ckptflow import CheckpointConfig, CheckpointManager, Provenance
from ckptflow.trainer.distenv import DistEnv, exit_process, init_distributed, shutdown

ARMS = ("none", "dcp", "dcp_stager", "ckptflow")
DEPTH = 8
"""Linear layers of the MLP; the width follows from the state size asked for."""
WARMUP_STEPS = 2
SEED = 1234


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks._vs_dcp_worker")
    p.add_argument("--root", required=True, help="checkpoints go here, one folder per arm")
    p.add_argument("--out", required=True, help="rank 0 writes the gathered records here (JSON)")
    p.add_argument("--arms", default=",".join(ARMS), help="arms in the order to run them")
    p.add_argument("--mb-per-rank", type=float, default=100.0)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--round", type=int, default=0, help="names this round's checkpoint folders")
    return p.parse_args(argv)


# -- the training loop's model ----------------------------------------------------------------
def width_for(mb_per_rank: float, world: int) -> int:
    """MLP width whose parameters plus Adam's two moments (3 x fp32) are ``mb_per_rank`` MB
    (1e6 bytes) per rank once FSDP2 shards them over ``world`` ranks; a multiple of 16."""
    params_total = mb_per_rank * 1e6 * world / 12
    width = math.sqrt(params_total / DEPTH)
    return max(16, int(round(width / 16)) * 16)


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < DEPTH - 1:
                x = torch.relu(x)
        return x


@dataclass
class Trainee:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    x: torch.Tensor
    y: torch.Tensor


def build_trainee(width: int, batch: int, rank: int) -> Trainee:
    """A fresh FSDP2 MLP (one ``fully_shard`` per layer, then the root) with Adam, and this
    rank's fixed batch; identical in every arm."""
    torch.manual_seed(SEED)  # the same initial weights on every rank and in every arm
    model = MLP(width)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(SEED + rank)
    x = torch.randn(batch, width, generator=g)
    y = torch.randn(batch, width, generator=g)
    return Trainee(model, optimizer, x, y)


def forward_backward(t: Trainee) -> None:
    loss = torch.nn.functional.mse_loss(t.model(t.x), t.y)
    loss.backward()


def optimizer_step(t: Trainee) -> None:
    t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)


def local_state(t: Trainee) -> dict[str, torch.Tensor]:
    """This rank's model and optimizer tensors (local shards), by flattened key."""
    model_sd, optim_sd = get_state_dict(t.model, t.optimizer)
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, x: Any) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(f"{prefix}.{i}", v)
        elif isinstance(x, torch.Tensor):
            out[prefix] = x.to_local() if isinstance(x, DTensor) else x

    walk("model", model_sd)
    walk("optim", optim_sd)
    return out


def state_bytes(t: Trainee) -> int:
    return sum(v.numel() * v.element_size() for v in local_state(t).values())


def same_state(a: Trainee, b: Trainee) -> bool:
    sa, sb = local_state(a), local_state(b)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# -- the four checkpointers, behind one small interface ------------------------------------------
class Checkpointer(Protocol):
    def save(self, step: int) -> bool:
        """Called after every optimizer step; True if a save started."""

    def before_optimizer_step(self) -> None:
        """What the loop must wait for before it changes the parameters."""

    def drain(self) -> None:
        """Wait until the last save is complete."""

    def close(self) -> None: ...


class NoCheckpoint:
    def save(self, step: int) -> bool:
        return False

    def before_optimizer_step(self) -> None:
        pass

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


class DcpAsyncSave:
    """``dcp.async_save`` as a careful user drives it.

    * At most one save in flight: the next save first waits for the previous upload (its
      collectives run on the checkpoint group, and a second one in flight would hold a
      second copy of the state).
    * The collectives of the background save run on a gloo group apart from the training
      group (``env.ckpt_group``, which ckptflow's ``init_distributed`` builds; the arms never
      run at once, so they can share it): FSDP2's collectives on the training thread and
      DCP's on the upload thread would otherwise interleave on one group (gloo: mismatch,
      abort).
    * ``staged=False``: the default ``FileSystemWriter`` stages (a blocking CPU copy inside
      ``async_save``), then a thread writes. ``staged=True``: a ``DefaultStager`` with
      ``use_async_staging=True`` copies in its own thread, and the loop must wait for
      ``AsyncSaveResponse.staging_completion`` before the next ``optimizer.step()``. Pinned
      memory and non-blocking copies need an accelerator and are off on a CPU host; shared
      memory serves the process-based executor only and is off with threads.
    """

    def __init__(self, t: Trainee, folder: str, group: dist.ProcessGroup, save_every: int, *, staged: bool) -> None:
        self.t, self.folder, self.group, self.save_every = t, folder, group, save_every
        self.stager: DefaultStager | None = None
        if staged:
            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=False,
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=False,
                )
            )
        self.staging: Future | None = None
        self.upload: Future | None = None
        self.last_path: str | None = None

    def save(self, step: int) -> bool:
        if step % self.save_every:
            return False
        if self.upload is not None:
            self.upload.result()
        model_sd, optim_sd = get_state_dict(self.t.model, self.t.optimizer)
        path = os.path.join(self.folder, f"step_{step}")
        r = dcp.async_save(
            {"model": model_sd, "optim": optim_sd},
            storage_writer=FileSystemWriter(path),
            process_group=self.group,
            async_stager=self.stager,
        )
        if isinstance(r, AsyncSaveResponse):
            self.staging, self.upload = r.staging_completion, r.upload_completion
        else:
            self.staging, self.upload = None, r
        self.last_path = path
        return True

    def before_optimizer_step(self) -> None:
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def drain(self) -> None:
        self.before_optimizer_step()
        if self.upload is not None:
            self.upload.result()

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()  # a caller-owned stager is the caller's to close


def ckptflow_config(root: str, run_id: str, save_every: int, resume: str) -> CheckpointConfig:
    return CheckpointConfig(root=root, run_id=run_id, interval=save_every, emit_events=False, resume=resume)


def provenance(width: int, batch: int) -> Provenance:
    """Required by the manager; checked on load (so the resume uses the same one)."""
    return Provenance(
        config={"bench": "vs_dcp", "width": width, "depth": DEPTH, "batch": batch},
        data_fingerprint="fixed-random-batch",
        code_version="bench",
    )


class Ckptflow:
    """``CheckpointManager`` in its default async mode, as README's three calls use it. Its own
    optimizer pre-hook waits for the staged copy inside ``optimizer.step()``, so
    ``before_optimizer_step`` has nothing to do; ``PreStepHookTimer`` times that wait."""

    def __init__(self, t: Trainee, env: DistEnv, cfg: CheckpointConfig, prov: Provenance) -> None:
        self.mgr = CheckpointManager(cfg, model=t.model, optimizer=t.optimizer, provenance=prov, env=env)

    def save(self, step: int) -> bool:
        return self.mgr.save(step)

    def before_optimizer_step(self) -> None:
        pass

    def drain(self) -> None:
        self.mgr.wait()

    def close(self) -> None:
        self.mgr.close()


class PreStepHookTimer:
    """Times the optimizer step pre-hooks registered between its two hooks.

    Pre-hooks run in the order they were registered: ``start`` goes on before the arm's
    checkpointer is built, ``bracket()`` adds the stop after it, so ``last_s`` is what the
    checkpointer's own hooks (ckptflow's staging wait) took in the latest ``optimizer.step()``;
    for the other arms it is the cost of two empty hooks.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.last_s = 0.0
        self._t0 = 0.0
        self._handles = [optimizer.register_step_pre_hook(self._start)]

    def bracket(self) -> None:
        self._handles.append(self.optimizer.register_step_pre_hook(self._stop))

    def _start(self, *_: Any) -> None:
        self._t0 = time.perf_counter()

    def _stop(self, *_: Any) -> None:
        self.last_s = time.perf_counter() - self._t0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


# -- measuring -------------------------------------------------------------------------------
def cpu_seconds() -> float:
    """User + system CPU time of this process, all its threads together."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_loop(t: Trainee, ckpt: Checkpointer, hooks: PreStepHookTimer, steps: int) -> dict[str, Any]:
    """The timed training loop and the drain after it.

    A save's stall is what the loop pays for it on the training thread: the save call (for
    ckptflow and the DCP arms alike it includes waiting for the previous save, building the
    state dict and any synchronous copy) plus every wait before the next ``optimizer.step()``
    (the explicit one of the DefaultStager arm, ckptflow's inside its pre-hook). A save at the
    last step has no next step in the window: its wait falls into the drain and its
    ``wait_s`` stays None.
    """
    saves: list[dict[str, Any]] = []
    pending: dict[str, Any] | None = None
    dist.barrier()
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    for step in range(1, steps + 1):
        forward_backward(t)
        w0 = time.perf_counter()
        ckpt.before_optimizer_step()
        explicit_wait = time.perf_counter() - w0
        hooks.last_s = 0.0
        optimizer_step(t)
        if pending is not None:
            pending["wait_s"] = explicit_wait + hooks.last_s
            pending = None
        c0 = time.perf_counter()
        started = ckpt.save(step)
        call_s = time.perf_counter() - c0
        if started:
            pending = {"step": step, "call_s": call_s, "wait_s": None}
            saves.append(pending)
    loop_s = time.perf_counter() - t0
    d0 = time.perf_counter()
    ckpt.drain()
    drain_s = time.perf_counter() - d0
    cpu_s = cpu_seconds() - cpu0
    return {"loop_s": loop_s, "drain_s": drain_s, "cpu_s": cpu_s, "saves": saves}


@dataclass
class ArmContext:
    args: argparse.Namespace
    env: DistEnv
    width: int
    prov: Provenance
    folder: str
    run_id: str


def load_dcp(path: str, t: Trainee, group: dist.ProcessGroup) -> None:
    """The DCP resume: state dicts of the fresh model and optimizer, ``dcp.load`` into them,
    then ``set_state_dict`` (DCP's documented pattern for FSDP2 with an optimizer)."""
    model_sd, optim_sd = get_state_dict(t.model, t.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_state_dict(t.model, t.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def timed_resume(arm: str, fresh: Trainee, ctx: ArmContext, ckpt: Checkpointer) -> dict[str, Any]:
    """Load the arm's last checkpoint into ``fresh``, timed from a barrier to the end of the load.

    DCP arms: ``load_dcp`` (its ``get_state_dict`` included: a user must make it). ckptflow:
    ``load()`` of a second manager on the same run (the one that saved has ``resume="never"``,
    which makes its ``load()`` return 0), which verifies every file's checksum while it reads;
    building that manager is timed apart (``setup_s``), outside ``load_s``.
    """
    mgr, setup_s = None, 0.0
    if arm == "ckptflow":
        cfg = ckptflow_config(ctx.folder, ctx.run_id, ctx.args.save_every, resume="required")
        s0 = time.perf_counter()
        mgr = CheckpointManager(cfg, model=fresh.model, optimizer=fresh.optimizer, provenance=ctx.prov, env=ctx.env)
        setup_s = time.perf_counter() - s0
    try:
        dist.barrier()
        t0 = time.perf_counter()
        if mgr is not None:
            step = mgr.load()
        else:
            assert isinstance(ckpt, DcpAsyncSave) and ckpt.last_path is not None
            load_dcp(ckpt.last_path, fresh, ctx.env.ckpt_group)
            step = int(ckpt.last_path.rsplit("_", 1)[1])
        load_s = time.perf_counter() - t0
    finally:
        if mgr is not None:
            mgr.close()
    return {"load_s": load_s, "setup_s": setup_s, "step": step}


def make_checkpointer(arm: str, t: Trainee, ctx: ArmContext) -> Checkpointer:
    if arm == "none":
        return NoCheckpoint()
    if arm in ("dcp", "dcp_stager"):
        return DcpAsyncSave(t, ctx.folder, ctx.env.ckpt_group, ctx.args.save_every, staged=arm == "dcp_stager")
    if arm == "ckptflow":
        cfg = ckptflow_config(ctx.folder, ctx.run_id, ctx.args.save_every, resume="never")
        return Ckptflow(t, ctx.env, cfg, ctx.prov)
    raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")


def run_arm(arm: str, ctx: ArmContext) -> dict[str, Any]:
    """One arm, start to end: fresh model, warm-up, loop + drain, resume, clean-up."""
    a = ctx.args
    t = build_trainee(ctx.width, a.batch, ctx.env.rank)
    for _ in range(WARMUP_STEPS):
        forward_backward(t)
        optimizer_step(t)
    hooks = PreStepHookTimer(t.optimizer)
    ckpt = make_checkpointer(arm, t, ctx)
    hooks.bracket()
    try:
        # One save before the window, drained: one-time costs (lazy imports, thread pools, the
        # first allocation of staging buffers) are not charged to the window's few saves.
        ckpt.save(0)
        ckpt.drain()
        rec = run_loop(t, ckpt, hooks, a.steps)
    finally:
        ckpt.close()
        hooks.remove()
    rec["state_bytes"] = state_bytes(t)
    if arm != "none":
        fresh = build_trainee(ctx.width, a.batch, ctx.env.rank)
        rec["resume"] = timed_resume(arm, fresh, ctx, ckpt)
        # Exact only if the last checkpoint is the final state (steps a multiple of save_every).
        rec["resume"]["exact"] = same_state(t, fresh) if rec["resume"]["step"] == a.steps else None
        del fresh
    dist.barrier()
    if ctx.env.rank == 0:
        shutil.rmtree(ctx.folder, ignore_errors=True)
    dist.barrier()
    return rec


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = init_distributed()  # the training group and a gloo group for checkpoints (env.ckpt_group)
    width = width_for(args.mb_per_rank, env.world_size)
    prov = provenance(width, args.batch)
    res: dict[str, Any] = {"rank": env.rank, "world_size": env.world_size, "width": width, "depth": DEPTH}
    res["torch_threads"] = torch.get_num_threads()
    res["arms"] = {}
    for arm in args.arms.split(","):
        ctx = ArmContext(args, env, width, prov, os.path.join(args.root, arm), f"vsdcp-r{args.round}")
        res["arms"][arm] = run_arm(arm, ctx)
    gathered: list[Any] | None = [None] * env.world_size if env.rank == 0 else None
    dist.gather_object(res, gathered, dst=0)
    if env.rank == 0:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"ranks": gathered}, f)
    shutdown(env)
    return 0


if __name__ == "__main__":
    exit_process(main())
