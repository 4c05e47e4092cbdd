"""Snapshot consistency: the checkpoint of step N holds the state after step N, even
though training goes on (and changes every parameter) while it is being written.

pytorch#144657: an async save of CPU tensors wrote values from after later updates.
Here the writer is made slow (``write`` fault with a sleep) so that steps N+1 and N+2
run before step N's files are written; the files must still be byte-identical to
those of a run whose writer was not slowed. (Checked to fail when the stager is
replaced by one that hands DCP the live tensors.)
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest

from ckptflow.trainer.format import layout
from tests.helpers import PY, REPO, metrics, run_torchrun, step_dir, torchrun_env

ARGS = ["--model", "tiny", "--max-steps", "6", "--save-every", "2"]


def _manifest(run, step):
    with open(os.path.join(step_dir(run, step), layout.MANIFEST)) as f:
        return json.load(f)


def test_slow_write_still_saves_the_state_of_its_step(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    ra = run_torchrun(["--ckpt-root", str(a), "--run-id", "r", *ARGS])
    rb = run_torchrun(["--ckpt-root", str(b), "--run-id", "r", *ARGS], env={"CKPTFLOW_FAULT": "write@2:sleep2"})
    assert ra.returncode == 0 and rb.returncode == 0, rb.stderr[-3000:]
    run_a, run_b = os.path.join(a, "r"), os.path.join(b, "r")
    # Training really went on while step 2 was being written.
    wall = {x["step"]: x["wall"] for x in metrics(run_b)}
    assert wall[4] < _manifest(run_b, 2)["created_at"], "steps 3-4 must run before step 2 commits"
    for step in (2, 4, 6):
        fa, fb = _manifest(run_a, step)["files"], _manifest(run_b, step)["files"]
        shards = [n for n in fa if n.endswith(".distcp")]
        assert shards and all(fa[n] == fb[n] for n in shards), f"step {step} shards differ"
        assert _manifest(run_b, step)["sanity"]["probe"]["loss"] == _manifest(run_a, step)["sanity"]["probe"]["loss"]


SCRIPT = textwrap.dedent("""
    import os, torch, torch.distributed.checkpoint as dcp
    from ckptflow.trainer.distenv import exit_process, init_distributed, shutdown
    from ckptflow.trainer.saver import AsyncSaver, SaveRequest
    from ckptflow.trainer.format.manifest import Manifest
    env = init_distributed()
    w = torch.arange(1 << 16, dtype=torch.float32)
    root = os.environ["ROOT"]; os.makedirs(root, exist_ok=True)
    saver = AsyncSaver(rank=0, ckpt_group=env.ckpt_group, mode=os.environ["MODE"])
    req = SaveRequest(step=1, run_path=root, build_manifest=lambda files: Manifest(
        run_id="x", step=1, world_size=1, files=files))
    t = saver.submit({"w": w}, req)
    saver.wait_for_staging()       # what the optimizer pre-hook does
    w.add_(1000.0)                 # the next optimizer step, while the write sleeps
    saver.wait()
    out = {"w": torch.empty_like(w)}
    dcp.load(out, checkpoint_id=os.path.join(root, "step_000000001"), process_group=env.ckpt_group)
    assert torch.equal(out["w"], torch.arange(1 << 16, dtype=torch.float32)), "saved a later state"
    print("blocked_ms", t.blocked_s * 1e3)
    # What the trainer does at the end: without it the interpreter tore the gloo groups
    # down under DCP's executor thread at exit, and the process aborted (SIGABRT,
    # "terminate called without an active exception") after every check had passed.
    saver.close()
    shutdown(env)
    exit_process(0)
""")


@pytest.mark.parametrize("mode", ["async_staging", "sync"])
def test_saver_copies_before_training_mutates(tmp_path, mode):
    env = torchrun_env({"CKPTFLOW_FAULT": "write@1:sleep1", "ROOT": str(tmp_path), "MODE": mode})
    r = subprocess.run([PY, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "blocked_ms" in r.stdout
