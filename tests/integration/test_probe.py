"""The sanity probe off the training thread (trainer/probe.py).

The recorded probe loss comes from the staged copy, computed in the commit thread; the live
probe (``SanitySpec.probe_fn``, a forward pass on the training thread) runs only at the first
save of an attempt, as a check. These run the reference model in real torchrun processes
(gloo, 2 ranks, FSDP2 and DDP) and count how often the live probe ran.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import textwrap

import pytest

from ckptflow.trainer import layout
from tests.helpers import PY, REPO, torchrun_env

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    from ckptflow.trainer.checkpointer import CheckpointConfig, CheckpointManager, Provenance, SanitySpec
    from ckptflow.trainer.distenv import init_distributed, shutdown
    from ckptflow.trainer.reference.build import BUILDER, TrainConfig, build
    from ckptflow.trainer.reference.model import ModelConfig, lm_loss

    env = init_distributed()
    tcfg = TrainConfig(model=ModelConfig.preset("tiny").to_dict(), parallel=os.environ["PARALLEL"])
    b = build(tcfg.to_dict())
    calls = []
    skew = float(os.environ.get("SKEW", "0"))

    def live():
        calls.append(1)
        return b.probe_loss() + skew   # SKEW: a live model the staged copy does not match

    ckpt = CheckpointManager(
        CheckpointConfig(root=os.environ["ROOT"], run_id="r", interval=2, async_mode=os.environ["MODE"],
                         emit_events=False, on_save_error=os.environ.get("ON_ERROR", "raise")),
        model=b.model, optimizer=b.optimizer, scheduler=b.scheduler,
        provenance=Provenance(config=tcfg.to_dict(), data_fingerprint="test"),
        sanity=SanitySpec(builder=os.environ.get("BUILDER", BUILDER), config=tcfg.to_dict(),
                          probe_tokens=b.probe.tolist(), probe_fn=live,
                          background=os.environ.get("BACKGROUND", "1") == "1"),
        env=env,
    )
    g = torch.Generator().manual_seed(7 + env.rank)
    errors = []
    for step in range(1, 9):
        x = torch.randint(0, 64, (2, 17), generator=g)
        lm_loss(b.model, x).backward()
        b.optimizer.step(); b.scheduler.step(); b.optimizer.zero_grad()
        ckpt.save(step)
    ckpt.close()
    if env.rank == 0:
        print("live_calls", len(calls))
    shutdown(env)
""")


def _run(tmp_path, **env):
    e = torchrun_env({"ROOT": str(tmp_path), "MODE": "async_staging", "PARALLEL": "fsdp", **env})
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    r = subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    calls = int(r.stdout.split("live_calls")[1].split()[0])
    manifests = {}
    for d in sorted(glob.glob(str(tmp_path / "r" / "step_*"))):
        with open(os.path.join(d, layout.MANIFEST)) as f:
            m = json.load(f)
        manifests[m["step"]] = m["sanity"]["probe"]
    return r, calls, manifests


def _sanity(ckpt_dir: str) -> dict:
    s = subprocess.run(
        [PY, "-m", "ckptflow.trainer.sanity", ckpt_dir], cwd=REPO, env=torchrun_env(), capture_output=True, text=True
    )
    return json.loads(s.stdout)


@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_probe_runs_off_the_training_thread_and_stays_bitwise(tmp_path, parallel):
    r, calls, probes = _run(tmp_path, PARALLEL=parallel)
    assert sorted(probes) == [2, 4, 6, 8], r.stderr[-2000:]
    # Four saves, one live forward pass: the first save's check. The rest came from the staged copy.
    assert calls == 1
    assert probes[2]["source"] == "staged_copy+live_check"
    assert all(probes[s]["source"] == "staged_copy" for s in (4, 6, 8))
    # As strong as before: the sanity step rebuilds each checkpoint and gets the same bits.
    for step in (4, 8):
        res = _sanity(str(tmp_path / "r" / layout.step_name(step)))
        assert res["probe_match"] == "bitwise", res


def test_background_off_probes_the_live_model_every_save(tmp_path):
    _, calls, probes = _run(tmp_path, BACKGROUND="0")
    assert calls == 4 and all(p["source"] == "live_model" for p in probes.values())


def test_a_staged_copy_that_is_not_the_live_state_is_refused(tmp_path):
    """The first save's check: a live model that disagrees with the staged copy fails that save
    (earlier checkpoints: none to damage), and every later save records the live model's loss."""
    r, calls, probes = _run(tmp_path, SKEW="0.001", ON_ERROR="continue")
    assert "ProbeMismatch" in r.stderr and "staged copy's probe loss" in r.stderr
    assert 2 not in probes, "the save whose check failed must not commit"
    assert sorted(probes) == [4, 6, 8] and all(p["source"] == "live_model" for p in probes.values())
    assert calls == 4


def test_a_builder_that_cannot_build_falls_back_to_the_live_probe(tmp_path):
    r, calls, probes = _run(tmp_path, BUILDER="no_such_module_ckptflow:build")
    assert "sanity probe on the training thread at every save" in r.stderr and "no_such_module_ckptflow" in r.stderr
    assert calls == 4 and sorted(probes) == [2, 4, 6, 8]
    assert all(p["source"] == "live_model" for p in probes.values())


# ---- SanitySpec(reference="next_step"): the loss the loop computes anyway ---------------------

NEXT_STEP = textwrap.dedent("""
    import os
    import torch
    from ckptflow.trainer.checkpointer import CheckpointConfig, CheckpointManager, Provenance, SanitySpec
    from ckptflow.trainer.distenv import init_distributed, shutdown
    from ckptflow.trainer.reference.build import BUILDER, TrainConfig, build
    from ckptflow.trainer.reference.data import GlobalSampler
    from ckptflow.trainer.reference.model import ModelConfig, lm_loss
    from ckptflow.trainer.state import reseed_rng

    env = init_distributed()
    mcfg = {**ModelConfig.preset("tiny").to_dict(), "dropout": 0.1}   # dropout: the RNG must be restored too
    tcfg = TrainConfig(model=mcfg, global_batch=4, parallel="fsdp")
    b = build(tcfg.to_dict())
    sampler = GlobalSampler(tcfg.data(), global_batch=4, rank=env.rank, world_size=env.world_size)
    reseed_rng(99 + env.rank)
    calls = []

    def live():
        calls.append(1)
        return b.probe_loss()

    ckpt = CheckpointManager(
        CheckpointConfig(root=os.environ["ROOT"], run_id="r", interval=2, emit_events=False),
        model=b.model, optimizer=b.optimizer, scheduler=b.scheduler, sampler=sampler,
        provenance=Provenance(config=tcfg.to_dict(), data_fingerprint="test"),
        sanity=SanitySpec(builder=BUILDER, config=tcfg.to_dict(), probe_tokens=b.probe.tolist(), probe_fn=live,
                          reference="next_step"),
        env=env,
    )
    skew = float(os.environ.get("SKEW", "0"))
    for step in range(1, 8):
        loss = lm_loss(b.model, sampler.next_batch())
        if step != int(os.environ.get("MISS", "-1")):
            ckpt.observe_loss(step, loss + skew)   # SKEW: a loop that reports another loss than it computed
        loss.backward()
        b.optimizer.step(); b.scheduler.step(); b.optimizer.zero_grad()
        ckpt.save(step, force=(step == 7))
    ckpt.close()
    if env.rank == 0:
        print("live_calls", len(calls))
    shutdown(env)
""")


def _run_next_step(tmp_path, **env):
    e = torchrun_env({"ROOT": str(tmp_path), **env})
    script = tmp_path / "loop.py"
    script.write_text(NEXT_STEP)
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    r = subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    probes = {}
    for d in sorted(glob.glob(str(tmp_path / "r" / "step_*"))):
        with open(os.path.join(d, layout.MANIFEST)) as f:
            m = json.load(f)
        probes[m["step"]] = m["sanity"]["probe"]
    return r, int(r.stdout.split("live_calls")[1].split()[0]), probes


def test_the_next_step_s_loss_is_the_reference_and_replays_bitwise(tmp_path):
    """No probe forward pass at any save: each checkpoint records the loss the loop computed at
    the step after it, and the sanity step (one process, the saving world size was 2) replays
    that step — restored data position, rank 0's dropout RNG, train mode — to the same bits. The
    last save has no step after it: close() records the fixed probe batch instead."""
    r, calls, probes = _run_next_step(tmp_path)
    assert sorted(probes) == [2, 4, 6, 7], r.stderr[-2000:]
    assert all(probes[s]["kind"] == "next_step" and probes[s]["world_size"] == 2 for s in (2, 4, 6))
    assert probes[7]["kind"] == "fixed_batch" and probes[7]["source"] == "live_model_at_close"
    assert calls == 1  # close() only
    for step in (2, 6, 7):
        res = _sanity(str(tmp_path / "r" / layout.step_name(step)))
        assert res["ok"] and res["probe_match"] == "bitwise", res
        assert res["probe_kind"] == ("fixed_batch" if step == 7 else "next_step")
    # At a third world size too (as a restore drill runs it): FSDP over 3 ranks, each replaying
    # rank 0's share of the saving job's batch; rank 0 has rank 0's RNG.
    from ckptflow.tasks.verify import run_sanity

    res = run_sanity(str(tmp_path / "r" / layout.step_name(4)), nproc=3, stats=False)
    assert res["ok"] and res["probe_match"] == "bitwise" and res["world_size"] == 3, res


def test_a_next_step_loss_that_is_not_the_checkpoint_s_fails_the_sanity_step(tmp_path):
    """As strong as the probe: a reported loss 1e-3 off (a loop reporting the wrong value, or a
    checkpoint whose state, data position or RNG is not what that step ran on) is a mismatch."""
    _, _, probes = _run_next_step(tmp_path, SKEW="0.001")
    res = _sanity(str(tmp_path / "r" / layout.step_name(4)))
    assert not res["ok"] and res["probe_match"] == "mismatch", res


def test_a_step_that_never_reports_its_loss_commits_without_a_reference(tmp_path):
    """observe_loss not called at step 5: the optimizer pre-hook settles checkpoint 4 without a
    reference (the commit does not wait for a loss that cannot come); the sanity step proves
    the restore and says why there is nothing to compare."""
    r, _, probes = _run_next_step(tmp_path, MISS="5")
    assert probes[4]["kind"] == "none" and "optimizer.step() ran before observe_loss()" in probes[4]["reason"]
    assert probes[2]["kind"] == probes[6]["kind"] == "next_step"
    res = _sanity(str(tmp_path / "r" / layout.step_name(4)))
    assert res["ok"] and res["probe_match"] == "not_recorded" and "observe_loss" in res["probe_note"], res
