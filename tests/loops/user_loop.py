"""A training loop as a user writes it — not the reference job — with ckptflow's three calls.

    torchrun --nproc-per-node=2 -m tests.loops.user_loop --parallel ddp --root DIR --out OUT

A CNN with BatchNorm and Dropout, AdamW + OneCycleLR, fp16 autocast with a GradScaler,
gradient accumulation, and torchdata's ``StatefulDataLoader`` over a ``DistributedSampler``
(with its own generator, as the README asks) passed to the manager as ``sampler=``; the
epoch lives in ``extra``. Parallelism: none (one process), DDP or FSDP2. At the end every
rank writes its whole state (model parameters and buffers, optimizer, scheduler, scaler,
loader) to ``OUT/final_rank<r>.pt``; at each save step rank 0 also writes the live model's
full state to ``OUT/live_step<N>.pt`` (what an exported checkpoint must equal).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from ckptflow import CheckpointConfig, CheckpointManager, Provenance
from ckptflow.trainer.distenv import exit_process, init_distributed, shutdown


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn1 = nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.c1(x)))
        x = nn.functional.max_pool2d(torch.relu(self.bn2(self.c2(x))), 2)
        return self.head(self.drop(x.flatten(1)))


class Epoch:
    """The loop's own bookkeeping, checkpointed as ``extra``: the epoch, and which sample this
    rank saw last (different on every rank)."""

    def __init__(self) -> None:
        self.epoch = 0
        self.last_sample = -1

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "last_sample": self.last_sample}

    def load_state_dict(self, st: dict) -> None:
        self.epoch, self.last_sample = int(st["epoch"]), int(st["last_sample"])


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    return get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=False))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--parallel", choices=["none", "ddp", "fsdp"], default="none")
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--accum", type=int, default=2)
    a = p.parse_args()
    env = init_distributed()
    torch.manual_seed(0)  # the same initial weights on every rank
    model: nn.Module = Net()
    if a.parallel == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif a.parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=a.steps + 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(256, 1, 8, 8, generator=g), torch.randint(0, 10, (256,), generator=g))
    sampler = DistributedSampler(data, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=3)
    loader = StatefulDataLoader(data, batch_size=8, sampler=sampler, generator=torch.Generator().manual_seed(11))
    extra = Epoch()
    ckpt = CheckpointManager(
        CheckpointConfig(root=a.root, run_id="user", interval=a.every),
        model=model,
        optimizer=opt,
        scheduler=sched,
        scaler=scaler,
        sampler=loader,
        extra=extra,
        provenance=Provenance(config={"loop": "user", "parallel": a.parallel}, data_fingerprint="synthetic-7"),
        env=env,
    )
    start = ckpt.load()
    print(f"user-loop rank={env.rank} attempt={env.attempt} start={start}", file=sys.stderr, flush=True)
    torch.manual_seed(1000 + env.rank) if start == 0 else None  # fresh: per-rank dropout streams
    sampler.set_epoch(extra.epoch)
    it = iter(loader)
    os.makedirs(a.out, exist_ok=True)
    for step in range(start + 1, a.steps + 1):
        for _ in range(a.accum):
            try:
                x, y = next(it)
            except StopIteration:
                extra.epoch += 1
                sampler.set_epoch(extra.epoch)
                it = iter(loader)
                x, y = next(it)
            extra.last_sample = int(x.flatten()[0].mul(1e4).round())  # a fingerprint of this rank's batch
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y) / a.accum
            scaler.scale(loss).backward()
        scaler.step(opt)  # waits for ckptflow's staging first (its pre-hook)
        scaler.update()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if ckpt.save(step, {"loss": float(loss.detach())}, force=(step == a.steps)):
            m, _ = full_state(model, opt)
            if env.rank == 0:
                torch.save(m, os.path.join(a.out, f"live_step{step}.pt"))
    ckpt.close()
    m, o = full_state(model, opt)
    torch.save(
        {
            "model": m,
            "optim": o,
            "sched": sched.state_dict(),
            "scaler": scaler.state_dict(),
            "loader": loader.state_dict(),
            "epoch": extra.state_dict(),
        },
        os.path.join(a.out, f"final_rank{env.rank}.pt"),
    )
    if dist.is_initialized():
        shutdown(env)
    return 0


if __name__ == "__main__":
    exit_process(main())
