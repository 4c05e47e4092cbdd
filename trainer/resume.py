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
from dataclasses import dataclass

from ckptflow.trainer.distenv import gather
from ckptflow.trainer.errors import CheckpointNotFoundError, MismatchError
from ckptflow.trainer.format import commit, layout
from ckptflow.trainer.format.manifest import Manifest
from ckptflow.trainer.verify import check_present, share_of_files, verify_checkpoint

__all__ = [
    "Candidate",
    "ResumeReport",
    "check_provenance",
    "find_resume_point",
    "no_checkpoint_error",
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


def verify_together(path: str, rank: int, world: int, group, *, deep: bool = True) -> tuple[Manifest | None, list[str]]:
    """All ranks check one checkpoint and agree on the problems. ``deep``: each rank hashes its share of the
    files. Not deep: the manifest authenticated and every file present with its size; the load then verifies
    the bytes as it reads them (``trainer/dcp/reader.py``), so each byte is read once."""
    whole = verify_checkpoint(path, only=[])  # manifest only: cheap, every rank reads it
    problems: list[str] = [str(p) for p in whole.problems]
    if whole.manifest is not None:
        if deep:
            mine = share_of_files(whole.manifest, rank, world)
            problems += [str(p) for p in verify_checkpoint(path, only=mine).problems]
        elif rank == 0:
            problems += [
                str(p)
                for n, e in sorted(whole.manifest.files.items())
                if (p := check_present(path, n, e.size)) is not None
            ]
    if world > 1:
        problems = sorted({p for ps in gather(problems, group) for p in ps})
    return (whole.manifest if not problems else None), problems


def find_resume_point(
    run_path: str, *, rank: int = 0, world: int = 1, group=None, deep: bool = True, after: int | None = None
) -> ResumeReport:
    """The newest committed checkpoint that checks out (``deep``: see :func:`verify_together`). ``after``: only
    steps older than that (the next candidate after a load that failed)."""
    latest = commit.read_latest(run_path)
    steps = commit.committed_steps(run_path)
    skipped: list[tuple[str, str]] = []
    if latest is not None and latest not in steps:
        skipped.append((os.path.join(run_path, layout.step_name(latest)), "named by 'latest' but missing"))
    for step in steps:
        if after is not None and step >= after:
            continue
        path = os.path.join(run_path, layout.step_name(step))
        if commit.is_quarantined(run_path, step):
            skipped.append((path, "quarantined by the lifecycle's verify stage"))
            continue
        manifest, problems = verify_together(path, rank, world, group, deep=deep)
        if manifest is None:
            skipped.append((path, "; ".join(problems)))
            continue
        return ResumeReport(Candidate(step, path, manifest), skipped, latest)
    return ResumeReport(None, skipped, latest)


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
