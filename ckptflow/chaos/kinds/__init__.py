"""Trial kinds: each module has ``plan(rng, campaign) -> params`` and ``run(campaign, plan)``."""

from __future__ import annotations

from types import ModuleType


def module(kind: str) -> ModuleType:
    """The kind's module, imported on first use (a kill-only campaign never loads the rest)."""
    import importlib

    return importlib.import_module(f"ckptflow.chaos.kinds.{kind}")
