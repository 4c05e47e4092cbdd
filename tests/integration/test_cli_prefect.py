"""The commands that run flows or talk to the Prefect API — ``ls`` after real lifecycles,
``drill``, ``alerts setup`` — on the session's Prefect harness and moto's S3 server."""

from __future__ import annotations

import json
import os
import shutil

import boto3
import pytest

from ckptflow.trainer.format import layout
from tests.helpers import flip_byte, invoke, step_dir, write_config

pytestmark = pytest.mark.usefixtures("wide_tables")


@pytest.fixture(autouse=True)
def _prefect_logs_to_the_session_stream(prefect_api):
    """Prefect binds its console handler to whatever ``sys.stderr`` is when it sets up logging;
    under ``capsys`` that is a per-test stream closed after the test, and every later flow
    log line would fail. Set it up here, before ``capsys`` replaces the stream."""
    from prefect.logging.configuration import setup_logging

    setup_logging(incremental=False)
    yield


@pytest.fixture
def hot_copy(tiny_run, tmp_path):
    shutil.copytree(tiny_run, tmp_path / "hot" / "tiny")
    return tmp_path / "hot"


def test_ls_after_lifecycles_shows_tiers_stages_and_the_quarantine(
    capsys, prefect_api, s3_endpoint, s3_bucket, tmp_path, hot_copy
):
    from ckptflow.flows.lifecycle import lifecycle

    cfg = write_config(tmp_path, hot_copy, s3_endpoint, s3_bucket, hot_keep=5, warm_keep=1, cold_keep=5, sanity=False)
    run = hot_copy / "tiny"
    flip_byte(os.path.join(step_dir(run, 2), "__0_0.distcp"))
    for s in (4, 6, 2):  # 2 last: a later prune would delete the quarantined copy from hot
        lifecycle(run_id="tiny", step=s, uri=str(step_dir(run, s)), config=cfg)

    r = invoke(capsys, "ls", "tiny", "--config", cfg, "--json")
    assert r.code == 0, r.err
    rows = {c["step"]: c for c in r.json()["checkpoints"]}
    assert rows[2]["tiers"] == ["hot"] and rows[2]["quarantined"] and not rows[2]["verified"]
    assert "__0_0.distcp" in rows[2]["quarantine_reasons"][0]
    assert rows[4]["tiers"] == ["hot", "cold"]  # warm keeps 1: pruned there by step 6's lifecycle
    assert rows[6]["tiers"] == ["hot", "warm", "cold"]
    for s in (4, 6):
        assert rows[s]["stages"] == ["verified", "compressed", "promoted", "archived", "pruned"]
        assert rows[s]["verified"] and not rows[s]["quarantined"]
        assert rows[s]["stored_bytes"]["cold"] < rows[s]["raw_bytes"]  # zstd on cold
    assert rows[6]["latest"] == ["hot"]

    assert invoke(capsys, "pin", "tiny", "6", "--config", cfg).code == 0
    text = invoke(capsys, "ls", "--config", cfg)
    line6 = next(ln for ln in text.out.splitlines() if "hot,warm,cold" in ln)
    assert "verified" in line6 and "hot,warm,cold" in line6.split("verified")[-1]  # pinned on all three
    assert "QUARANTINED (integrity:" in text.out


@pytest.fixture
def cold_cfg(hot_copy, tmp_path, s3_endpoint, s3_bucket):
    from ckptflow.tasks.config import load_config
    from ckptflow.tasks.storage import Tier
    from ckptflow.tasks.transfer import archive

    cfg = write_config(tmp_path, hot_copy, s3_endpoint, s3_bucket)
    c = load_config(cfg)
    archive(Tier(c.hot), Tier(c.cold), "tiny", 6)
    return cfg


def test_drill_prints_the_result_table_and_plot_and_exits_1_on_failure(
    capsys, prefect_api, cold_cfg, tmp_path, s3_endpoint, s3_bucket
):
    hist, scratch = tmp_path / "drills", tmp_path / "scratch"
    args = ("--config", cold_cfg, "--history-dir", hist, "--scratch-dir", scratch)
    r = invoke(capsys, "drill", "tiny", "--step", "6", *args)
    assert r.code == 0, r.out + r.err
    assert "restore drill of tiny from cold" in r.out and "drill passed" in r.out
    assert "bitwise" in r.out and "1 -> 2" in r.out  # restored at another world size
    plot = next(ln for ln in r.out.splitlines() if ln.startswith("plot: ")).split("plot: ", 1)[1]
    assert plot.endswith(".png") and os.path.getsize(plot) > 10_000

    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    key = f"ckpt/tiny/{layout.step_name(6)}/__0_0.distcp.zst"
    body = bytearray(s3.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 1
    s3.put_object(Bucket=s3_bucket, Key=key, Body=bytes(body))
    r = invoke(capsys, "drill", "tiny", *args, "--json")
    assert r.code == 1, r.out + r.err
    doc = r.json()
    assert not doc["ok"] and [x["step"] for x in doc["results"]] == [6]
    assert not doc["results"][0]["ok"] and "__0_0.distcp.zst" in doc["results"][0]["failure"]
    assert len(open(hist / "tiny.jsonl").readlines()) == 2
    assert os.listdir(scratch) == []

    r = invoke(capsys, "drill", "tiny", "--step", "4", *args)  # step 4 was never archived
    assert r.code == 3 and r.err.count("\n") == 1 and "cold" in r.err and "s3://" in r.err


def test_alerts_setup_creates_the_automations_and_never_prints_the_token(capsys, prefect_api):
    from prefect.client.orchestration import get_client

    url = "http://127.0.0.1:9/hooks/T0/B0/XSECRETPATH?token=SECRET123"
    try:
        r = invoke(capsys, "alerts", "setup", url, "--stall-after", "600", "--json")
        assert r.code == 0, r.err
        assert "SECRET" not in r.out + r.err
        doc = json.loads(r.out)
        assert doc["webhook"] == "http://127.0.0.1/…" and len(doc["automations"]) == 6
        with get_client(sync_client=True) as c:
            names = {a.name for a in c.read_automations() if a.name.startswith("ckptflow: ")}
        assert {"ckptflow: restore drill failed", "ckptflow: trainer stalled"} <= names
        text = invoke(capsys, "alerts", "setup", url)  # repeatable: replaces, does not duplicate
        assert text.code == 0 and "SECRET" not in text.out + text.err and "checkpoint quarantined" in text.out
        with get_client(sync_client=True) as c:
            assert len([a for a in c.read_automations() if a.name.startswith("ckptflow: ")]) == 6
    finally:  # leave the shared server without automations that post to a dead port
        with get_client(sync_client=True) as c:
            for a in c.read_automations():
                if a.name.startswith("ckptflow: "):
                    c.delete_automation(a.id)


def test_serve_without_an_api_url_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    r = invoke(capsys, "serve", "--limit", "1")
    assert r.code == 2 and "PREFECT_API_URL" in r.err
    assert invoke(capsys, "serve", "--limit", "0").code == 2
