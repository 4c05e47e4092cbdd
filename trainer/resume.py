"""Choosing the checkpoint to resume from: the newest committed one that verifies, on the hot root or beyond it.

:func:`walk` is the one walk every resume takes (the manager's, the Lightning plugin's, the Hugging Face
``latest_verified``): newest step first across the hot root and the tiers (``trainer/recall.py``); for one step
the hot copy first, then the tiers' copy brought into the hot root (a damaged hot copy set aside), then the step
before. The tiers are listed only when hot has no good ``latest``: a commit never moves ``latest`` back, so a good
one is the run's newest and the common resume makes no call to warm or cold.

On the hot root (:func:`find_resume_point`), candidates: every committed ``step_*`` dir, newest first.
``latest`` is compared but not trusted alone (a crash between rename and pointer update leaves a newer committed
dir; a stale or edited ``latest`` may name a missing step). Quarantined checkpoints are skipped. Each candidate is
verified against its manifest *before* DCP reads anything (``.metadata`` is a pickle), all ranks agreeing over the
checkpoint group; a damaged one is reported and the next older one tried.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from ckptflow.trainer.distenv import gather
from ckptflow.trainer.errors import CheckpointNotFoundError, ConfigError, IntegrityError, LoadError, MismatchError
from ckptflow.trainer.format import commit, layout
from ckptflow.trainer.format.manifest import Manifest
from ckptflow.trainer.recall import Brought, Recall
from ckptflow.trainer.verify import Problem, files_present, share_of_files, verify_checkpoint

__all__ = [
    "Candidate",
    "ResumeReport",
    "Walked",
    "bring_into_hot",
    "check_provenance",
    "find_resume_point",
    "needs_tiers",
    "no_checkpoint_error",
    "only_set_aside_error",
    "set_aside_or_warn",
    "settle",
    "verify_together",
    "walk",
]


log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Candidate:
    step: int
    path: str
    manifest: Manifest


@dataclass(slots=True)
class ResumeReport:
    chosen: Candidate | None
    skipped: list[tuple[str, str]]
    """(path, why) for each newer checkpoint passed over."""
    latest_was: int | None
    damaged: list[tuple[int, str]] = field(default_factory=list)
    """(step, why) for each committed checkpoint passed over as damaged or quarantined (not for a manifest
    this process cannot trust: another key, a newer format): what a resume that goes on sets aside."""


def verify_together(
    path: str, rank: int, world: int, group, *, deep: bool = True
) -> tuple[Manifest | None, list[str], bool]:
    """All ranks check one checkpoint and agree on the problems, and on whether they are damage (False when
    any is only distrust: no or another signing key, a newer format). ``deep``: each rank hashes its share of
    the files. Not deep: the manifest authenticated and every file present with its size; the load then
    verifies the bytes as it reads them (``trainer/dcp/reader.py``), so each byte is read once."""
    whole = verify_checkpoint(path, only=[])  # manifest only: cheap, every rank reads it
    found: list[Problem] = list(whole.problems)
    if whole.manifest is not None:
        if deep:
            mine = share_of_files(whole.manifest, rank, world)
            found += verify_checkpoint(path, only=mine).problems
        elif rank == 0:
            found += files_present(path, whole.manifest)
    pairs = [(str(p), p.damage) for p in found]
    if world > 1:
        pairs = sorted({p for ps in gather(pairs, group) for p in ps})
    problems = sorted({p for p, _ in pairs})
    return (whole.manifest if not pairs else None), problems, all(d for _, d in pairs)


def find_resume_point(
    run_path: str, *, rank: int = 0, world: int = 1, group=None, deep: bool = True, after: int | None = None
) -> ResumeReport:
    """The newest committed checkpoint that checks out (``deep``: see :func:`verify_together`). ``after``: only
    steps older than that (the next candidate after a load that failed)."""
    latest = commit.read_latest(run_path)
    steps = commit.committed_steps(run_path)
    skipped: list[tuple[str, str]] = []
    damaged: list[tuple[int, str]] = []
    if latest is not None and latest not in steps:
        skipped.append((os.path.join(run_path, layout.step_name(latest)), "named by 'latest' but missing"))
    for step in steps:
        if after is not None and step >= after:
            continue
        path = os.path.join(run_path, layout.step_name(step))
        if commit.is_quarantined(run_path, step):
            skipped.append((path, "quarantined by the lifecycle's verify stage"))
            damaged.append((step, "quarantined by the lifecycle's verify stage"))
            continue
        manifest, problems, is_damage = verify_together(path, rank, world, group, deep=deep)
        if manifest is None:
            skipped.append((path, "; ".join(problems)))
            if is_damage:
                damaged.append((step, "; ".join(problems)))
            continue
        return ResumeReport(Candidate(step, path, manifest), skipped, latest, damaged)
    return ResumeReport(None, skipped, latest, damaged)


@dataclass(slots=True)
class Walked:
    """Where :func:`walk` ended."""

    chosen: Candidate | None
    """The checkpoint to resume from (on the hot root), or None."""
    latest_was: int | None
    skipped: list[tuple[str, str]]
    """(where, why) for each copy passed over, hot or beyond."""
    damaged: list[tuple[int, str]]
    """Hot steps passed over as damaged or quarantined: what a resume that goes on sets aside."""
    brought: Brought | None
    """The chosen step, when it was brought back from the tiers."""
    passed_over: set[int]
    """Steps newer than the chosen one that had no good copy anywhere."""


def walk(
    run_path: str,
    *,
    find: Callable[[int | None], ResumeReport],
    use: Callable[[Candidate], object],
    beyond: Callable[[ResumeReport], bool],
    held: Callable[[], set[int]],
    bring: Callable[[int, set[int]], tuple[Brought | None, str]],
    where: str = "the tiers",
    after: int | None = None,
) -> Walked:
    """The newest checkpoint of the run that is good, on hot or brought there from the tiers (module doc).

    ``find(after)``: hot's newest committed step older than ``after`` that passes the cheap checks;
    ``use(candidate)``: load it (or check it) and raise IntegrityError when it fails (a LoadError is not damage);
    ``beyond(report)``: whether the tiers must be listed now; ``held()``: the steps they hold;
    ``bring(step, damaged_on_hot)``: that step brought into the hot root, or (None, why not). Every answer must
    be the same on every rank (the manager's callables agree over the checkpoint group), so all ranks walk the
    same path. ``after``: only steps older than that."""
    first_after = after
    skipped: list[tuple[str, str]] = []
    damaged: list[tuple[int, str]] = []
    tiers: set[int] = set()
    listed = False
    tried: set[int] = set()  # steps brought back (or tried): never fetched twice
    brought: Brought | None = None
    while True:
        rep = find(after)
        skipped += [x for x in rep.skipped if x not in skipped]
        damaged += [x for x in rep.damaged if x not in damaged]
        if not listed and beyond(rep):  # hot's newest is gone or damaged: the tiers may hold it
            tiers, listed = held(), True
        on_hot = rep.chosen.step if rep.chosen is not None else -1
        bad = {s for s, _ in damaged}  # a tier's copy of a step whose hot copy failed is a candidate
        newer = [
            s
            for s in tiers
            if s > on_hot and s not in tried and (after is None or s < after or (s == after and s in bad))
        ]
        if newer:  # a tier holds a newer step than any good one here: bring it back, then look again
            step = max(newer)
            tried.add(step)
            got, why = bring(step, bad)
            if got is None:
                skipped.append((f"{where} step {step}", why))
            else:
                brought = got
                if after is not None and step >= after:  # the tiers' copy of the step whose hot load failed
                    after = step + 1
            continue
        if rep.chosen is None:
            break
        try:
            use(rep.chosen)
            break
        except IntegrityError as e:  # every rank failed it (the manager's load agrees): the next older one
            skipped.append((rep.chosen.path, str(e)))
            if not isinstance(e, LoadError):  # bytes that differ from the manifest: damage
                damaged.append((rep.chosen.step, str(e)))
            after = rep.chosen.step
    chosen = rep.chosen
    floor = chosen.step if chosen is not None else -1
    seen = tried | {s for s, _ in damaged} | tiers
    seen |= {s for s in (layout.parse_step(os.path.basename(p)) for p, _ in skipped) if s is not None}
    passed_over = {s for s in seen if s > floor and (first_after is None or s < first_after)}
    mine = brought if brought is not None and chosen is not None and brought.step == chosen.step else None
    return Walked(chosen, rep.latest_was, skipped, damaged, mine, passed_over)


def settle(run_path: str, w: Walked, *, found_by: str = "resume", repair_latest: bool = True) -> None:
    """After a walk that goes on from ``w.chosen`` (one process: rank 0, or the framework's): the newer steps it
    passed over as damaged are set aside, so the saves that replay those steps commit (damaged means no longer
    committed), and ``latest`` names the chosen step. Best effort: the other ranks have gone on to train, and a
    failure here (a folder this user may not write) must not end one process alone; a step left in place is set
    aside when it is saved again (``commit.rename_then_latest``) or at the next resume."""
    if w.chosen is None:
        return
    for step, why in w.damaged:
        if step > w.chosen.step and os.path.isdir(os.path.join(run_path, layout.step_name(step))):
            set_aside_or_warn(run_path, step, why, found_by)
    if repair_latest and w.latest_was != w.chosen.step:
        log.warning("resume: 'latest' named %s; repaired to step %d", w.latest_was, w.chosen.step)
        try:
            commit.write_latest(run_path, w.chosen.step)
        except OSError as e:  # the next commit writes it; a resume reads committed steps, not `latest` alone
            log.warning("resume: could not repair 'latest' (%s)", e)


def set_aside_or_warn(run_path: str, step: int, why: str, found_by: str) -> None:
    """``commit.set_aside``, a failure logged (see :func:`settle`)."""
    try:
        commit.set_aside(run_path, step, [why], found_by=found_by)
    except OSError as e:
        log.warning("resume: could not set %s aside (%s); it stays where it is, not resumed from", step, e)


def needs_tiers(run_path: str, rep: ResumeReport, *, at_most: int | None = None) -> bool:
    """Whether a resume must list the tiers beyond hot: hot has no good checkpoint, or the one it has is not the
    run's ``latest`` (something newer was passed over or is missing), or an earlier resume set a newer step aside
    and went on from an older one (warm may hold it). A commit never moves ``latest`` back, so a good ``latest``
    on hot is the run's newest. ``at_most``: a step asked for by name; hot holding it good is enough."""
    if at_most is not None:
        return rep.chosen is None or rep.chosen.step < at_most
    return (
        rep.chosen is None
        or bool(rep.skipped)
        or rep.latest_was != rep.chosen.step
        or any((layout.parse_set_aside(n) or -1) > rep.chosen.step for n in commit.set_aside_steps(run_path))
    )


def bring_into_hot(run_path: str, recall: Recall, step: int, damaged_here: set[int]) -> Brought:
    """The tiers' copy of ``step`` fetched into the hot root, every byte checked, committed there under the
    manifest the tiers hold (so the lifecycle sees the checkpoint it already carried). A damaged hot copy is set
    aside first (damaged means no longer committed, so a later save of that step commits)."""
    step_dir = os.path.join(run_path, layout.step_name(step))
    if os.path.lexists(step_dir):
        # A symlink under the step's name was never committed (the commit sets one aside too); anything else not
        # found damaged (another key's checkpoint, a newer format) is not this resume's to replace
        if step not in damaged_here and not os.path.islink(step_dir):
            raise ConfigError(f"{step_dir} is there and is not damaged; not replacing it with the tiers' copy")
        commit.set_aside(run_path, step, ["replaced by the copy on the tiers"], found_by="resume")
    return recall.bring(os.path.basename(run_path), step, step_dir)


def check_provenance(
    manifest: Manifest, path: str, *, config_hash: str, data_fingerprint: str, allow_mismatch: bool
) -> list[str]:
    """Refuse to resume a different experiment silently. Returns warnings if overridden."""
    saved = manifest.provenance
    diffs = []
    if saved.get("config_hash") != config_hash:
        diffs.append(f"config hash {saved.get('config_hash')!r} in the checkpoint vs {config_hash!r} now")
    if saved.get("data_fingerprint") != data_fingerprint:
        diffs.append(
            f"data fingerprint {saved.get('data_fingerprint')!r} in the checkpoint vs {data_fingerprint!r} now"
        )
    if diffs and not allow_mismatch:
        raise MismatchError(
            f"refusing to resume from {path}: " + "; ".join(diffs) + ". This job's config or data "
            "differs from the one that saved it. Use the original config, a new run id, or pass "
            "--allow-mismatch (CheckpointConfig.allow_mismatch=True) to resume anyway"
        )
    return diffs


def no_checkpoint_error(run_path: str, skipped: list[tuple[str, str]]) -> CheckpointNotFoundError:
    detail = "; ".join(f"{p}: {w}" for p, w in skipped)
    return CheckpointNotFoundError(
        f"no committed checkpoint under {run_path} verifies ({detail}). Restore one from the warm "
        "or cold tier ('ckptflow restore RUN --to DIR'), or start fresh with a new run id"
    )


def only_set_aside_error(run_path: str, aside: list[str]) -> CheckpointNotFoundError:
    """The run has no committed checkpoint, but some were set aside as damaged: starting at step 0 would
    silently throw its training away."""
    shown = ", ".join(aside[:4]) + (f" (+{len(aside) - 4} more)" if len(aside) > 4 else "")
    return CheckpointNotFoundError(
        f"{run_path} holds no committed checkpoint, only damaged ones set aside in "
        f"{os.path.join(run_path, layout.DAMAGED_DIR)} ({shown}); not starting over at step 0. Restore a "
        "checkpoint from the warm or cold tier ('ckptflow restore RUN --step N --to "
        f"{run_path}/step_<N as 9 digits>'), or, to start over on purpose, remove "
        f"{os.path.join(run_path, layout.DAMAGED_DIR)} or use a new run id"
    )
