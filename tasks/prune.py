"""Prune: apply a retention policy to one run on one tier — the only code that deletes.

Order: gather facts (committed steps, ``latest``, pins, leases, quarantine and verify
records, metrics if the policy ranks by one) -> ``retention.plan`` (pure) -> for each
step to delete, oldest first, check pins and leases *again* and delete it through the
tier (rename to ``.deleting`` then remove; on S3 the marker goes first). With
``dry_run`` the report says what would go and nothing is touched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from trainer import layout
from trainer.errors import CkptflowError

from tasks.retention import CheckpointInfo, Policy, plan
from tasks.storage.leases import leased_steps
from tasks.storage.tier import Tier

log = logging.getLogger(__name__)

VERIFIED_STAGE = "verified"  # the verify stage's record: <run>/_lifecycle/step_N/verified.json


@dataclass(slots=True)
class PruneReport:
    tier: str
    run_id: str
    dry_run: bool
    kept: dict[int, list[str]] = field(default_factory=dict)
    """Every kept step and why."""
    deleted: list[int] = field(default_factory=list)
    """Steps actually deleted (empty on a dry run)."""
    planned: list[int] = field(default_factory=list)
    """Steps the plan deletes (what a dry run would delete)."""
    errors: dict[int, str] = field(default_factory=dict)
    """Steps whose delete failed, and why; prune went on with the others."""
    seconds: float = 0.0

    def lines(self) -> list[str]:
        """A human-readable table for logs and artifacts."""
        verb = "would delete" if self.dry_run else "deleted"
        out = [f"prune {self.run_id} on {self.tier}{' (dry run)' if self.dry_run else ''}"]
        out += [f"  keep   {layout.step_name(s)}: {'; '.join(w)}" for s, w in sorted(self.kept.items())]
        gone = self.planned if self.dry_run else self.deleted
        out += [f"  {verb} {layout.step_name(s)}" for s in gone]
        out += [f"  ERROR  {layout.step_name(s)}: {e}" for s, e in sorted(self.errors.items())]
        return out


def checkpoint_infos(tier: Tier, run_id: str, *, needs_metrics: bool = False,
                     verified_steps: Iterable[int] | None = None) -> list[CheckpointInfo]:
    """The facts retention needs about every committed checkpoint of a run on a tier.

    ``verified_steps`` overrides the default, which is: the verify stage left its record
    on this tier, or the checkpoint has a tier index (promote and archive verify every
    byte before they commit, so a warm or cold checkpoint is verified by construction).
    """
    steps = tier.committed_steps(run_id)
    pinned = tier.pinned_steps(run_id)
    leased = leased_steps(tier, run_id)
    latest = tier.latest_step(run_id)
    given = set(verified_steps) if verified_steps is not None else None
    out = []
    for s in steps:
        if given is not None:
            verified = s in given
        else:
            verified = (tier.has_stage_record(run_id, s, VERIFIED_STAGE)
                        or tier.exists(tier.url_for(run_id, s, layout.TIER_MANIFEST)))
        metrics: dict[str, float] = {}
        if needs_metrics:
            try:
                metrics = {k: v for k, v in tier.read_manifest(run_id, s).training.items()
                           if isinstance(v, (int, float))}
            except (CkptflowError, OSError) as e:  # unranked, not fatal: other rules still apply
                log.warning("no metrics for %s (%s)", tier.url_for(run_id, s), e)
        out.append(CheckpointInfo(step=s, metrics=metrics, pinned=s in pinned, verified=verified,
                                  quarantined=tier.is_quarantined(run_id, s), latest=s == latest,
                                  leased=s in leased))
    return out


def prune(tier: Tier, run_id: str, policy: Policy, *, protected_steps: Iterable[int] = (),
          verified_steps: Iterable[int] | None = None, dry_run: bool = False) -> PruneReport:
    """Delete the checkpoints of ``run_id`` on ``tier`` that ``policy`` and the protections
    do not keep. ``protected_steps``: steps the caller needs kept (e.g. what another tier's
    ``latest`` names, a checkpoint not yet archived)."""
    t0 = time.perf_counter()
    layout.check_run_id(run_id)
    infos = checkpoint_infos(tier, run_id, needs_metrics=policy.needs_metrics,
                             verified_steps=verified_steps)
    p = plan(policy, infos, protected_steps=protected_steps)
    report = PruneReport(tier=tier.name, run_id=run_id, dry_run=dry_run, kept=p.keep, planned=p.delete)
    for step in p.delete:
        if dry_run:
            continue
        try:
            # A restore may have taken a lease, or someone pinned, since the plan was made.
            if step in leased_steps(tier, run_id):
                report.kept[step] = ["leased by a reader (since planning)"]
                continue
            if step in tier.pinned_steps(run_id):
                report.kept[step] = ["pinned (since planning)"]
                continue
            tier.delete_checkpoint(run_id, step)
            report.deleted.append(step)
        except (OSError, CkptflowError) as e:
            # Log and go on: one stuck delete (a busy NFS handle, a throttled bucket) must
            # not stop retention for every other checkpoint, or the tier fills up and
            # training stalls on a full disk. The step is retried at the next prune.
            log.warning("prune could not delete %s: %s", tier.url_for(run_id, step), e)
            report.errors[step] = f"{type(e).__name__}: {e}"
    report.kept = dict(sorted(report.kept.items()))
    report.seconds = time.perf_counter() - t0
    for line in report.lines():
        log.info(line)
    return report
