"""Builds the reference job's model, optimizer and schedule from a plain config dict.

The same builder serves training (``ckptflow.trainer.train``) and the restore sanity
step (``ckptflow.tasks.sanity``), which finds it by the ``module:function`` name recorded in
every manifest — so a checkpoint says how to rebuild what it holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ckptflow.trainer.errors import ConfigError
from ckptflow.trainer.reference.data import DataConfig, GlobalSampler, probe_batch
from ckptflow.trainer.reference.model import ModelConfig, Transformer, lm_loss

BUILDER = "ckptflow.trainer.reference.build:build"


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything that defines the experiment (hashed into the manifest's config hash).

    Resume-safe settings (max steps, save interval, paths, world size) are *not* here.
    """

    model: dict = field(default_factory=lambda: ModelConfig.preset("small").to_dict())
    global_batch: int = 8
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    schedule_steps: int = 1000
    weight_decay: float = 0.1
    seed: int = 1234
    parallel: str = "fsdp"
    data_samples: int = 1 << 16

    def __post_init__(self) -> None:
        if self.parallel not in ("fsdp", "ddp", "none"):
            raise ConfigError(f"TrainConfig.parallel={self.parallel!r}; choose fsdp, ddp or none")
        if self.warmup_steps < 0 or self.schedule_steps <= self.warmup_steps:
            raise ConfigError(
                f"TrainConfig: need 0 <= warmup_steps ({self.warmup_steps}) < schedule_steps ({self.schedule_steps})"
            )

    def data(self) -> DataConfig:
        m = ModelConfig.from_dict(self.model)
        return DataConfig(seed=self.seed, num_samples=self.data_samples, seq_len=m.seq_len, vocab_size=m.vocab_size)

    def to_dict(self) -> dict:
        return asdict(self)


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` at ``schedule_steps``."""

    def f(i: int) -> float:
        if i < cfg.warmup_steps:
            return (i + 1) / cfg.warmup_steps
        t = min(1.0, (i - cfg.warmup_steps) / (cfg.schedule_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return f


@dataclass
class Built:
    cfg: TrainConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    probe: torch.Tensor
    raw_model: torch.nn.Module

    def probe_loss(self) -> float:
        """Loss on the fixed probe batch: eval mode, no grad (no RNG use, no state change)."""
        was = self.model.training
        self.model.eval()
        with torch.no_grad():
            loss = float(lm_loss(self.model, self.probe))
        self.model.train(was)
        return loss

    # SanitySpec(reference="next_step"): replay the loop's first step after a checkpoint.
    def replay_sampler(self, world_size: int) -> GlobalSampler:
        """Rank 0's share of the data at the saving world size; the sanity step restores its
        position from the checkpoint."""
        return GlobalSampler(self.cfg.data(), global_batch=self.cfg.global_batch, rank=0, world_size=world_size)

    def replay_loss(self, sampler: GlobalSampler) -> float:
        """What ``trainer.reference.job``'s loop computes at a step: the forward pass in train mode
        (dropout draws from the restored RNG) on the sampler's next batch. Autograd stays on, as
        in the loop, so every kernel is the one the loop ran; nothing steps."""
        was = self.model.training
        self.model.train()
        with torch.enable_grad():
            loss = float(lm_loss(self.model, sampler.next_batch()))
        self.model.train(was)
        return loss


def build(config: dict[str, Any], *, parallel: str | None = None) -> Built:
    """Model (sharded per ``parallel``), AdamW and the LR schedule for ``config``."""
    cfg = TrainConfig(**config)
    mode = parallel or cfg.parallel
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank and attempt
    raw = Transformer(ModelConfig.from_dict(cfg.model))
    model: torch.nn.Module = raw
    if mode == "fsdp" and dist.is_initialized():
        from torch.distributed.fsdp import fully_shard

        for blk in raw.blocks:
            fully_shard(blk)
        fully_shard(raw)
    elif mode == "ddp" and dist.is_initialized() and dist.get_world_size() > 1:
        model = torch.nn.parallel.DistributedDataParallel(raw)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    return Built(cfg, model, opt, sched, probe_batch(cfg.data()), raw)
