"""``ckptflow adopt``: a checkpoint another tool wrote becomes a committed ckptflow checkpoint.

The sources are what the tools write: a DCP folder from ``dcp.save`` named as torchtitan names it
(``step-30``), and a ``torch.save`` file named as Lightning names it (``epoch=1-step=40.ckpt``).
The CLI runs as a user starts it; the lifecycle runs in-process against the session's Prefect
server and moto, as in ``test_lifecycle.py``.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from ckptflow.trainer.events import COMMITTED, read_outbox, resource_id
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.commit import committed_steps
from tests.helpers import PY, REPO, adopt_cli, cold_steps, server_event, torchrun_env, write_config


class NotOurs:
    """A class a pickle would build (and could run code from): the restricted loader refuses it."""


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.w": torch.randn(64, 32, generator=g),
        "model.b": torch.randn(32, generator=g),
        "step": torch.tensor(30),
    }


def _dcp_folder(where) -> str:
    import torch.distributed.checkpoint as dcp

    path = str(where / "step-30")
    dcp.save(_state(), checkpoint_id=path, no_dist=True)
    return path


TITAN = """
import os, pickle, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from ckptflow.trainer.distenv import exit_process
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))
for layer in (model[0], model[2]):
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
for step in range(1, 21):
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step(); opt.zero_grad(); sched.step()
    if step % 10 == 0:
        # torchtitan's CheckpointManager: the model's entries flattened at the top level, then the
        # optimizer, scheduler, data loader (its own state per data-parallel rank, pickled) and
        # train state, saved by dcp.save into <folder>/step-N
        state = {
            **get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, opt),
            "lr_scheduler": {"last_epoch": sched.last_epoch},
            "dataloader": {f"dp_rank_{rank}": pickle.dumps({"samples_yielded": step * 4}), "world_size": 2},
            "train_state": {"step": step, "ntokens_seen": step * 64},
        }
        dcp.save(state, checkpoint_id=os.path.join(os.environ["OUT"], f"step-{step}"))
dist.barrier()
dist.destroy_process_group()
exit_process(0)  # no interpreter finalization racing gloo's threads (a SIGABRT seen here)
"""


def test_torchtitan_s_checkpoints_are_adopted_as_written_taken_to_cold_and_drilled_at_another_world_size(
    prefect_api, s3_endpoint, s3_bucket, tmp_path
):
    """``--watch`` on the folder a 2-rank FSDP2 job writes its checkpoints into as torchtitan's
    checkpointer does (torchtitan itself needs a nightly torch): each ``step-N`` is adopted once DCP
    has finished it, announced, taken to cold, and the drill restores it whole at world size 1."""
    import signal
    import time

    from ckptflow.flows.drill import drill_tier
    from ckptflow.flows.lifecycle import lifecycle
    from ckptflow.tasks.config import load_config
    from ckptflow.tasks.drill import drill_one

    folder, hot = tmp_path / "checkpoint", tmp_path / "hot"
    folder.mkdir()
    run = hot / "titan"
    env = torchrun_env({"PREFECT_API_URL": prefect_api})
    watch = subprocess.Popen(
        [PY, "-m", "ckptflow.cli.main", "adopt", "--watch", str(folder), "--run-id", "titan", "--root", str(hot)]
        + ["--poll-s", "0.2", "--json"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        script = tmp_path / "titan.py"
        script.write_text(TITAN)
        job = subprocess.run(
            [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)],
            cwd=REPO,
            env=torchrun_env({"OUT": str(folder)}),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert job.returncode == 0, job.stderr[-3000:]
        deadline = time.monotonic() + 60
        while committed_steps(str(run)) != [20, 10]:
            assert watch.poll() is None and time.monotonic() < deadline, committed_steps(str(run))
            time.sleep(0.1)
    finally:
        watch.send_signal(signal.SIGTERM)
        out, err = watch.communicate(timeout=30)
    assert watch.returncode == 0, err
    assert [x["step"] for x in read_outbox(str(run))] == [10, 20]  # the records reconcile reads
    final = run / layout.step_name(20)
    m = json.loads((final / layout.MANIFEST).read_text())
    assert m["adopted"]["format"] == "dcp" and m["world_size"] == 2
    assert sorted(m["files"]) == sorted(os.listdir(folder / "step-20"))
    ev = server_event(prefect_api, resource_id("titan", 20))  # what the deployed trigger fires on
    assert ev["event"] == COMMITTED and ev["payload"]["uri"] == str(final) and ev["payload"]["adopted"] == "dcp"

    cfg = write_config(tmp_path, hot, s3_endpoint, s3_bucket, hot_keep=5)
    done = lifecycle(run_id="titan", step=20, uri=str(final), config=cfg)
    assert done["status"] == "done", done
    assert done["verify"]["sanity"]["check"] == "parse" and done["verify"]["sanity"]["ok"], done["verify"]
    assert 20 in cold_steps(s3_endpoint, s3_bucket, "titan")

    # The drill's own step (its flow, history and plot are tests/integration/test_drill.py's).
    res = drill_one(drill_tier(load_config(cfg)), "titan", 20)
    assert res.ok and res.tier == "cold" and (res.saved_world_size, res.world_size) == (2, 1), res
    assert res.seconds["load"] > 0


def test_a_lightning_style_file_takes_its_step_from_its_name_and_parses_without_pickle(
    prefect_api, s3_endpoint, s3_bucket, tmp_path
):
    from ckptflow.flows.drill import drill_tier
    from ckptflow.flows.lifecycle import lifecycle
    from ckptflow.tasks.adopt import parse_check
    from ckptflow.tasks.config import load_config
    from ckptflow.tasks.drill import drill_one
    from ckptflow.trainer.format.manifest import read_manifest
    from ckptflow.trainer.verify import verify_checkpoint

    f = tmp_path / "epoch=1-step=40.ckpt"
    torch.save({"state_dict": _state(), "epoch": 1, "global_step": 40}, f)
    hot = tmp_path / "hot"
    r = adopt_cli(str(f), "--run-id", "lit", "--root", str(hot))
    assert r.returncode == 0, r.stderr
    final = hot / "lit" / layout.step_name(40)
    assert verify_checkpoint(str(final)).ok
    assert parse_check(str(final), read_manifest(str(final)))["ok"]
    cfg = write_config(tmp_path, hot, s3_endpoint, s3_bucket, hot_keep=5)
    out = lifecycle(run_id="lit", step=40, uri=str(final), config=cfg)
    assert out["status"] == "done" and out["verify"]["sanity"]["check"] == "parse", out
    drilled = drill_one(drill_tier(load_config(cfg)), "lit", 40)  # cold -> scratch -> parse
    assert drilled.ok and drilled.tier == "cold", drilled

    bad = tmp_path / "step=50.ckpt"
    torch.save({"state_dict": _state(), "obj": NotOurs()}, bad)
    assert adopt_cli(str(bad), "--run-id", "lit", "--root", str(hot)).returncode == 0  # bytes are bytes
    final = hot / "lit" / layout.step_name(50)
    res = parse_check(str(final), read_manifest(str(final)))
    assert not res["ok"] and "restricted loader refuses" in res["problems"][0], res
    out = lifecycle(run_id="lit", step=50, uri=str(final), config=cfg)
    assert out["status"] == "quarantined" and "restricted loader refuses" in json.dumps(out["verify"]), out


@pytest.mark.parametrize("damage", ["no_metadata", "truncated", "not_a_zip"])
def test_an_unfinished_checkpoint_is_refused_naming_it_and_nothing_is_committed(tmp_path, damage):
    if damage == "not_a_zip":
        src = tmp_path / "step=7.ckpt"
        src.write_bytes(b"PK\x03\x04 half of a torch.save")
    else:
        src = _dcp_folder(tmp_path / "titan")
        if damage == "no_metadata":
            os.remove(os.path.join(src, layout.DCP_METADATA))
        else:
            data = sorted(p for p in os.listdir(src) if p.endswith(".distcp"))[0]
            with open(os.path.join(src, data), "r+b") as f:
                f.truncate(100)
    hot = tmp_path / "hot"
    r = adopt_cli(str(src), "--run-id", "x", "--root", str(hot))
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert str(src) in r.stderr and ("being written" in r.stderr or "not a DCP" in r.stderr), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1  # one line, no traceback
    assert committed_steps(str(hot / "x")) == []


def test_a_crash_mid_adoption_leaves_nothing_trusted_and_a_rerun_finishes(tmp_path):
    src = _dcp_folder(tmp_path / "titan")
    hot = tmp_path / "hot"
    r = adopt_cli(
        src, "--run-id", "titan", "--root", str(hot), env=dict(torchrun_env(), CKPTFLOW_FAULT="adopt.copy@30")
    )
    assert r.returncode == -9, r.stderr
    run = hot / "titan"
    assert committed_steps(str(run)) == [] and read_outbox(str(run)) == []
    assert os.path.isdir(run / layout.tmp_name(30))  # what was copied, in a folder no reader trusts
    r = adopt_cli(src, "--run-id", "titan", "--root", str(hot))
    assert r.returncode == 0, r.stderr
    assert committed_steps(str(run)) == [30] and [x["step"] for x in read_outbox(str(run))] == [30]
    assert not os.path.exists(run / layout.tmp_name(30))


def test_other_files_for_a_committed_step_are_refused(tmp_path):
    src = _dcp_folder(tmp_path / "a")
    hot = tmp_path / "hot"
    assert adopt_cli(src, "--run-id", "t", "--root", str(hot)).returncode == 0
    other = tmp_path / "b" / "step-30"
    import torch.distributed.checkpoint as dcp

    dcp.save({"model.w": torch.ones(3)}, checkpoint_id=str(other), no_dist=True)
    r = adopt_cli(str(other), "--run-id", "t", "--root", str(hot))
    assert r.returncode == 2 and "already committed" in r.stderr, r.stderr


def test_watch_adopts_each_checkpoint_once_it_is_finished_and_stops_on_sigterm(tmp_path):
    """``--watch``: a DCP folder whose ``.metadata`` has not landed yet is left alone (DCP writes
    it last), then adopted once it has; a torch.save file likewise once its zip is whole."""
    import shutil
    import signal
    import time

    written = _dcp_folder(tmp_path / "elsewhere")
    watched = tmp_path / "ckpts"
    watched.mkdir()
    hot = tmp_path / "hot"
    run = hot / "w"
    proc = subprocess.Popen(
        [PY, "-m", "ckptflow.cli.main", "adopt", "--watch", str(watched), "--run-id", "w", "--root", str(hot)]
        + ["--poll-s", "0.2"],
        cwd=REPO,
        env=torchrun_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def wait_for(steps: list[int], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while sorted(committed_steps(str(run))) != steps:
            assert proc.poll() is None and time.monotonic() < deadline, (committed_steps(str(run)), proc.poll())
            time.sleep(0.1)

    try:
        dst = watched / "step-30"
        dst.mkdir()
        for name in os.listdir(written):  # the data files first, as DCP writes them
            if name != layout.DCP_METADATA:
                shutil.copy(os.path.join(written, name), dst / name)
        time.sleep(3)  # many polls
        assert committed_steps(str(run)) == [], "adopted before its .metadata was written"
        shutil.copy(os.path.join(written, layout.DCP_METADATA), dst / layout.DCP_METADATA)
        wait_for([30])
        whole = tmp_path / "whole.ckpt"
        torch.save({"state_dict": _state()}, whole)
        half = watched / "epoch=0-step=40.ckpt"
        half.write_bytes(whole.read_bytes()[:1000])  # torch.save half way: no zip directory yet
        time.sleep(2)
        assert sorted(committed_steps(str(run))) == [30]
        half.write_bytes(whole.read_bytes())
        wait_for([30, 40])
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert out.count("adopted as w step") == 2, out
    assert [x["step"] for x in read_outbox(str(run))] == [30, 40]


def test_two_adoptions_of_one_step_at_once_commit_it_once(tmp_path):
    src = _dcp_folder(tmp_path / "titan")
    hot = tmp_path / "hot"
    cmd = [PY, "-m", "ckptflow.cli.main", "adopt", src, "--run-id", "t", "--root", str(hot)]
    procs = [
        subprocess.Popen(cmd, cwd=REPO, env=torchrun_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted("already" in o for o, _ in outs) == [False, True], outs
    assert committed_steps(str(hot / "t")) == [30] and len(read_outbox(str(hot / "t"))) == 1


def test_a_ckptflow_checkpoint_is_not_adopted_again(tmp_path):
    src = _dcp_folder(tmp_path / "titan")
    hot = tmp_path / "hot"
    assert adopt_cli(src, "--run-id", "t", "--root", str(hot)).returncode == 0
    r = adopt_cli(str(hot / "t" / layout.step_name(30)), "--run-id", "u", "--root", str(hot))
    assert r.returncode == 2 and "ckptflow checkpoint already" in r.stderr, r.stderr
    assert committed_steps(str(hot / "u")) == []
