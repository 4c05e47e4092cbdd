"""Restore: the newest checkpoint that verifies, looking hot -> warm -> cold.

Candidates are every committed step on every tier, newest step first; for one step
the hotter tier is tried first (faster, and usually the same bytes). Why not "all of
hot, then all of warm": if hot's newest copy is damaged, the same step on warm is a
better answer than an older step on hot — less training is lost.

Each candidate is read under a lease (prune leaves it alone meanwhile) and fetched
with every byte checked (and its ``.metadata`` parsed, as ``ckptflow verify`` does); a
damaged, missing or quarantined one is skipped and named in the result, never loaded.
A failure to write the destination (``DestinationError``: a full disk, a symlinked
``dst_dir``) is not a candidate's: the restore stops there.

``progress`` (optional) hears the bytes of each fetch as it happens; when a candidate
is skipped half-way, the bytes it had reported are taken back with one negative call,
so the sum always describes the candidate being fetched now.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ckptflow.tasks.storage.leases import acquire_lease
from ckptflow.tasks.storage.tier import Tier
from ckptflow.tasks.transfer._fetch import fetch
from ckptflow.tasks.transfer.results import RestoreResult, Skipped
from ckptflow.trainer.errors import (
    CheckpointNotFoundError,
    CkptflowError,
    CodecError,
    DestinationError,
    IntegrityError,
)

if TYPE_CHECKING:
    from types import TracebackType

log = logging.getLogger(__name__)


def restore(
    tiers: Sequence[Tier],
    run_id: str,
    dst_dir: str,
    *,
    step: int | None = None,
    threads: int | None = None,
    holder: str | None = None,
    lease_ttl_s: float = 3600.0,
    progress: Callable[[int], None] | None = None,
    only: set[str] | None = None,
) -> RestoreResult:
    """Fetch the newest good checkpoint of ``run_id`` (or exactly ``step``) into ``dst_dir``.

    ``tiers`` in restore order (hot, warm, cold). Raises CheckpointNotFoundError, listing
    every candidate and why it was passed over, when none verifies. ``only``: these members
    alone (``fetch``).
    """
    t0 = time.perf_counter()
    skipped: list[Skipped] = []
    candidates: list[tuple[int, int, Tier]] = []
    for pos, tier in enumerate(tiers):
        try:
            steps = tier.committed_steps(run_id)
        except Exception as e:  # an unreachable tier must not stop a restore from the others
            # (not only OSError: s3fs passes botocore's EndpointConnectionError through)
            skipped.append(Skipped(tier.url, -1, tier.name, f"cannot list the tier: {type(e).__name__}: {e}"))
            continue
        candidates += [(s, pos, tier) for s in steps if step is None or s == step]
    candidates.sort(key=lambda c: (-c[0], c[1]))

    for s, _, tier in candidates:
        uri = tier.url_for(run_id, s)
        counted = _Counted(progress) if progress is not None else None
        try:
            if tier.is_quarantined(run_id, s):
                skipped.append(Skipped(uri, s, tier.name, "quarantined by the verify stage"))
                continue
            with _lease(tier, run_id, s, holder, lease_ttl_s):
                got = fetch(tier, run_id, s, dst_dir, threads=threads, progress=counted, only=only)
        except DestinationError:
            raise  # where it is written failed (a full disk, a symlink): no other candidate would fare better
        except (IntegrityError, CodecError, CheckpointNotFoundError, OSError) as e:
            if counted is not None:
                counted.take_back()
            # OSError includes StorageError: a tier failing mid-read is one more reason to
            # try the next candidate, not to give up on the restore.
            reason = str(e) if isinstance(e, CkptflowError) else f"{type(e).__name__}: {e}"
            log.warning("restore of %s skips %s: %s", run_id, uri, reason)
            skipped.append(Skipped(uri, s, tier.name, reason))
            continue
        return RestoreResult(
            uri=uri,
            tier=tier.name,
            run_id=run_id,
            step=s,
            dst_dir=got.dst_dir,
            fetch=got,
            skipped=skipped,
            seconds=time.perf_counter() - t0,
        )

    what = f"step {step}" if step is not None else "any step"
    tried = "; ".join(f"{k.uri}: {k.reason}" for k in skipped) or "no committed checkpoints"
    raise CheckpointNotFoundError(
        f"no checkpoint of run {run_id} ({what}) verifies on tiers {', '.join(t.name for t in tiers)} — tried: {tried}"
    )


class _lease:
    """A lease if the tier lets us write one; a read-only tier (a drill with read-only
    credentials) is still read, since every byte is verified anyway."""

    def __init__(self, tier: Tier, run_id: str, step: int, holder: str | None, ttl_s: float) -> None:
        self._cm = acquire_lease(tier, run_id, step, holder or "restore", ttl_s)
        self._held = False

    def __enter__(self) -> None:
        try:
            self._cm.__enter__()
            self._held = True
        except OSError as e:
            log.warning("could not take a lease (%s); reading without one", type(e).__name__)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._held:
            self._cm.__exit__(exc_type, exc, tb)


class _Counted:
    """Forwards byte counts and remembers their sum, to take them back if the candidate fails."""

    def __init__(self, progress: Callable[[int], None]) -> None:
        self._progress = progress
        self._lock = threading.Lock()
        self._sum = 0

    def __call__(self, n: int) -> None:
        with self._lock:
            self._sum += n
        self._progress(n)

    def take_back(self) -> None:
        with self._lock:
            n, self._sum = self._sum, 0
        if n:
            self._progress(-n)
