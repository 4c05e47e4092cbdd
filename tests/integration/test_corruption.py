"""Damaged checkpoints are detected before anything is loaded, named, and skipped.

Detection runs in-process on copies of a real committed run (``find_resume_point`` is
exactly what resume calls); one real 2-rank job then proves the fallback end to end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from ckptflow.trainer.format import layout
from ckptflow.trainer.resume import find_resume_point
from ckptflow.trainer.verify import verify_checkpoint
from tests.helpers import PY, REPO, flip_byte, metrics, run_torchrun, step_dir, torchrun_env


@pytest.fixture
def run(tiny_run, tmp_path):
    dst = os.path.join(tmp_path, "tiny")
    shutil.copytree(tiny_run, dst)
    return dst


def _shard(run, step):
    d = step_dir(run, step)
    return os.path.join(d, sorted(n for n in os.listdir(d) if n.endswith(".distcp"))[0])


def _flip(run):
    flip_byte(_shard(run, 6))
    return _shard(run, 6), "checksum"


def _truncate(run):
    p = _shard(run, 6)
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) - 100)
    return p, "size"


def _missing(run):
    p = _shard(run, 6)
    os.unlink(p)
    return p, "missing"


def _metadata(run):
    p = os.path.join(step_dir(run, 6), layout.DCP_METADATA)
    flip_byte(p, 10)
    return p, "checksum"


def _edit_manifest(run):
    p = os.path.join(step_dir(run, 6), layout.MANIFEST)
    d = json.loads(open(p).read())
    name = sorted(d["files"])[-1]
    d["files"][name]["size"] += 1
    open(p, "w").write(json.dumps(d))
    return os.path.join(step_dir(run, 6), name), "size"


def _garbage_manifest(run):
    p = os.path.join(step_dir(run, 6), layout.MANIFEST)
    open(p, "w").write("{not json")
    return p, "not valid JSON"


def _unsafe_name(run):
    p = os.path.join(step_dir(run, 6), layout.MANIFEST)
    d = json.loads(open(p).read())
    d["files"]["../../etc/passwd"] = {"size": 1, "checksum": "00"}
    open(p, "w").write(json.dumps(d))
    return p, "unsafe file name"


CASES = {
    "flipped_byte": _flip,
    "truncated_shard": _truncate,
    "missing_shard": _missing,
    "flipped_metadata": _metadata,
    "edited_manifest": _edit_manifest,
    "garbage_manifest": _garbage_manifest,
    "unsafe_name": _unsafe_name,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_damage_is_detected_named_and_skipped(run, case):
    path, what = CASES[case](run)
    res = verify_checkpoint(step_dir(run, 6))
    assert not res.ok
    assert any(path in p.path or path in p.what for p in res.problems), res.problems
    assert any(what in p.what for p in res.problems), res.problems
    rep = find_resume_point(run)
    assert rep.chosen.step == 4, "resume falls back to the previous checkpoint"
    assert rep.skipped[0][0] == step_dir(run, 6)


def test_latest_naming_a_missing_step(run):
    with open(os.path.join(run, layout.LATEST), "w") as f:
        f.write(layout.step_name(99) + "\n")
    rep = find_resume_point(run)
    assert rep.chosen.step == 6
    assert rep.skipped == [(step_dir(run, 99), "named by 'latest' but missing")]


def test_quarantined_checkpoint_is_skipped(run):
    os.makedirs(os.path.dirname(layout.quarantine_record(run, 6)))
    with open(layout.quarantine_record(run, 6), "w") as f:
        f.write("{}")
    assert find_resume_point(run).chosen.step == 4


def test_no_valid_checkpoint_is_a_clear_error(run):
    for s in (2, 4, 6):
        flip_byte(_shard(run, s))
    r = subprocess.run(
        [
            PY,
            "-m",
            "ckptflow.trainer.train",
            "--parallel",
            "none",
            "--ckpt-root",
            os.path.dirname(run),
            "--run-id",
            "tiny",
            "--model",
            "tiny",
            "--max-steps",
            "8",
            "--save-every",
            "2",
        ],
        cwd=REPO,
        env=torchrun_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0
    assert "CheckpointNotFoundError" in r.stderr and "no committed checkpoint under" in r.stderr
    assert "ckptflow restore" in r.stderr  # says what to do


def test_two_rank_resume_falls_back_and_says_so(tmp_path):
    root = str(tmp_path)
    args = ["--ckpt-root", root, "--run-id", "r", "--model", "tiny", "--save-every", "2"]
    assert run_torchrun([*args, "--max-steps", "6"]).returncode == 0
    run = os.path.join(root, "r")
    flip_byte(_shard(run, 6))
    r = run_torchrun([*args, "--max-steps", "8"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resume: skipping {step_dir(run, 6)}" in r.stderr and "checksum" in r.stderr
    assert f"resumed from {step_dir(run, 4)}" in r.stderr
    assert [x["step"] for x in metrics(run)][-4:] == [5, 6, 7, 8]
