"""Restore drills and alerts on real parts: moto S3 over HTTP, a Prefect harness, a real
HTTP receiver on 127.0.0.1 for the webhook, torchrun for the sanity step."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import threading
import time

import boto3
import pytest

from ckptflow.trainer import events
from ckptflow.trainer.format import layout
from tests.helpers import PY, REPO, write_config


class Receiver:
    """A webhook endpoint that records every POST body."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                n = int(self.headers.get("Content-Length", 0))
                outer.bodies.append(json.loads(self.rfile.read(n) or b"{}"))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *a):
                pass

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}/hook"

    def wait(self, pred, timeout: float = 60.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hits = [b for b in self.bodies if pred(b)]
            if hits:
                time.sleep(5)  # a duplicate would arrive within this window
                return [b for b in self.bodies if pred(b)]
            time.sleep(0.5)
        return []


@pytest.fixture(scope="module")
def receiver(prefect_api):
    from ckptflow.flows.alerts import setup_alerts

    r = Receiver()
    setup_alerts(r.url, stall_after_s=10)
    yield r
    r.srv.shutdown()


@pytest.fixture
def cold_run(tiny_run, tmp_path, s3_endpoint, s3_bucket):
    """tiny_run's steps 4 and 6 archived to a fresh bucket (zstd); returns the config path."""
    import shutil

    from ckptflow.tasks.config import load_config
    from ckptflow.tasks.storage import Tier
    from ckptflow.tasks.transfer import archive

    hot = tmp_path / "hot"
    shutil.copytree(tiny_run, hot / "tiny")
    cfg = write_config(tmp_path, hot, s3_endpoint, s3_bucket)
    c = load_config(cfg)
    for s in (4, 6):
        archive(Tier(c.hot), Tier(c.cold), "tiny", s)
    return cfg


def listing(s3_endpoint, bucket) -> dict[str, str]:
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    return {
        o["Key"]: o["ETag"]
        for p in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        for o in p.get("Contents", [])
    }


def test_drill_on_a_good_checkpoint_passes_and_reports(prefect_api, cold_run, tmp_path):
    from ckptflow.flows.drill import restore_drill

    out = restore_drill(
        run_id="tiny",
        config=cold_run,
        random_older=True,
        seed=1,
        history_dir=str(tmp_path / "drills"),
        scratch_dir=str(tmp_path / "scratch"),
    )
    assert out["ok"]
    results = out["runs"]["tiny"]["results"]
    assert [r["step"] for r in results] == [6, 4]  # newest, then a random older one
    for r in results:
        assert r["ok"] and r["probe_match"] == "bitwise"
        assert r["world_size"] != r["saved_world_size"]  # restored at another world size
        assert {"download", "decompress", "verify", "sanity", "total"} <= set(r["seconds"])
        assert r["bytes_stored"] > 0
    assert os.path.getsize(out["runs"]["tiny"]["plot"]) > 10_000
    assert os.listdir(tmp_path / "scratch") == []  # scratch removed
    hist = [json.loads(x) for x in open(tmp_path / "drills" / "tiny.jsonl")]
    assert len(hist) == 2 and all(h["recovery_seconds"] > 0 for h in hist)


def _flip(s3, bucket, key):
    body = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 1
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(body))


def _delete(s3, bucket, key):
    s3.delete_object(Bucket=bucket, Key=key)


# A truncated object fails the same size-and-digest check as a corrupted one (test_corruption.py truncates)
@pytest.mark.parametrize("damage", [_flip, _delete], ids=["corrupted", "missing"])
def test_drill_on_a_damaged_object_fails_names_it_alerts_once_and_changes_nothing(
    prefect_api, receiver, cold_run, s3_endpoint, s3_bucket, tmp_path, damage
):
    from ckptflow.flows.drill import DrillFailed, restore_drill

    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    key = sorted(k for k in listing(s3_endpoint, s3_bucket) if f"/{layout.step_name(6)}/__" in k)[0]
    damage(s3, s3_bucket, key)
    before = listing(s3_endpoint, s3_bucket)
    with pytest.raises(DrillFailed) as ei:
        restore_drill(
            run_id="tiny",
            config=cold_run,
            random_older=False,
            history_dir=str(tmp_path / "drills"),
            scratch_dir=str(tmp_path / "scratch"),
        )
    obj = key.rsplit("/", 1)[1]
    assert obj in str(ei.value), ei.value
    assert listing(s3_endpoint, s3_bucket) == before, "a drill only reads the tiers"
    assert os.listdir(tmp_path / "scratch") == []
    hits = receiver.wait(
        lambda b: "restore drill FAILED" in b.get("subject", "") and "tiny" in b["subject"] and obj in b.get("body", "")
    )
    assert len(hits) == 1, receiver.bodies
    assert "step 6" in hits[0]["subject"] and obj in hits[0]["body"]
    receiver.bodies.clear()


def test_stalled_trainer_alerts_once(prefect_api, receiver):
    run = f"stall{os.getpid()}"
    events.post_events(
        prefect_api, [events.make_event(events.COMMITTED, run, 10, {"run_id": run, "step": 10})], timeout_s=5
    )
    hits = receiver.wait(lambda b: run in b.get("subject", ""), timeout=90)
    assert len(hits) == 1, receiver.bodies
    assert "no checkpoint committed" in hits[0]["subject"] and "step 10" in hits[0]["body"]


def test_drill_deployment_schedule_after_prefect_deploy(prefect_api):
    from prefect.client.orchestration import get_client

    env = dict(os.environ, PREFECT_API_URL=prefect_api)
    subprocess.run(
        [PY, "-m", "prefect", "work-pool", "create", "ckptflow-pool", "--type", "process"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    names = ["ckptflow-restore-drill/restore-drill", "ckptflow-lifecycle/lifecycle", "ckptflow-reconcile/reconcile"]
    try:
        r = subprocess.run(
            [PY, "-m", "prefect", "--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml", "--all"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        with get_client(sync_client=True) as c:
            dep = c.read_deployment_by_name(names[0])
            assert [s.schedule.cron for s in dep.schedules] == ["0 3 * * *"]
            assert dep.schedules[0].schedule.timezone == "UTC"
            life = c.read_deployment_by_name(names[1])
            assert life.work_pool_name == "ckptflow-pool"
            trig = c.read_resource_related_automations(f"prefect.deployment.{life.id}")
            assert any("ckptflow.checkpoint.committed" in a.trigger.expect for a in trig)
    finally:
        # The harness is shared by the session: leave no deployment (or its trigger) behind
        # to compete with the ones other tests serve under the same names.
        with get_client(sync_client=True) as c:
            for n in names:
                try:
                    d = c.read_deployment_by_name(n)
                except Exception:
                    continue
                c.delete_resource_owned_automations(f"prefect.deployment.{d.id}")
                c.delete_deployment(d.id)
            try:
                c.delete_work_pool("ckptflow-pool")
            except Exception:
                pass
