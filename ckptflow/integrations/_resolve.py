"""The newest checkpoint of a run that verifies, for a framework's resume: the manager's walk
(``trainer/resume.walk``) in one process, on the config's tiers."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import sys
from collections.abc import Iterator

from ckptflow.tasks.adopt import is_adopted, parse_check
from ckptflow.tasks.config import load_config
from ckptflow.tasks.recall import TierRecall
from ckptflow.tasks.storage import Tier, open_tiers
from ckptflow.trainer.errors import CheckpointNotFoundError, ConfigError, IntegrityError
from ckptflow.trainer.format import layout
from ckptflow.trainer.recall import Brought, steps_with_retries
from ckptflow.trainer.resume import (
    Candidate,
    bring_into_hot,
    find_resume_point,
    needs_tiers,
    settle,
    walk,
)

log = logging.getLogger(__name__)


def run_tiers(config: str | None, root: str | None) -> list[Tier]:
    """The config's tiers in restore order, hot at ``root`` when given."""
    cfg = load_config(config)
    tiers = open_tiers(cfg)
    if root is not None:
        tiers = [Tier(dataclasses.replace(cfg.hot, url=root)), *tiers[1:]]
    return tiers


def newest_verified(
    tiers: list[Tier],
    run_id: str,
    *,
    at_most: int | None = None,
    passed_over: set[int] | None = None,
    wait_s: float = 60.0,
) -> str | None:
    """The folder on the hot root of the newest step (``<= at_most``) that verifies, by the resume's one walk
    (``trainer/resume.walk``): the hot copy checked in place (every digest, then the pickle-free parse of an
    adopted one), else the step brought from warm or cold into the hot root, committed there under the manifest
    the tiers hold (a damaged hot copy set aside first), else the step before. What the walk passed over as
    damaged is set aside and ``latest`` repaired, as the manager's resume does. Processes that ask at once (a
    Trainer's ranks each call ``latest_verified``) take turns: the first brings the step, the others find it on
    hot. ``passed_over`` (when given) gains each newer step that had no good copy anywhere. None when the run
    has no committed step; CheckpointNotFoundError naming every copy tried when steps exist and none verifies;
    TierUnreachableError when hot has no good ``latest`` and a tier cannot be listed within ``wait_s``."""
    layout.check_run_id(run_id)
    run_path = os.path.join(tiers[0].url, run_id)
    recall = TierRecall(tiers[1:])

    def use(c: Candidate) -> None:
        if is_adopted(c.manifest):
            parsed = parse_check(c.path, c.manifest)
            if not parsed["ok"]:
                raise IntegrityError("; ".join(parsed["problems"]))

    def held() -> set[int]:  # asked only when there are tiers (`beyond`)
        return steps_with_retries(recall, run_id, wait_s=wait_s)

    def bring(step: int, bad: set[int]) -> tuple[Brought | None, str]:
        try:
            return bring_into_hot(run_path, recall, step, bad), ""
        except Exception as e:  # noqa: BLE001 - as the manager's rank 0: any failure passes this step over
            return None, f"{type(e).__name__}: {e}"

    with _one_at_a_time(run_path):
        w = walk(
            run_path,
            find=lambda after: find_resume_point(run_path, deep=True, after=after),
            use=use,
            beyond=lambda rep: bool(recall.tiers) and needs_tiers(run_path, rep, at_most=at_most),
            held=held,
            bring=bring,
            where=recall.describe(),
            after=None if at_most is None else at_most + 1,
        )
        settle(run_path, w, repair_latest=at_most is None)  # a step asked for by name leaves `latest` alone
    if passed_over is not None:
        passed_over |= w.passed_over
    if w.chosen is None:
        if w.skipped:
            raise CheckpointNotFoundError(
                f"run {run_id}: no checkpoint verifies — " + "; ".join(f"{p}: {why}" for p, why in w.skipped)
            )
        return None
    b = w.brought
    return _said(run_id, w.chosen.step, "hot" if b is None else f"the {b.tier} tier ({b.uri})", w.chosen.path)


@contextlib.contextmanager
def _one_at_a_time(dst: str) -> Iterator[None]:
    """An exclusive lock on ``.<name of dst>.lock`` beside it (``flock``: released by the kernel when the holder
    dies; the file stays, as removing it would let a newcomer lock another inode)."""
    parent, name = os.path.split(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    lock = os.path.join(parent, f".{name}.lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:  # a symlink planted there (ELOOP) is never followed
        raise ConfigError(
            f"{lock}: cannot open it as the lock of {dst} ({e.strerror}); remove it and start the job again"
        ) from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _said(run_id: str, step: int, where: str, folder: str) -> str:
    """One line on stderr, whatever the framework's logging: which step, from where, into which folder."""
    print(f"ckptflow: {run_id} resumes from step {step}, from {where}: {folder}", file=sys.stderr, flush=True)
    return folder
