"""Storage actions that move a checkpoint between tiers, each idempotent and verified.

* :func:`compress` — the compress stage: stage a checkpoint in a file-system tier's stored form
* :func:`promote`  — onto a file-system tier (hot -> warm), commit by rename
* :func:`archive`  — onto the S3 tier (cold), commit by marker, resumable, no double uploads
* :func:`fetch`    — one stored checkpoint into a local DCP dir, every byte checked
* :func:`restore`  — the newest checkpoint that verifies, hot -> warm -> cold

Plain typed functions (no Prefect): the flows wrap them as tasks.
"""

from __future__ import annotations

from ckptflow.tasks.transfer._archive import archive
from ckptflow.tasks.transfer._fetch import fetch, progress_total
from ckptflow.tasks.transfer._promote import compress, promote
from ckptflow.tasks.transfer._restore import restore
from ckptflow.tasks.transfer.results import FaultHook, FetchResult, RestoreResult, Skipped, TransferResult

__all__ = [
    "FaultHook",
    "FetchResult",
    "RestoreResult",
    "Skipped",
    "TransferResult",
    "archive",
    "compress",
    "fetch",
    "progress_total",
    "promote",
    "restore",
]
