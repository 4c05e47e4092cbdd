"""A model too big for the lifecycle worker that checks it, as the sanity step's builder: it holds 1.5 GB on the
CPU before it builds the reference model, whatever device the sanity step builds on (as a builder that reads
weights of its own would)."""

from __future__ import annotations

from typing import Any

HELD: list = []


def build(config: dict[str, Any], *, parallel: str | None = None):
    import torch

    from ckptflow.trainer.reference.build import build as reference

    HELD.append(torch.ones(384 * 2**20, device="cpu"))  # 1.5 GB, every page touched
    return reference(config, parallel=parallel)
