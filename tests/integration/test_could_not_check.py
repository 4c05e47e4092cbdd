"""A check that could not run is not a bad checkpoint: a sanity step that cannot reach its verdict (killed
for memory, no builder for the model on the worker; past its timeout: ``test_lifecycle``) leaves a checkpoint
whose bytes verified unproven, never quarantined, and it goes on to warm. The verify stage runs as the
lifecycle runs it (``run_stage``), in a process of its own where the test puts a memory limit around it."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from ckptflow.tasks import records
from ckptflow.trainer.format import layout
from tests.helpers import PY, REPO, step_dir

STAGE = """
import sys
from ckptflow.tasks.checkpoint import CheckpointRef
from ckptflow.tasks.config import load_config
from ckptflow.tasks.stages import VERIFY, PROMOTE, run_stage
ref = CheckpointRef(load_config(sys.argv[1]), "tiny", int(sys.argv[2]))
assert run_stage(VERIFY, ref).ok
assert run_stage(PROMOTE, ref).ok
"""

CGROUP_V1 = "/sys/fs/cgroup/memory"


def _builder(run: str, step: int, name: str) -> None:
    """The manifest names ``name`` as the model's builder (an unsigned manifest: nothing else changes)."""
    p = os.path.join(step_dir(run, step), layout.MANIFEST)
    with open(p) as f:
        text = f.read()
    with open(p, "w") as f:
        f.write(text.replace("ckptflow.trainer.reference.build:build", name))


@pytest.fixture
def hot(tiny_run, tmp_path):
    shutil.copytree(tiny_run, tmp_path / "hot" / "tiny")
    cfg = tmp_path / "ckptflow.toml"
    cfg.write_text(
        f'[hot]\nurl = "{tmp_path / "hot"}"\n[warm]\nurl = "{tmp_path / "warm"}"\n'
        "[lifecycle]\nexpectations = false\nsanity_timeout_s = 120\n"
    )
    return str(tmp_path / "hot" / "tiny"), str(cfg)


def _stage(cfg: str, step: int, env: dict, cgroup: str | None = None) -> subprocess.CompletedProcess:
    cmd = [PY, "-c", STAGE, cfg, str(step)]
    if cgroup is not None:  # the worker and everything it starts live under the limit
        cmd = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *cmd]
    return subprocess.run(cmd, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)


def _unproven(run: str, step: int) -> str:
    rec = records.read_record(run, step, "verified")
    assert rec is not None and records.read_record(run, step, records.QUARANTINED) is None
    assert rec["ok"] and rec["proven"] is False, rec
    return rec["not_proven"]


@pytest.mark.skipif(not os.access(CGROUP_V1, os.W_OK), reason="needs a writable cgroup v1 memory controller (root)")
def test_a_check_killed_for_memory_leaves_the_checkpoint_unproven_and_the_worker_alive(hot, tmp_path):
    run, cfg = hot
    _builder(run, 6, "tests.loops.hungry:build")  # 1.5 GB before the model: more than the worker has
    cgroup = os.path.join(CGROUP_V1, f"ckptflow-test-{os.getpid()}-{tmp_path.name}")
    os.mkdir(cgroup)
    try:
        with open(os.path.join(cgroup, "memory.limit_in_bytes"), "w") as f:
            f.write(str(1024 * 2**20))  # the worker fits (under 0.5 GB), the check does not
        r = _stage(cfg, 6, {"CKPTFLOW_SANITY_BUILDERS": "tests.loops.hungry:build"}, cgroup)
        with open(os.path.join(cgroup, "memory.failcnt")) as f:
            hit = int(f.read())
    finally:
        for _ in range(50):  # the killed process leaves the group a moment after
            try:
                os.rmdir(cgroup)
                break
            except OSError:
                subprocess.run(["sleep", "0.1"])
    assert r.returncode == 0, r.stderr[-3000:]  # the worker survived the check it started
    assert hit > 0, "the limit was reached"
    why = _unproven(run, 6)
    assert "killed by SIGKILL" in why and "memory" in why, why
    assert os.path.isdir(os.path.join(os.path.dirname(cfg), "warm", "tiny", layout.step_name(6)))


def test_a_worker_without_the_models_code_leaves_the_checkpoint_unproven(hot, monkeypatch, caplog):
    from ckptflow.tasks.checkpoint import CheckpointRef
    from ckptflow.tasks.config import load_config
    from ckptflow.tasks.stages import VERIFY, run_stage

    run, cfg = hot
    _builder(run, 4, "ckptflow_model_not_here:build")
    monkeypatch.setenv("CKPTFLOW_SANITY_BUILDERS", "ckptflow_model_not_here:build")  # allowed, not installed
    rec = run_stage(VERIFY, CheckpointRef(load_config(cfg), "tiny", 4))
    assert rec.ok and rec.record == "verified"
    why = _unproven(run, 4)
    assert "cannot build the model" in why and "ckptflow_model_not_here" in why, why
    assert "not proven restorable, carried on" in caplog.text
