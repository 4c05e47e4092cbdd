"""Exact resume under a real SIGKILL, and resume at other world sizes (real torchrun, gloo)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess

import pytest

from ckptflow.trainer.format import layout
from tests.helpers import PY, REPO, last_per_step, metrics, read_latest, run_torchrun, step_dir, tmp_dirs, torchrun_env

ARGS = ["--model", "tiny", "--max-steps", "10", "--save-every", "3"]


def test_killed_worker_resumes_bitwise_equal(golden, tmp_path):
    """Rank 1 is SIGKILLed after step 7; torchrun restarts both ranks, which resume from
    the newest committed checkpoint and replay. Every logged step — including the
    replayed ones — has the same loss and LR bits as the uninterrupted run (dropout on,
    so this also proves every RNG stream was restored)."""
    r = run_torchrun(
        ["--ckpt-root", str(tmp_path), "--run-id", "r", *ARGS], max_restarts=1, env={"CKPTFLOW_FAULT": "step@7:rank1"}
    )
    assert r.returncode == 0, r.stderr[-3000:]
    run = os.path.join(tmp_path, "r")
    rows = metrics(run)
    assert {x["attempt"] for x in rows} == {0, 1}, "the fault must actually have killed a worker"
    assert any("resumed from" in line for line in r.stderr.splitlines())
    assert sorted({x["step"] for x in rows}) == list(range(1, 11))
    for x in rows:  # every line, replays included
        assert (x["loss"], x["lr"]) == golden[x["step"]], f"step {x['step']} differs: {x} vs {golden[x['step']]}"
    replayed = [x["step"] for x in rows if x["attempt"] == 1]
    assert replayed[0] <= 7, "the restarted attempt replays from the last checkpoint"
    assert read_latest(run) == layout.step_name(10)
    assert tmp_dirs(run) == []


def _resume_copy(src_run: str, dst_root, step: int) -> str:
    """Copy a run keeping checkpoints up to ``step``; ``latest`` names ``step``."""
    dst = os.path.join(dst_root, "r")
    shutil.copytree(src_run, dst)
    for n in os.listdir(dst):
        s = layout.parse_step(n)
        if s is not None and s > step:
            shutil.rmtree(os.path.join(dst, n))
    with open(os.path.join(dst, layout.LATEST), "w") as f:
        f.write(layout.step_name(step) + "\n")
    return dst


@pytest.fixture(scope="module")
def baseline_nodrop(tmp_path_factory):
    """No dropout and a global batch of 6, so 1, 2 and 3 ranks see the same global batches."""
    root = tmp_path_factory.mktemp("nodrop")
    r = run_torchrun(
        [
            "--ckpt-root",
            str(root),
            "--run-id",
            "r",
            "--model",
            "tiny",
            "--dropout",
            "0",
            "--global-batch",
            "6",
            "--max-steps",
            "8",
            "--save-every",
            "4",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return os.path.join(root, "r")


@pytest.mark.parametrize("nproc", [1, 3])
def test_resume_at_another_world_size(baseline_nodrop, tmp_path, nproc):
    """A 2-rank checkpoint resumes on 1 and on 3 ranks (DCP resharding) and trains on.

    The restored state is exact: the sanity step's probe loss (a forward pass on the
    restored parameters) matches the recorded one bitwise. The losses of the steps
    after the resume match the 2-rank run to a relative 1e-5, not bitwise: with
    another world size each rank's share of the global batch and the gradient
    reduction order differ, so floating-point sums round differently.
    """
    run = _resume_copy(baseline_nodrop, tmp_path, 4)
    args = [
        "--ckpt-root",
        str(tmp_path),
        "--run-id",
        "r",
        "--model",
        "tiny",
        "--dropout",
        "0",
        "--global-batch",
        "6",
        "--max-steps",
        "8",
        "--save-every",
        "4",
    ]
    if nproc == 1:
        r = subprocess.run(
            [PY, "-m", "ckptflow.trainer.train", *args],
            cwd=REPO,
            env=torchrun_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    else:
        r = run_torchrun(args, nproc=nproc)
    assert r.returncode == 0, r.stderr[-3000:]
    base = last_per_step(metrics(baseline_nodrop))
    resumed = [x for x in metrics(run) if x["step"] > 4]
    assert [x["step"] for x in resumed][-4:] == [5, 6, 7, 8]
    for x in resumed[-4:]:
        b = base[x["step"]]
        assert x["lr"] == b["lr"]
        assert math.isclose(x["loss"], b["loss"], rel_tol=1e-5), (x, b)
    # The restored state itself is exact, at this world size too.
    if nproc == 1:
        s = subprocess.run(
            [PY, "-m", "ckptflow.tasks.sanity", step_dir(run, 4)],
            cwd=REPO,
            env=torchrun_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        out = json.loads(s.stdout)
    else:
        res = tmp_path / "sanity.json"
        s = run_torchrun([step_dir(run, 4), "--out", str(res)], nproc=nproc, module="ckptflow.tasks.sanity")
        out = json.loads(res.read_text())
    assert s.returncode == 0 and out["ok"], out
    assert out["probe_match"] == "bitwise" and out["lr_match"]
    assert out["world_size"] == nproc and out["saved_world_size"] == 2
