"""Leases: "a restore or drill is reading this checkpoint", so prune leaves it alone.

A lease is a small record ``<run>/_leases/step_N.<lease-id>.json`` on the tier being
read, with an expiry. It expires on its own, so a reader that dies (OOM-killed drill,
lost node) never blocks retention forever; a holder whose read may outlast the TTL
renews it. Prune checks leases when it plans *and again right before each delete*;
the window left (a lease taken between that check and the delete) is covered by the
reader: restore verifies every byte against the manifest and moves on to the next
checkpoint if the one it read vanished.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ckptflow.tasks.storage.tier import Tier
from ckptflow.trainer.errors import ConfigError
from ckptflow.trainer.format import layout

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Lease:
    run_id: str
    step: int
    holder: str
    lease_id: str
    acquired_at: float
    expires_at: float
    url: str

    def active(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) < self.expires_at


def lease_url(tier: Tier, run_id: str, step: int, lease_id: str) -> str:
    """The one place the lease file name is made (``trainer.layout`` names the folder)."""
    if not lease_id.isalnum():
        raise ConfigError(f"lease id {lease_id!r} must be alphanumeric")
    return layout.join(layout.run_dir(tier.url, run_id), layout.LEASES_DIR, f"{layout.step_name(step)}.{lease_id}.json")


def _parse_name(name: str) -> tuple[int, str] | None:
    if not name.endswith(".json"):
        return None
    stem, _, lease_id = name[: -len(".json")].rpartition(".")
    step = layout.parse_step(stem)
    return (step, lease_id) if step is not None and lease_id.isalnum() else None


def write_lease(tier: Tier, run_id: str, step: int, holder: str, ttl_s: float, lease_id: str | None = None) -> Lease:
    """Create (or renew, with the same ``lease_id``) a lease; returns it."""
    if not ttl_s > 0:
        raise ConfigError(f"lease ttl_s={ttl_s!r} must be > 0")
    lease_id = lease_id or uuid.uuid4().hex
    now = time.time()
    url = lease_url(tier, run_id, step, lease_id)
    lease = Lease(run_id, step, holder, lease_id, now, now + ttl_s, url)
    tier.write_bytes(
        url,
        (
            json.dumps(
                {"run_id": run_id, "step": step, "holder": holder, "acquired_at": now, "expires_at": now + ttl_s}
            )
            + "\n"
        ).encode(),
    )
    return lease


def release_lease(tier: Tier, lease: Lease) -> None:
    tier.remove(lease.url)


@contextmanager
def acquire_lease(
    tier: Tier, run_id: str, step: int, holder: str | None = None, ttl_s: float = 3600.0
) -> Iterator[Lease]:
    """Hold a lease on ``run_id``/``step`` of ``tier`` for the ``with`` block.

    ``holder`` is free text for reports (default: host and pid). Release failures are
    logged, not raised: the lease expires by itself, and failing the restore that just
    succeeded because a small delete failed would be worse.
    """
    holder = holder or f"{socket.gethostname()}:{os.getpid()}"
    lease = write_lease(tier, run_id, step, holder, ttl_s)
    try:
        yield lease
    finally:
        try:
            release_lease(tier, lease)
        except OSError as e:
            log.warning(
                "could not release lease %s (%s); it expires at %s",
                lease.url,
                type(e).__name__,
                time.strftime("%FT%TZ", time.gmtime(lease.expires_at)),
            )


def active_leases(tier: Tier, run_id: str, *, now: float | None = None) -> list[Lease]:
    """Unexpired leases of a run on this tier. An unreadable lease file counts as active
    (when in doubt, do not delete) and is logged by name so someone can remove it."""
    now = time.time() if now is None else now
    leases_dir = layout.join(layout.run_dir(tier.url, run_id), layout.LEASES_DIR)
    out = []
    for name in tier.ls_names(leases_dir):
        parsed = _parse_name(name)
        if parsed is None:
            continue
        step, lease_id = parsed
        url = layout.join(leases_dir, name)
        try:
            raw = tier.read_bytes(url, limit=1 << 16, missing_ok=True)
            if raw is None:  # released while we listed
                continue
            d = json.loads(raw)
            lease = Lease(
                run_id, step, str(d.get("holder", "")), lease_id, float(d["acquired_at"]), float(d["expires_at"]), url
            )
        except (ValueError, KeyError, TypeError) as e:
            log.warning("lease %s is unreadable (%s); treating it as active until it is removed", url, type(e).__name__)
            lease = Lease(run_id, step, "<unreadable>", lease_id, now, now + 3600.0, url)
        if lease.active(now):
            out.append(lease)
    return out


def leased_steps(tier: Tier, run_id: str, *, now: float | None = None) -> set[int]:
    return {lease.step for lease in active_leases(tier, run_id, now=now)}
