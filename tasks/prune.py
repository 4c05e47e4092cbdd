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
from typing import TYPE_CHECKING

from ckptflow.tasks.retention import CheckpointInfo, Policy, plan
from ckptflow.tasks.stages import ARCHIVE, PROMOTE, VERIFY
from ckptflow.tasks.storage.leases import leased_steps
from ckptflow.tasks.storage.tier import Tier
from ckptflow.trainer import faults
from ckptflow.trainer.errors import CkptflowError
from ckptflow.trainer.format import layout

if TYPE_CHECKING:
    from ckptflow.tasks.config import CkptflowConfig

log = logging.getLogger(__name__)


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


def checkpoint_infos(
    tier: Tier, run_id: str, *, needs_metrics: bool = False, verified_steps: Iterable[int] | None = None
) -> list[CheckpointInfo]:
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
            verified = tier.has_stage_record(run_id, s, VERIFY.record) or tier.exists(
                tier.url_for(run_id, s, layout.TIER_MANIFEST)
            )
        metrics: dict[str, float] = {}
        if needs_metrics:
            try:
                metrics = {
                    k: v for k, v in tier.read_manifest(run_id, s).training.items() if isinstance(v, (int, float))
                }
            except (CkptflowError, OSError) as e:  # unranked, not fatal: other rules still apply
                log.warning("no metrics for %s (%s)", tier.url_for(run_id, s), e)
        out.append(
            CheckpointInfo(
                step=s,
                metrics=metrics,
                pinned=s in pinned,
                verified=verified,
                quarantined=tier.is_quarantined(run_id, s),
                latest=s == latest,
                leased=s in leased,
            )
        )
    return out


def prune(
    tier: Tier,
    run_id: str,
    policy: Policy,
    *,
    protected_steps: Iterable[int] = (),
    verified_steps: Iterable[int] | None = None,
    dry_run: bool = False,
) -> PruneReport:
    """Delete the checkpoints of ``run_id`` on ``tier`` that ``policy`` and the protections
    do not keep. ``protected_steps``: steps the caller needs kept (e.g. what another tier's
    ``latest`` names, a checkpoint not yet archived)."""
    t0 = time.perf_counter()
    layout.check_run_id(run_id)
    infos = checkpoint_infos(tier, run_id, needs_metrics=policy.needs_metrics, verified_steps=verified_steps)
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
            faults.maybe_crash(f"prune.{tier.name}.before_delete", step)
            tier.delete_checkpoint(run_id, step)
            faults.maybe_crash(f"prune.{tier.name}.deleted", step)
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


# ---- the lifecycle's protections, shared by the prune stage and ``ckptflow prune`` -------


def unsafe_on_hot(cfg: CkptflowConfig, run_path: str, steps: Iterable[int]) -> set[int]:
    """Hot checkpoints that exist nowhere else yet: prune must not take the only copy.

    A checkpoint is safe to drop from hot once the furthest configured tier has it
    (archived when there is a cold tier, else promoted when there is a warm tier), or
    once it is quarantined (a bad checkpoint is not worth keeping by this rule).
    ``run_path``: the run on the hot tier, where the lifecycle's stage records are.
    """
    from ckptflow.tasks import records

    need = ARCHIVE.record if cfg.cold is not None else (PROMOTE.record if cfg.warm is not None else None)
    if need is None:
        return set()
    return {
        s
        for s in steps
        if records.read_record(run_path, s, need) is None
        and records.read_record(run_path, s, records.QUARANTINED) is None
    }


def prune_run(
    cfg: CkptflowConfig,
    run_id: str,
    *,
    tiers: Iterable[str] | None = None,
    dry_run: bool = False,
    records_run_path: str | None = None,
) -> dict[str, PruneReport]:
    """Apply each tier's retention policy to one run, with the lifecycle's protections.

    On hot: the steps not yet on the furthest tier are protected (:func:`unsafe_on_hot`) and
    "verified" means the verify stage's record. On warm and cold a copy is verified by
    construction (it was checked before its commit). ``tiers``: names to prune (default:
    every configured tier). Returns ``{tier name: report}`` in restore order.
    """
    from ckptflow.tasks import records
    from ckptflow.tasks.retention import build_policy

    run_path = records_run_path or layout.run_dir(cfg.hot.url, run_id)
    verified = [
        s for s in records.steps_with_records(run_path) if records.read_record(run_path, s, VERIFY.record) is not None
    ]
    wanted = set(tiers) if tiers is not None else None
    out: dict[str, PruneReport] = {}
    for tcfg in cfg.tiers():
        if wanted is not None and tcfg.name not in wanted:
            continue
        tier = Tier(tcfg)
        protected: set[int] = set()
        if tcfg.name == "hot":
            protected = unsafe_on_hot(cfg, run_path, tier.committed_steps(run_id))
        # The newest checkpoint that passed verification stays on every tier that has it.
        out[tcfg.name] = prune(
            tier,
            run_id,
            build_policy(tcfg.retention),
            protected_steps=protected,
            verified_steps=verified if tcfg.name == "hot" else None,
            dry_run=dry_run,
        )
    return out
