"""The reference model: a small decoder-only transformer (GPT-style, pre-norm).

Plain ``torch.nn`` so it runs anywhere (CPU + gloo in tests), shards with FSDP2
``fully_shard`` per block, and is rebuilt from the ``ModelConfig`` that every
manifest records — which is what the restore sanity step needs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ckptflow.trainer.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    vocab_size: int = 4096
    """Tokens in the vocabulary (the synthetic data uses all of them)."""
    dim: int = 384
    """Model width."""
    n_layers: int = 6
    """Transformer blocks."""
    n_heads: int = 6
    """Attention heads; must divide ``dim``."""
    seq_len: int = 128
    """Maximum sequence length (learned positions)."""
    dropout: float = 0.1
    """Dropout in training; makes the torch RNG part of the state to restore."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"ModelConfig.{name}={v!r} must be a positive integer")
        if self.dim % self.n_heads:
            raise ConfigError(f"ModelConfig.dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"ModelConfig.dropout={self.dropout!r} must be in [0, 1)")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        return cls(**d)

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """Named sizes: ``tiny`` (0.1M) for tests, ``mini`` (2.2M) for the demo, ``small``
        (~14M params) the default job, ``medium`` (~70M) for benchmarks, ``large`` (~218M: a 2.6 GB
        checkpoint, where a load's fixed costs no longer hide its throughput) for ``bench_load``."""
        presets = {
            "tiny": cls(vocab_size=256, dim=64, n_layers=2, n_heads=4, seq_len=32),
            "mini": cls(vocab_size=1024, dim=192, n_layers=4, n_heads=6, seq_len=64),
            "small": cls(),
            "medium": cls(vocab_size=8192, dim=768, n_layers=8, n_heads=12, seq_len=256),
            "large": cls(vocab_size=8192, dim=1024, n_layers=16, n_heads=16, seq_len=256),
        }
        if name not in presets:
            raise ConfigError(f"model preset {name!r} is unknown; choose one of {sorted(presets)}")
        return presets[name]


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.out = nn.Linear(4 * cfg.dim, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                # scaled init on residual projections keeps early loss near log(vocab)
                s = std / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("proj.weight", "out.weight")) else std
                nn.init.normal_(p, mean=0.0, std=s)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on a [batch, seq_len + 1] token tensor."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
