"""The sanity step's reference loss (trainer/probe.py): the probe batch's loss on the live model at
every save, or the loss the loop computes anyway at the step after it (``reference="next_step"``),
each replayed bit for bit by the sanity step. The reference model in real torchrun processes
(gloo, 2 ranks, FSDP2)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import textwrap

from ckptflow.trainer.format import layout
from tests.helpers import PY, REPO, torchrun_env

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    from ckptflow.trainer.config import CheckpointConfig, Provenance, SanitySpec
    from ckptflow.trainer.checkpointer import CheckpointManager
    from ckptflow.trainer.distenv import exit_process, init_distributed, shutdown
    from ckptflow.trainer.reference.build import BUILDER, TrainConfig, build
    from ckptflow.trainer.reference.model import ModelConfig, lm_loss

    env = init_distributed()
    tcfg = TrainConfig(model=ModelConfig.preset("tiny").to_dict(), parallel=os.environ["PARALLEL"])
    b = build(tcfg.to_dict())
    calls = []

    def live():
        calls.append(1)
        return b.probe_loss()

    ckpt = CheckpointManager(
        CheckpointConfig(root=os.environ["ROOT"], run_id="r", interval=2, emit_events=False),
        model=b.model, optimizer=b.optimizer, scheduler=b.scheduler,
        provenance=Provenance(config=tcfg.to_dict(), data_fingerprint="test"),
        sanity=SanitySpec(builder=BUILDER, config=tcfg.to_dict(), probe_tokens=b.probe.tolist(), probe_fn=live),
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
    exit_process(0)  # no interpreter finalization racing gloo's threads (a SIGABRT seen in CI)
""")


def _run(tmp_path, **env):
    e = torchrun_env({"ROOT": str(tmp_path), "PARALLEL": "fsdp", **env})
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
        [PY, "-m", "ckptflow.tasks.sanity", ckpt_dir], cwd=REPO, env=torchrun_env(), capture_output=True, text=True
    )
    return json.loads(s.stdout)


def test_the_live_probe_is_recorded_at_every_save_and_replays_bitwise(tmp_path):
    r, calls, probes = _run(tmp_path)
    assert sorted(probes) == [2, 4, 6, 8], r.stderr[-2000:]
    assert calls == 4 and all(p["source"] == "live_model" for p in probes.values())
    res = _sanity(str(tmp_path / "r" / layout.step_name(8)))  # the sanity step rebuilds it and gets the same bits
    assert res["probe_match"] == "bitwise", res


TIED = """
import json, os, sys, torch
from ckptflow.trainer.checkpointer import CheckpointManager
from ckptflow.trainer.config import CheckpointConfig, Provenance, SanitySpec
from ckptflow.trainer.reference.build import TrainConfig
from ckptflow.trainer.reference.model import ModelConfig, lm_loss
from tests.loops.tied import BUILDER, build

tcfg = TrainConfig(model=ModelConfig.preset("tiny").to_dict(), parallel="none")
b = build(tcfg.to_dict())
assert b.raw_model.head.weight is b.raw_model.tok.weight
ckpt = CheckpointManager(
    CheckpointConfig(root=sys.argv[1], run_id="t", interval=3, emit_events=False),
    model=b.model, optimizer=b.optimizer, scheduler=b.scheduler,
    provenance=Provenance(config=tcfg.to_dict(), data_fingerprint="test"),
    sanity=SanitySpec(builder=BUILDER, config=tcfg.to_dict(), probe_tokens=b.probe.tolist(), probe_fn=b.probe_loss),
)
g = torch.Generator().manual_seed(7)
for step in range(1, 4):
    lm_loss(b.model, torch.randint(0, 64, (2, 17), generator=g)).backward()
    b.optimizer.step(); b.scheduler.step(); b.optimizer.zero_grad()
    ckpt.save(step)
ckpt.close()
"""


def test_a_model_with_tied_weights_replays_bitwise_one_module_at_a_time(tmp_path):
    """One parameter in two modules (the output layer tied to the token embedding): each module brings it in from
    its own name when it runs, and the bounded sanity step gets the whole load's loss and statistics, bit for bit."""
    env = torchrun_env({"CKPTFLOW_SANITY_BUILDERS": "tests.loops.tied:build"})
    r = subprocess.run([PY, "-c", TIED, str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    got = {}
    for how in ("bounded", "whole"):
        cmd = [PY, "-m", "ckptflow.tasks.sanity", str(tmp_path / "t" / layout.step_name(3)), "--stats"]
        s = subprocess.run([*cmd, *(["--whole"] if how == "whole" else [])], cwd=REPO, env=env, capture_output=True)
        got[how] = json.loads(s.stdout)
        assert got[how]["ok"] and got[how]["probe_match"] == "bitwise" and got[how]["memory"] == how, got[how]
    assert got["bounded"]["stats"] == got["whole"]["stats"]
    assert "bounded_note" not in got["bounded"]


# ---- SanitySpec(reference="next_step"): the loss the loop computes anyway ---------------------

NEXT_STEP = textwrap.dedent("""
    import os
    import torch
    from ckptflow.trainer.config import CheckpointConfig, Provenance, SanitySpec
    from ckptflow.trainer.checkpointer import CheckpointManager
    from ckptflow.trainer.distenv import exit_process, init_distributed, shutdown
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
    exit_process(0)  # no interpreter finalization racing gloo's threads (a SIGABRT seen in CI)
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
    for step in (6, 7):  # a next-step reference and the close()'s fixed batch (step 4 is replayed at 3 ranks below)
        res = _sanity(str(tmp_path / "r" / layout.step_name(step)))
        assert res["ok"] and res["probe_match"] == "bitwise", res
        assert res["probe_kind"] == ("fixed_batch" if step == 7 else "next_step")
        # one module's tensors at a time (tasks/bounded.py), autograd on as in the loop: the same bits
        assert res["memory"] == "bounded" and "bounded_note" not in res, res
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
    assert res["memory"] == "whole" and "loaded whole to decide" in res["bounded_note"], res  # never the stream alone


def test_a_step_that_never_reports_its_loss_commits_without_a_reference(tmp_path):
    """observe_loss not called at step 5: the optimizer pre-hook settles checkpoint 4 without a
    reference (the commit does not wait for a loss that cannot come); the sanity step proves
    the restore and says why there is nothing to compare."""
    r, _, probes = _run_next_step(tmp_path, MISS="5")
    assert probes[4]["kind"] == "none" and "optimizer.step() ran before observe_loss()" in probes[4]["reason"]
    assert probes[2]["kind"] == probes[6]["kind"] == "next_step"
    res = _sanity(str(tmp_path / "r" / layout.step_name(4)))
    assert res["ok"] and res["probe_match"] == "not_recorded" and "observe_loss" in res["probe_note"], res
