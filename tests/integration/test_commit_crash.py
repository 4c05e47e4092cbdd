"""A crash at every phase of the commit protocol never leaves ``latest`` at an incomplete
checkpoint, and the next start resumes and finishes bitwise (real torchrun, 2 ranks).

One real SIGKILL (rank 1, its shard written, the other rank's maybe not), and every phase from
one run that copies the run as it is on disk when each phase is reached (``faults``'
``snapshot``): what a SIGKILL there would have left. For each, in this process, what a start-up
does with it (``latest`` verifies, the stale ``.tmp`` goes, the resume point is the newest
commit); a real job resumes from one phase that rolls back and one that rolls forward, bit for
bit (the start-up code path is the same for the phases of each kind).
"""

from __future__ import annotations

import os
import shutil

import pytest

from ckptflow.trainer import faults
from ckptflow.trainer.format import commit, layout
from ckptflow.trainer.resume import find_resume_point
from ckptflow.trainer.verify import verify_checkpoint
from tests.helpers import metrics, read_latest, run_torchrun, step_dir, tmp_dirs

ARGS = ["--model", "tiny", "--max-steps", "6", "--save-every", "2"]

# (phase, rank that reaches it, is step 4 committed after a crash there?)
PHASES = [
    ("shards", 1, False),  # rank 1 wrote its shard, rank 0 maybe not: partial .tmp
    ("after_shards", 0, False),  # all shards + .metadata written, no manifest
    ("after_manifest", 0, False),  # manifest durable inside .tmp, not renamed
    ("after_rename", 0, True),  # committed dir, `latest` still names step 2
    ("after_latest", 0, True),  # committed and `latest` updated, no outbox line/event
]


@pytest.fixture(scope="module")
def crashes(tmp_path_factory):
    """One run that leaves, for every phase of step 4's commit, the run as a crash there would."""
    tmp = tmp_path_factory.mktemp("crashes")
    spec = ",".join(f"{phase}@4:rank{rank}:snapshot" for phase, rank, _ in PHASES)
    env = {faults.ENV: spec, faults.SNAPSHOT_OF: str(tmp / "root" / "r"), faults.SNAPSHOT_TO: str(tmp / "at")}
    r = run_torchrun(["--ckpt-root", str(tmp / "root"), "--run-id", "r", *ARGS], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "at"


def _resumes_and_finishes(root, run: str, resumed_from: int, golden) -> None:
    """The next start cleans up, resumes from ``resumed_from`` and trains on as if uninterrupted."""
    again = run_torchrun(["--ckpt-root", str(root), "--run-id", "r", *ARGS])
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {step_dir(run, resumed_from)}" in again.stderr
    assert tmp_dirs(run) == []
    assert read_latest(run) == layout.step_name(6)
    for s in (2, 4, 6):
        assert verify_checkpoint(step_dir(run, s)).ok
    for x in metrics(run):  # every step, before and after the crash
        assert (x["loss"], x["lr"]) == golden[x["step"]], x


@pytest.mark.parametrize("phase,rank,committed", PHASES, ids=[p[0] for p in PHASES])
def test_a_crash_at_each_commit_phase_leaves_latest_whole_and_a_start_up_cleans_it(
    crashes, tmp_path, phase, rank, committed
):
    run = os.path.join(tmp_path, "r")
    shutil.copytree(crashes / phase / "0", run, symlinks=True)
    latest = read_latest(run)
    assert verify_checkpoint(os.path.join(run, latest)).ok
    assert latest == layout.step_name(4 if phase == "after_latest" else 2)
    assert os.path.isdir(step_dir(run, 4)) == committed
    if committed:
        assert verify_checkpoint(step_dir(run, 4)).ok
    # What every start-up does first (the manager, rank 0): a crashed save's .tmp goes, and the
    # resume point is the newest commit, checked byte for byte.
    assert bool(commit.clean_stale_tmp(run)) == (phase != "after_latest" and phase != "after_rename")
    assert tmp_dirs(run) == []
    chosen = find_resume_point(run, deep=True).chosen
    assert chosen is not None and chosen.step == (4 if committed else 2)


@pytest.mark.parametrize("phase", ["after_manifest", "after_rename"])
def test_a_start_after_a_crash_resumes_and_trains_on_bitwise(crashes, golden, tmp_path, phase):
    run = os.path.join(tmp_path, "r")
    shutil.copytree(crashes / phase / "0", run, symlinks=True)
    _resumes_and_finishes(tmp_path, run, 4 if phase == "after_rename" else 2, golden)


def test_a_real_sigkill_of_a_rank_mid_commit_leaves_latest_whole_and_resumes(tmp_path, golden):
    run = os.path.join(tmp_path, "r")
    crash = run_torchrun(["--ckpt-root", str(tmp_path), "--run-id", "r", *ARGS], env={faults.ENV: "shards@4:rank1"})
    assert crash.returncode != 0, "the fault must kill the job"
    assert read_latest(run) == layout.step_name(2) and verify_checkpoint(step_dir(run, 2)).ok
    assert not os.path.isdir(step_dir(run, 4))
    _resumes_and_finishes(tmp_path, run, 2, golden)
