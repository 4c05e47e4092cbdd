"""Storage tiers: one small interface over fsspec, rename commits on file systems and
marker commits on object stores (S3 extras through boto3), pins and leases.

Public names are re-exported here; import from ``tasks.storage``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptflow.tasks.storage.index import StoredFile, TierIndex
from ckptflow.tasks.storage.leases import Lease, acquire_lease, active_leases, leased_steps
from ckptflow.tasks.storage.tier import StoredCheckpoint, Tier

if TYPE_CHECKING:
    from ckptflow.tasks.config import CkptflowConfig


def open_tiers(config: CkptflowConfig) -> list[Tier]:
    """Tiers of a :class:`tasks.config.CkptflowConfig` in restore order (hot, warm, cold)."""
    return [Tier(t) for t in config.tiers()]


__all__ = [
    "Lease",
    "StoredCheckpoint",
    "StoredFile",
    "Tier",
    "TierIndex",
    "acquire_lease",
    "active_leases",
    "leased_steps",
    "open_tiers",
]
