"""ckptflow's training side: async sharded checkpoints, atomic commit, exact resume.

Public API (three calls in a training loop)::

    ckpt = CheckpointManager(CheckpointConfig(root=..., run_id=...), model=..., optimizer=...,
                             provenance=Provenance(config=..., data_fingerprint=...))
    start = ckpt.load(); ...; ckpt.save(step, metrics); ...; ckpt.close()

Importing this package is cheap; torch.distributed.checkpoint loads on first use.
"""

from __future__ import annotations

if __name__ != "ckptflow.trainer":  # the repository folder imported under its bare name
    raise ImportError(
        f"import ckptflow.trainer, not {__name__}: ckptflow installs one namespace, and a "
        "module loaded under two names would exist twice in one process"
    )

from typing import TYPE_CHECKING

from ckptflow.trainer.errors import (
    CheckpointNotFoundError,
    CkptflowError,
    ConfigError,
    IntegrityError,
    ManifestError,
    MismatchError,
    SaveError,
)

if TYPE_CHECKING:  # pragma: no cover
    from ckptflow.trainer.checkpointer import CheckpointManager
    from ckptflow.trainer.config import CheckpointConfig, Provenance, SanitySpec

_LAZY = {
    "CheckpointConfig": "config",
    "CheckpointManager": "checkpointer",
    "Provenance": "config",
    "SanitySpec": "config",
}


def __getattr__(name: str):
    # Lazy: the CLI and lifecycle import trainer.* without torch.distributed.checkpoint's slow import
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f"ckptflow.trainer.{_LAZY[name]}"), name)
    raise AttributeError(name)


__all__ = [
    "CheckpointConfig",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CkptflowError",
    "ConfigError",
    "IntegrityError",
    "ManifestError",
    "MismatchError",
    "Provenance",
    "SaveError",
    "SanitySpec",
]
