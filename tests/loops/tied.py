"""The reference model with its output layer's weight tied to the token embedding (one parameter, two
modules), as GPT-2 and many language models do: a sanity-step builder."""

from __future__ import annotations

from typing import Any

BUILDER = "tests.loops.tied:build"


def build(config: dict[str, Any], *, parallel: str | None = None):
    import torch

    from ckptflow.trainer.reference.build import Built, lr_lambda
    from ckptflow.trainer.reference.build import build as reference

    b = reference(config, parallel="none")
    b.raw_model.head.weight = b.raw_model.tok.weight  # tied before the optimizer sees the parameters
    opt = torch.optim.AdamW(b.model.parameters(), lr=b.cfg.lr)
    return Built(b.cfg, b.model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(b.cfg)), b.probe, b.raw_model)
