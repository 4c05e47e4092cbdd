"""ckptflow's training side: async sharded checkpoints, atomic commit, exact resume.

Public API (three calls in a training loop)::

    ckpt = CheckpointManager(CheckpointConfig(root=..., run_id=...), model=..., optimizer=...,
                             provenance=Provenance(config=..., data_fingerprint=...))
    start = ckpt.load(); ...; ckpt.save(step, metrics); ...; ckpt.close()

Importing this package is cheap; torch.distributed.checkpoint loads on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.errors import (
    CheckpointNotFoundError,
    CkptflowError,
    ConfigError,
    IntegrityError,
    ManifestError,
    MismatchError,
    SaveError,
)

if TYPE_CHECKING:  # pragma: no cover
    from trainer.checkpointer import CheckpointConfig, CheckpointManager, Provenance, SanitySpec

_LAZY = {"CheckpointConfig", "CheckpointManager", "Provenance", "SanitySpec"}


def __getattr__(name: str):
    # Lazy: the CLI and the lifecycle import trainer.* modules without paying for
    # torch.distributed.checkpoint (~8 s cold) unless they need the manager.
    if name in _LAZY:
        from trainer import checkpointer

        return getattr(checkpointer, name)
    raise AttributeError(name)


__all__ = sorted(_LAZY | {"CheckpointNotFoundError", "CkptflowError", "ConfigError", "IntegrityError",
                          "ManifestError", "MismatchError", "SaveError"})
