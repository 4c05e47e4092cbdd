"""``ckptflow chaos``: a fault-injection campaign against scratch copies of your tiers.

    ckptflow chaos --trials 120 --seed 7 [--kinds kill,corrupt,s3,prefect,enospc] [--config C]

Each trial builds isolated tiers (folders under a work dir, a prefix of a bucket on a
moto server the campaign starts itself, a Prefect server only for the ``prefect``
kind), injects one fault with real mechanisms (SIGKILL, damaged bytes, a fault-injecting
S3 proxy, a restarted or silent orchestrator, a full tmpfs), and checks ckptflow's
promises with its own recovery paths. See ``docs/reliability.md`` for the figures.

Layout: :mod:`model` (results and totals), :mod:`campaign` (servers, golden workspace,
baselines), :mod:`workspace` (scratch tiers), :mod:`checks` (invariants),
:mod:`s3proxy`, :mod:`servers`, :mod:`procs`, :mod:`worker` (the process a stage kill
kills), ``kinds/`` (one module per fault kind), :mod:`runner`, :mod:`report`.

Names below are loaded on first use: ``python -m ckptflow.chaos.worker`` imports this package
too, and a worker that is about to be killed should not pay for the campaign's imports.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "Options": "ckptflow.chaos.campaign",
    "KINDS": "ckptflow.chaos.model",
    "TrialResult": "ckptflow.chaos.model",
    "CampaignReport": "ckptflow.chaos.runner",
    "run_campaign": "ckptflow.chaos.runner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ckptflow.chaos' has no attribute {name!r}")
