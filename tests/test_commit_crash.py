"""A SIGKILL at every phase of the commit protocol never leaves ``latest`` at an
incomplete checkpoint, and the next start resumes and finishes (real torchrun, 2 ranks)."""

from __future__ import annotations

import os

import pytest

from ckptflow.trainer import layout
from ckptflow.trainer.verify import verify_checkpoint
from tests.helpers import last_per_step, metrics, read_latest, run_torchrun, step_dir, tmp_dirs

pytestmark = pytest.mark.slow
ARGS = ["--model", "tiny", "--max-steps", "6", "--save-every", "2"]

# (phase, rank that dies, is step 4 committed after the crash?)
PHASES = [
    ("shards", 1, False),  # rank 1 wrote its shard, rank 0 maybe not: partial .tmp
    ("after_shards", 0, False),  # all shards + .metadata written, no manifest
    ("after_manifest", 0, False),  # manifest durable inside .tmp, not renamed
    ("after_rename", 0, True),  # committed dir, `latest` still names step 2
    ("after_latest", 0, True),  # committed and `latest` updated, no outbox line/event
]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    r = run_torchrun(["--ckpt-root", str(root), "--run-id", "r", *ARGS])
    assert r.returncode == 0, r.stderr[-3000:]
    return last_per_step(metrics(os.path.join(root, "r")))


@pytest.mark.parametrize("phase,rank,committed", PHASES, ids=[p[0] for p in PHASES])
def test_crash_during_commit(tmp_path, baseline, phase, rank, committed):
    run = os.path.join(tmp_path, "r")
    crash = run_torchrun(
        ["--ckpt-root", str(tmp_path), "--run-id", "r", *ARGS], env={"CKPTFLOW_FAULT": f"{phase}@4:rank{rank}"}
    )
    assert crash.returncode != 0, "the fault must kill the job"

    # Right after the crash: `latest` names a checkpoint that verifies.
    latest = read_latest(run)
    assert verify_checkpoint(os.path.join(run, latest)).ok
    assert latest == layout.step_name(4 if phase == "after_latest" else 2)
    assert os.path.isdir(step_dir(run, 4)) == committed
    if committed:
        assert verify_checkpoint(step_dir(run, 4)).ok

    # The next start cleans up, resumes from the newest committed checkpoint and finishes.
    again = run_torchrun(["--ckpt-root", str(tmp_path), "--run-id", "r", *ARGS])
    assert again.returncode == 0, again.stderr[-3000:]
    resumed_from = 4 if committed else 2
    assert f"resumed from {step_dir(run, resumed_from)}" in again.stderr
    assert tmp_dirs(run) == []
    assert read_latest(run) == layout.step_name(6)
    for s in (2, 4, 6):
        assert verify_checkpoint(step_dir(run, s)).ok
    for x in metrics(run):  # every step, before and after the crash, as uninterrupted
        assert (x["loss"], x["lr"]) == (baseline[x["step"]]["loss"], baseline[x["step"]]["lr"])
