"""Choosing the checkpoint to resume from: the newest committed one that verifies.

Candidates: every committed ``step_*`` dir, newest first. ``latest`` is compared but not trusted alone (a
crash between rename and pointer update leaves a newer committed dir; a stale or edited ``latest`` may name a
missing step). Quarantined checkpoints are skipped. Each candidate is verified against its manifest *before*
DCP reads anything (``.metadata`` is a pickle), all ranks agreeing over the checkpoint group; a damaged one is
reported and the next older one tried.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from ckptflow.trainer.distenv import gather
from ckptflow.trainer.errors import CheckpointNotFoundError, MismatchError
from ckptflow.trainer.format import commit, layout
from ckptflow.trainer.format.manifest import Manifest
from ckptflow.trainer.verify import Problem, files_present, share_of_files, verify_checkpoint

__all__ = [
    "Candidate",
    "ResumeReport",
    "check_provenance",
    "find_resume_point",
    "no_checkpoint_error",
    "only_set_aside_error",
    "verify_together",
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
