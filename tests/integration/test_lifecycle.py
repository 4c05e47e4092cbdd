"""The lifecycle on real parts: a Prefect server (session harness), moto's S3 server over
HTTP, real training jobs; flows run in-process against the harness. Commit events picking up
served lifecycles as in production: ``tests/e2e/test_demo.py``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from ckptflow.trainer.format import layout
from ckptflow.trainer.resume import find_resume_point
from tests.helpers import (
    PY,
    REPO,
    cold_objects,
    cold_steps,
    flip_byte,
    free_port,
    make_run,
    step_dir,
    torchrun_env,
    write_config,
)


@pytest.fixture
def run_copy(tiny_run, tmp_path):
    hot = tmp_path / "hot"
    shutil.copytree(tiny_run, hot / "tiny")
    return hot


def test_lifecycle_twice_does_nothing_twice(prefect_api, s3_endpoint, s3_bucket, tmp_path, run_copy):
    from ckptflow.flows.lifecycle import lifecycle

    cfg = write_config(tmp_path, run_copy, s3_endpoint, s3_bucket, hot_keep=5, warm_keep=5, cold_keep=5)
    first = lifecycle(run_id="tiny", step=6, uri=str(step_dir(run_copy / "tiny", 6)), config=cfg)
    assert first["status"] == "done" and first["archive"]["files"] > 0
    objects = cold_objects(s3_endpoint, s3_bucket)
    second = lifecycle(run_id="tiny", step=6, uri=str(step_dir(run_copy / "tiny", 6)), config=cfg)
    assert second["verify"]["skipped"] and second["promote"]["skipped"] and second["archive"]["skipped"]
    assert cold_objects(s3_endpoint, s3_bucket) == objects  # nothing re-uploaded


def test_a_sanity_step_past_its_timeout_carries_the_checkpoint_on_unproven_and_says_so(
    prefect_api, s3_endpoint, s3_bucket, tmp_path, run_copy
):
    """A check that could not run is not a bad checkpoint (more causes: ``test_could_not_check``): the bytes
    verified, the sanity step was killed at its timeout; the checkpoint reaches cold, and the flow says it is not
    proven."""
    from ckptflow.flows.lifecycle import lifecycle
    from ckptflow.trainer.events import UNPROVEN
    from tests.helpers import server_event

    cfg = write_config(tmp_path, run_copy, s3_endpoint, s3_bucket, lifecycle="sanity_timeout_s = 0.2")
    out = lifecycle(run_id="tiny", step=4, uri=str(step_dir(run_copy / "tiny", 4)), config=cfg)
    assert out["status"] == "done" and out["proven"] is False, out
    assert out["verify"]["sanity"]["error"] == "timeout" and "sanity_timeout_s" in out["verify"]["not_proven"]
    assert 4 in cold_steps(s3_endpoint, s3_bucket, "tiny")
    ev = server_event(prefect_api, "ckptflow.checkpoint.tiny.4", UNPROVEN)
    assert "ran past 0.2 s" in ev["payload"]["reason"], ev


def test_lifecycle_killed_half_way_finishes_on_rerun(prefect_api, s3_endpoint, s3_bucket, tmp_path, run_copy):
    """SIGKILL right after the first object of the archive; the re-run uploads only the rest."""
    cfg = write_config(tmp_path, run_copy, s3_endpoint, s3_bucket, hot_keep=5, warm_keep=5, cold_keep=5)
    code = (
        "from ckptflow.flows.lifecycle import lifecycle; import sys; "
        f"lifecycle(run_id='tiny', step=6, uri='{step_dir(run_copy / 'tiny', 6)}', config='{cfg}')"
    )
    env = dict(torchrun_env(), PREFECT_API_URL=prefect_api, CKPTFLOW_FAULT="archive.uploaded@6")
    r = subprocess.run([PY, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, r.stderr[-2000:]
    assert 6 not in cold_steps(s3_endpoint, s3_bucket, "tiny"), "a partial upload is never committed"
    before = cold_objects(s3_endpoint, s3_bucket)
    assert len(before) >= 1
    from ckptflow.flows.lifecycle import lifecycle

    out = lifecycle(run_id="tiny", step=6, uri=str(step_dir(run_copy / "tiny", 6)), config=cfg)
    assert out["status"] == "done" and out["verify"]["skipped"] and out["promote"]["skipped"]
    assert out["archive"]["skipped_files"] >= 1, out["archive"]
    after = cold_objects(s3_endpoint, s3_bucket)
    assert all(after[k] == v for k, v in before.items()), "objects uploaded before the kill are not re-sent"
    assert 6 in cold_steps(s3_endpoint, s3_bucket, "tiny")


def test_corrupted_shard_is_quarantined_never_promoted_and_skipped_by_resume(
    prefect_api, s3_endpoint, s3_bucket, tmp_path, run_copy
):
    from ckptflow.flows.lifecycle import lifecycle

    cfg = write_config(tmp_path, run_copy, s3_endpoint, s3_bucket, hot_keep=5)
    run = run_copy / "tiny"
    shard = sorted(p for p in os.listdir(step_dir(run, 6)) if p.endswith(".distcp"))[0]
    flip_byte(os.path.join(step_dir(run, 6), shard))
    out = lifecycle(run_id="tiny", step=6, uri=str(step_dir(run, 6)), config=cfg)
    assert out["status"] == "quarantined" and "checksum" in out["verify"]["reasons"][0]
    assert shard in out["verify"]["reasons"][0]
    assert not (tmp_path / "warm" / "tiny" / layout.step_name(6)).exists()
    assert 6 not in cold_steps(s3_endpoint, s3_bucket, "tiny")
    rec = json.loads((run / "_lifecycle" / layout.step_name(6) / "quarantined.json").read_text())
    assert rec["reasons"]
    # Repair the bytes: resume still skips it, because the lifecycle said no.
    flip_byte(os.path.join(step_dir(run, 6), shard))
    assert find_resume_point(str(run)).chosen.step == 4


def _tamper(ckpt: str, fn) -> None:
    """Change one tensor of a checkpoint and rewrite it *with valid checksums*.

    The attacker (or a buggy writer) knows the format: the new files verify. Only the
    restore sanity step or the expectations can tell.
    """
    script = f"""
import json, os, shutil, tempfile, torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
from ckptflow.trainer.format.checksum import hash_file
ckpt = {ckpt!r}
tmp = tempfile.mkdtemp()
dcp_to_torch_save(ckpt, tmp + "/full.pt")
sd = torch.load(tmp + "/full.pt", weights_only=False)
w = sd["model"]["blocks.0.fc.weight"]
{fn}
new = tmp + "/dcp"
torch.save(sd, tmp + "/full.pt")
torch_save_to_dcp(tmp + "/full.pt", new)
m = json.load(open(ckpt + "/manifest.json"))
for n in list(m["files"]):
    os.unlink(os.path.join(ckpt, n))
m["files"] = {{}}
for n in os.listdir(new):
    shutil.copy(os.path.join(new, n), os.path.join(ckpt, n))
    d, s = hash_file(os.path.join(ckpt, n))
    m["files"][n] = {{"size": s, "checksum": d}}
m["total_bytes"] = sum(e["size"] for e in m["files"].values())
json.dump(m, open(ckpt + "/manifest.json", "w"))
"""
    r = subprocess.run([PY, "-c", script], cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize(
    "tamper,caught_by",
    [
        ("w.mul_(1.5)", "sanity"),  # plausible values, wrong model: probe loss differs
        ("w.view(-1)[7] = float('nan')", "sanity"),  # a NaN: the probe loss and expectations both object
    ],
)
def test_tampered_tensor_with_valid_checksums_is_caught(
    prefect_api, s3_endpoint, s3_bucket, tmp_path, run_copy, tamper, caught_by
):
    from ckptflow.flows.lifecycle import lifecycle
    from ckptflow.trainer.verify import verify_checkpoint

    cfg = write_config(tmp_path, run_copy, s3_endpoint, s3_bucket, hot_keep=5)
    run = run_copy / "tiny"
    _tamper(str(step_dir(run, 6)), tamper)
    assert verify_checkpoint(str(step_dir(run, 6))).ok, "checksums alone cannot see it"
    out = lifecycle(run_id="tiny", step=6, uri=str(step_dir(run, 6)), config=cfg)
    assert out["status"] == "quarantined"
    assert out["verify"]["reasons"][0].startswith(caught_by), out["verify"]["reasons"]


def test_expectations_catch_what_the_probe_cannot(tmp_path):
    """Statistics-level checks alone: a negative Adam second moment and a NaN."""
    from ckptflow.tasks.expectations import validate

    ok = [
        {"name": "w", "kind": "param", "numel": 4, "finite_frac": 1.0, "norm": 1.0, "min": -1, "max": 1, "mean": 0},
        {
            "name": "w.exp_avg_sq",
            "kind": "exp_avg_sq",
            "numel": 4,
            "finite_frac": 1.0,
            "norm": 1e-3,
            "min": 0.0,
            "max": 1e-3,
            "mean": 1e-4,
        },
    ]
    assert validate(ok, ok, step=4, prev_step=2, max_norm_change=0.5).success
    neg = [dict(ok[0]), dict(ok[1], min=-1e-9)]
    rep = validate(neg, ok, step=4, prev_step=2, max_norm_change=0.5)
    assert not rep.success and "Adam second moments" in " ".join(rep.failures)
    nan = [dict(ok[0], finite_frac=0.75), ok[1]]
    assert not validate(nan, ok, step=4, prev_step=2, max_norm_change=0.5).success
    jump = [dict(ok[0], norm=3.0), ok[1]]
    assert not validate(jump, ok, step=4, prev_step=2, max_norm_change=0.5).success
    assert not validate(ok, ok, step=2, prev_step=4, max_norm_change=0.5).success  # step went back


def test_reconcile_processes_commits_missed_while_the_server_was_down(prefect_api, s3_endpoint, s3_bucket, tmp_path):
    from ckptflow.flows.reconcile import reconcile

    hot = tmp_path / "hot"
    cfg = write_config(tmp_path, hot, s3_endpoint, s3_bucket, hot_keep=5, warm_keep=5, cold_keep=5, sanity=False)
    # Training while "the server is down": events go to a port nobody listens on.
    make_run(hot, "down", max_steps=4, save_every=2, env={"PREFECT_API_URL": f"http://127.0.0.1:{free_port()}/api"})
    run = hot / "down"
    assert not (run / "_lifecycle").exists()
    out = reconcile(config=cfg)
    assert out["runs"]["down"]["unfinished"] == [2, 4]
    assert [x["status"] for x in out["runs"]["down"]["processed"]] == ["done", "done"]
    assert cold_steps(s3_endpoint, s3_bucket, "down") == {2, 4}
    again = reconcile(config=cfg)  # nothing left: no duplicate work
    assert again["runs"]["down"]["unfinished"] == [] and again["runs"]["down"]["processed"] == []


def test_reconcile_takes_over_a_lifecycle_whose_process_died(prefect_api, s3_endpoint, s3_bucket, tmp_path, run_copy):
    """SIGKILL mid-lifecycle leaves the flow run RUNNING on the server forever; reconcile sees
    that its process is gone (heartbeat), marks the run crashed and finishes the work."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from ckptflow.flows.reconcile import reconcile

    cfg = write_config(tmp_path, run_copy, s3_endpoint, s3_bucket, hot_keep=5, warm_keep=5, cold_keep=5, sanity=False)
    flt = FlowRunFilter(name=FlowRunFilterName(any_=["lifecycle-tiny-step6"]))
    with get_client(sync_client=True) as c:  # other tests of this session used the same name
        earlier = {x.id for x in c.read_flow_runs(flow_run_filter=flt)}
    code = (
        "from ckptflow.flows.lifecycle import lifecycle; "
        f"lifecycle(run_id='tiny', step=6, uri='{step_dir(run_copy / 'tiny', 6)}', config='{cfg}')"
    )
    env = dict(torchrun_env(), PREFECT_API_URL=prefect_api, CKPTFLOW_FAULT="verify.integrity@6")
    for _ in range(2):  # killed twice: two runs left RUNNING, both must be dealt with
        r = subprocess.run([PY, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == -9, r.stderr[-2000:]
    with get_client(sync_client=True) as c:
        states = [x.state_type.value for x in c.read_flow_runs(flow_run_filter=flt) if x.id not in earlier]
    assert states == ["RUNNING", "RUNNING"]
    out = reconcile(config=cfg)
    assert 6 in [x["step"] for x in out["runs"]["tiny"]["processed"]]
    assert 6 in cold_steps(s3_endpoint, s3_bucket, "tiny")
    with get_client(sync_client=True) as c:
        states = sorted(x.state_type.value for x in c.read_flow_runs(flow_run_filter=flt) if x.id not in earlier)
    assert states == ["COMPLETED", "CRASHED", "CRASHED"], states
    assert reconcile(config=cfg)["runs"]["tiny"]["processed"] == []  # nothing twice


def test_reconcile_leaves_a_queued_lifecycle_to_its_worker_until_the_grace_runs_out(
    prefect_api, s3_endpoint, s3_bucket, tmp_path, run_copy
):
    """An event-triggered lifecycle waiting for a worker slot is not stolen; one queued
    longer than ``queued_grace_s`` (no worker will come) is taken over."""
    from prefect.client.orchestration import get_client
    from prefect.states import Scheduled

    from ckptflow.flows.lifecycle import lifecycle
    from ckptflow.flows.reconcile import reconcile

    cfg = write_config(tmp_path, run_copy, s3_endpoint, s3_bucket, hot_keep=5, warm_keep=5, cold_keep=5, sanity=False)
    with get_client(sync_client=True) as c:
        dep = c.create_deployment(flow_id=c.create_flow(lifecycle), name="queued-test")
        queued = [
            c.create_flow_run_from_deployment(dep, name=f"lifecycle-tiny-step{s}", state=Scheduled()).id for s in (4, 6)
        ]
        out = reconcile(config=cfg)["runs"]["tiny"]
        assert [x["step"] for x in out["processed"]] == [2] and {4, 6} <= set(out["in_flight"])
        out = reconcile(config=cfg, queued_grace_s=0.0)["runs"]["tiny"]
        assert [x["step"] for x in out["processed"]] == [4, 6]
        assert [c.read_flow_run(q).state_type.value for q in queued] == ["CRASHED", "CRASHED"]
