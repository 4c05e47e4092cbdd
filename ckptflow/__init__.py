"""ckptflow: the whole life of a distributed-training checkpoint.

The integration line of a training script::

    from ckptflow import CheckpointConfig, CheckpointManager, Provenance

Importing ``ckptflow`` is cheap (no torch, no Prefect): the names below resolve on
first use, from ``ckptflow.trainer``. The package's parts, lowest layer first:

=====================  ===================================================================
``ckptflow.trainer``   the training-side library: checkpoint format, commit, async save,
                       exact resume (never imports Prefect on the training path)
``ckptflow.tasks``     plain typed functions: tiers, transfers, codecs, retention, stages
``ckptflow.flows``     Prefect flows over the tasks: lifecycle, reconcile, drill, serve
``ckptflow.cli``       the ``ckptflow`` command (the product's interface)
``ckptflow.harness``   real local servers and processes for tests, the demo and chaos
``ckptflow.demo``      ``ckptflow demo``, a harness
``ckptflow.chaos``     ``ckptflow chaos``, the fault-injection campaign, a harness
=====================  ===================================================================
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from ckptflow.trainer.checkpointer import CheckpointManager
    from ckptflow.trainer.config import CheckpointConfig, Provenance, SanitySpec
    from ckptflow.trainer.errors import (
        CheckpointNotFoundError,
        CkptflowError,
        ConfigError,
        IntegrityError,
        ManifestError,
        MismatchError,
        SaveError,
        StorageError,
    )

_LAZY = {
    "CheckpointConfig": "ckptflow.trainer.config",
    "CheckpointManager": "ckptflow.trainer.checkpointer",
    "Provenance": "ckptflow.trainer.config",
    "SanitySpec": "ckptflow.trainer.config",
    "CheckpointNotFoundError": "ckptflow.trainer.errors",
    "CkptflowError": "ckptflow.trainer.errors",
    "ConfigError": "ckptflow.trainer.errors",
    "IntegrityError": "ckptflow.trainer.errors",
    "ManifestError": "ckptflow.trainer.errors",
    "MismatchError": "ckptflow.trainer.errors",
    "SaveError": "ckptflow.trainer.errors",
    "StorageError": "ckptflow.trainer.errors",
}

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
    "StorageError",
]


def __getattr__(name: str) -> Any:
    # PEP 562: `import ckptflow` stays free; the manager (and torch) load on first use.
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ckptflow' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY.keys())
