"""The lifecycle as a table of stages over one checkpoint.

    verify -> compress -> promote (warm) -> export (warm) -> archive (cold) -> prune (every tier)

Each stage is defined once, in :data:`STAGES`: its name, the write-once record that
says it is done, the event the flow emits after it, the tier it needs, its retries and
its action (a plain function of a :class:`~ckptflow.tasks.checkpoint.CheckpointRef`).
:func:`run_stage` is the one path every caller takes — the lifecycle flow (as a Prefect
task), reconcile's age-based moves, the chaos worker, the CLI — so each gets the same
guarantees:

1. the stage's record exists -> return it, do nothing (an idempotent re-run);
2. the checkpoint is quarantined -> return that, do nothing (a bad checkpoint goes no
   further, whoever asks);
3. act (each action takes its own lease on the tier it reads, and is itself idempotent
   underneath: a re-run after a crash copies or uploads nothing twice);
4. write the record — only now, after the work is durable.

``ls`` and the demo read stage names and letters from the table too.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptflow.tasks import records
from ckptflow.tasks.checkpoint import CheckpointRef
from ckptflow.trainer import events, faults

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Done:
    """What an action returns: the body of its record, and whether the checkpoint is good."""

    body: dict[str, Any]
    ok: bool = True
    """False only from verify: the checkpoint is bad and is quarantined instead."""


@dataclass(frozen=True, slots=True, eq=False)
class Stage:
    """One row of a stage table. Stages compare by identity: a node-local table's ``verify``
    shares every field with :data:`VERIFY` but its action, and taking one for the other sent a
    node-local checkpoint's verify to a hot root that never held it."""

    name: str
    """Imperative, as the Prefect task and the fault points are named: ``"verify"``."""
    record: str
    """Past tense, as the record file and ``ls`` name it: ``"verified"``."""
    letter: str
    """``ckptflow ls``'s one-letter column."""
    event: str | None
    """Emitted by the flow once the stage is done (whether it acted or found its record)."""
    tier: str | None
    """The tier the stage writes to; the stage is skipped when that tier is not configured."""
    act: Callable[[CheckpointRef], Done] = field(repr=False, compare=False)
    retry_delays_s: tuple[float, ...] = ()
    """Delays between retries of a failed attempt (I/O stages: transient S3 or NFS errors
    are the common case, and every action is safe to repeat)."""
    wanted: Callable[[CheckpointRef], bool] | None = field(default=None, repr=False, compare=False)
    """Whether the config asks for this stage for this checkpoint (None: always); a stage not
    wanted is skipped like one whose tier is not configured, and leaves no record."""


@dataclass(frozen=True, slots=True)
class StageRecord:
    """A stage's outcome: the record now in place, and whether this call wrote it."""

    stage: str
    record: str
    """The record written or found: the stage's, or ``"quarantined"``."""
    run_id: str
    step: int
    ok: bool
    skipped: bool
    """The record was already there: nothing was done (a re-run)."""
    body: dict[str, Any]

    @property
    def seconds(self) -> float:
        return float(self.body.get("seconds") or 0.0)

    @property
    def reasons(self) -> list[str]:
        return [str(r) for r in self.body.get("reasons", [])]

    def as_dict(self) -> dict[str, Any]:
        """The record with the call's own facts (the flow's result, the chaos worker's output)."""
        return dict(self.body, ok=self.ok, skipped=self.skipped)


def run_stage(stage: Stage, ref: CheckpointRef) -> StageRecord | None:
    """Run ``stage`` for ``ref`` under the rules of the module docstring; None when the tier
    the stage needs is not configured, or the config does not want it for this checkpoint."""
    if stage.tier is not None and not ref.has(stage.tier):
        return None
    if stage.wanted is not None and not stage.wanted(ref):
        return None
    for name in (stage.record, records.QUARANTINED):
        rec = records.read_record(ref.records_path, ref.step, name)
        if rec is not None:
            return StageRecord(stage.name, name, ref.run_id, ref.step, name != records.QUARANTINED, True, rec)
    done = stage.act(ref)
    records.log_execution(ref.records_path, ref.step, stage.name, done.ok)
    faults.maybe_crash(f"{stage.name}.before_record", ref.step)
    name = stage.record if done.ok else records.QUARANTINED
    body = records.write_record(ref.records_path, ref.step, name, done.body)
    return StageRecord(stage.name, name, ref.run_id, ref.step, done.ok, False, body)


def run_stage_forked(stage: Stage, ref: CheckpointRef) -> StageRecord | None:
    """``run_stage`` in a child of this machine's fork server when there is one (the imports a
    stage needs — torch for DCP's metadata, boto3, s3fs, zstandard — are done once per worker,
    not once per lifecycle), else here. Only the rows of :data:`STAGES` go there: their actions
    are plain functions of the reference (a node table's actions talk to Prefect)."""
    from ckptflow.tasks import forkserver

    if any(stage is s for s in STAGES):
        got = forkserver.call(
            "stage", {"stage": stage.name, "ref": ref.to_wire()}, timeout_s=24 * 3600, forward_output=True
        )
        if got is not None:  # None: no fork server here
            return None if got["record"] is None else StageRecord(**got["record"])
    return run_stage(stage, ref)


def run_stage_by_name(args: dict[str, Any]) -> dict[str, Any]:
    """The fork server's side of :func:`run_stage_forked`."""
    stage = next(s for s in STAGES if s.name == args["stage"])
    rec = run_stage(stage, CheckpointRef.from_wire(args["ref"]))
    return {"record": None if rec is None else dataclasses.asdict(rec)}


# ---- the actions --------------------------------------------------------------------------


def fault_hook(step: int) -> Callable[[str], None]:
    """Route a transfer's phase callbacks to ``CKPTFLOW_FAULT`` (chaos drills, tests).

    A phase such as ``archive:uploaded:__0_0.distcp`` becomes ``archive.uploaded``, so
    ``CKPTFLOW_FAULT=archive.uploaded@4`` kills the process after step 4's first upload.
    """

    def hook(phase: str) -> None:
        faults.maybe_crash(".".join(phase.split(":")[:2]), step)

    return hook


def _body(res: Any, **extra: Any) -> dict[str, Any]:
    d = dataclasses.asdict(res)
    if hasattr(res, "ratio"):
        d["ratio"] = res.ratio
    d.update(extra)
    return d


def _verify(ref: CheckpointRef) -> Done:
    from ckptflow.tasks.verify import verify

    lc = ref.cfg.lifecycle
    assert lc.expectations is not None  # LifecycleConfig.__post_init__ resolves None to sanity_step
    out = verify(
        ref,
        sanity_step=lc.sanity_step,
        expectations=lc.expectations,
        max_norm_change=lc.max_norm_change,
    )
    return Done(out.to_dict(), ok=out.ok)


def _compress(ref: CheckpointRef) -> Done:
    from ckptflow.tasks.transfer import compress

    warm = ref.tier("warm")
    res = compress(
        ref.tier("hot"), warm, ref.run_id, ref.step, threads=warm.config.codec_threads, fault=fault_hook(ref.step)
    )
    return Done(_body(res, tier="warm"))


def _promote(ref: CheckpointRef) -> Done:
    from ckptflow.tasks.storage import acquire_lease
    from ckptflow.tasks.transfer import promote

    hot, warm = ref.tier("hot"), ref.tier("warm")
    with acquire_lease(hot, ref.run_id, ref.step, holder="promote", ttl_s=3600):
        res = promote(hot, warm, ref.run_id, ref.step, threads=warm.config.codec_threads, fault=fault_hook(ref.step))
    return Done(_body(res, tier="warm"))


def _archive(ref: CheckpointRef) -> Done:
    from ckptflow.tasks.storage import acquire_lease
    from ckptflow.tasks.transfer import archive

    # From warm when it has the checkpoint (its stored form is reused as-is when the
    # codecs match, and the hot NVMe is left to training), else straight from hot.
    src = (
        ref.tier("warm") if ref.has("warm") and ref.tier("warm").is_committed(ref.run_id, ref.step) else ref.tier("hot")
    )
    with acquire_lease(src, ref.run_id, ref.step, holder="archive", ttl_s=6 * 3600):
        res = archive(src, ref.tier("cold"), ref.run_id, ref.step, fault=fault_hook(ref.step))
    return Done(_body(res, tier="cold", source=src.name))


def _export(ref: CheckpointRef) -> Done:
    from ckptflow.tasks.export import export_stage

    return Done(export_stage(ref))


def _export_wanted(ref: CheckpointRef) -> bool:
    from ckptflow.tasks.export import selected

    return selected(ref.cfg, ref.step) is None


def _prune(ref: CheckpointRef) -> Done:
    from ckptflow.tasks.prune import prune_run

    t0 = time.perf_counter()
    tiers = {}
    for name, rep in prune_run(ref.cfg, ref.run_id).items():
        tiers[name] = {
            "kept": {str(k): v for k, v in rep.kept.items()},
            "deleted": rep.deleted,
            "planned": rep.planned,
            "errors": {str(k): v for k, v in rep.errors.items()},
        }
    return Done({"tiers": tiers, "dry_run": False, "seconds": time.perf_counter() - t0})


_IO = (1.0, 5.0, 15.0)

VERIFY = Stage("verify", "verified", "V", events.VERIFIED, None, _verify, (5.0,))
COMPRESS = Stage("compress", "compressed", "C", None, "warm", _compress, _IO)
PROMOTE = Stage("promote", "promoted", "P", events.PROMOTED, "warm", _promote, _IO)
EXPORT = Stage("export", "exported", "E", events.EXPORTED, "warm", _export, _IO, _export_wanted)
ARCHIVE = Stage("archive", "archived", "A", events.ARCHIVED, "cold", _archive, _IO)
PRUNE = Stage("prune", "pruned", "R", events.PRUNED, None, _prune, (5.0,))

STAGES: tuple[Stage, ...] = (VERIFY, COMPRESS, PROMOTE, EXPORT, ARCHIVE, PRUNE)
"""In lifecycle order. A lifecycle is finished when the last stage's record exists (or the
checkpoint is quarantined)."""

BY_NAME = {s.name: s for s in STAGES}
RECORDS = tuple(s.record for s in STAGES)
"""Every stage's record name, in order (``ls``, the demo, reconcile)."""


def stage_for_tier(tier: str) -> Stage:
    """The stage that brings a checkpoint onto ``tier`` (reconcile's age-based moves)."""
    for s in (PROMOTE, ARCHIVE):
        if s.tier == tier:
            return s
    raise KeyError(f"no stage copies checkpoints onto tier {tier!r}")


def stage_records(run_path: str, step: int) -> dict[str, dict[str, Any]]:
    """The records present for a step (record name -> record): stages in order, then quarantine."""
    return records.status(run_path, step, (*RECORDS, records.QUARANTINED))


def finished(run_path: str, step: int) -> bool:
    """The lifecycle of this step is over: the last stage's record exists, or it is quarantined."""
    st = stage_records(run_path, step)
    return STAGES[-1].record in st or records.QUARANTINED in st
