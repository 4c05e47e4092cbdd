"""The newest checkpoint of a run that verifies, for a framework's resume: the hot copy checked in
place, else the same step fetched from warm or cold, else the step before."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterator

from ckptflow.tasks.adopt import is_adopted, parse_check
from ckptflow.tasks.config import load_config
from ckptflow.tasks.storage import Tier, open_tiers
from ckptflow.tasks.transfer import restore
from ckptflow.trainer.errors import CheckpointNotFoundError, ConfigError
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.manifest import read_manifest
from ckptflow.trainer.verify import verify_checkpoint

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
    fetch_to: Callable[[int], str] | None = None,
    at_most: int | None = None,
    passed_over: set[int] | None = None,
) -> str | None:
    """The folder of the newest step (``<= at_most``) whose copy verifies: the hot copy in place
    (every digest, then the pickle-free parse of an adopted one), else the step restored from the
    other tiers. ``fetch_to(step)``: a folder of the caller's to restore into (one kept from an earlier
    call is checked and reused); without it the step is brought into the hot root itself, committed
    there under the manifest the tiers hold, after a damaged hot copy is set aside (damaged means no
    longer committed, so a later save of that step commits). ``passed_over`` (when given) gains each newer step
    that had no good copy anywhere. None when the run has no committed step;
    CheckpointNotFoundError naming every copy tried when steps exist and none verifies."""
    layout.check_run_id(run_id)
    hot, rest = tiers[0], tiers[1:]
    steps: set[int] = set()
    tried: list[str] = []
    for t in tiers:
        try:
            steps.update(s for s in t.committed_steps(run_id) if at_most is None or s <= at_most)
        except Exception as e:  # noqa: BLE001 - an unreachable tier must not stop the others
            tried.append(f"{t.name} ({t.url}): cannot list it: {type(e).__name__}: {e}")
    if not steps and not tried:
        return None
    for step in sorted(steps, reverse=True):
        problem = hot_problem(hot, run_id, step)
        if problem is None:
            return _said(run_id, step, "hot", hot.url_for(run_id, step))
        tried.append(f"hot step {step}: {problem}")
        log.warning("%s step %d on hot: %s; looking further", run_id, step, problem)
        if fetch_to is None:
            dst = _cleared_on_hot(hot, run_id, step, problem)
            if dst is None:
                if passed_over is not None:
                    passed_over.add(step)
                continue
        else:
            dst = fetch_to(step)
        # every process of a job asks (a Trainer's ranks each call latest_verified): one fetches, the others
        # wait for it and reuse its folder
        with _one_at_a_time(dst) if fetch_to is not None else contextlib.nullcontext():
            if fetch_to is not None:
                if os.path.isdir(dst) and local_problem(dst) is None:
                    return _said(run_id, step, "an earlier fetch", dst)
                shutil.rmtree(dst, ignore_errors=True)
            try:
                got = restore(rest, run_id, dst, step=step, holder="ckptflow resume")
                return _said(run_id, step, f"the {got.tier} tier ({got.uri})", got.dst_dir)
            except CheckpointNotFoundError as e:
                if fetch_to is not None:
                    shutil.rmtree(dst, ignore_errors=True)
                tried.append(str(e))
                if passed_over is not None:
                    passed_over.add(step)
    raise CheckpointNotFoundError(f"run {run_id}: no checkpoint verifies — {'; '.join(tried)}")


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


def _cleared_on_hot(hot: Tier, run_id: str, step: int, problem: str) -> str | None:
    """The hot step folder the tiers' copy of ``step`` may be brought into: a damaged committed copy set aside
    first; None when something else holds the name (a quarantined copy: the lifecycle's to judge)."""
    from ckptflow.trainer.format import commit

    run_path = os.path.join(hot.url, run_id)
    dst = os.path.join(run_path, layout.step_name(step))
    if os.path.lexists(dst) and not commit.is_quarantined(run_path, step):
        commit.set_aside(run_path, step, [problem, "replaced by the copy on the tiers"], found_by="resume")
    return None if os.path.lexists(dst) else dst


def _said(run_id: str, step: int, where: str, folder: str) -> str:
    """One line on stderr, whatever the framework's logging: which step, from where, into which folder."""
    print(f"ckptflow: {run_id} resumes from step {step}, from {where}: {folder}", file=sys.stderr, flush=True)
    return folder


def hot_problem(hot: Tier, run_id: str, step: int) -> str | None:
    """Why the hot copy of ``step`` cannot be resumed from, or None."""
    try:
        if not hot.is_committed(run_id, step):
            return "not on hot"
        if hot.is_quarantined(run_id, step):
            return "quarantined by the verify stage"
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return local_problem(hot.url_for(run_id, step))


def local_problem(folder: str) -> str | None:
    """Why the checkpoint in ``folder`` does not verify (digests; the parse of an adopted one), or None."""
    try:
        res = verify_checkpoint(folder)
        if not res.ok:
            return "; ".join(str(p) for p in res.problems)
        m = read_manifest(folder)
    except Exception as e:  # noqa: BLE001 - any failure to read it is a reason to try another copy
        return f"{type(e).__name__}: {e}"
    if is_adopted(m):
        parsed = parse_check(folder, m)
        if not parsed["ok"]:
            return "; ".join(parsed["problems"])
    return None
