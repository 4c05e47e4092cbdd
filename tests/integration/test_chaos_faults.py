"""``ckptflow chaos`` end to end (a small campaign across every fault kind), its verdict and
exit code, and the fault proxy on its own against moto.

The campaign runs the real CLI in a subprocess: it starts its own moto server and Prefect
server, so it shares nothing with the session fixtures. Seed 3 draws, for five trials:
a SIGKILL of the trainer at a step, an S3 trial at 20 % faults, a flaky Prefect API
under a reconcile flow, a full disk with on_save_error=raise, and a commit marker whose
objects are gone on the cold tier. The 100+ trial campaign and its figures are in
docs/reliability.md. The bugs the campaign found have a test each here, which failed
before the fix.
"""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import subprocess
import time
import urllib.parse

import pytest

from ckptflow.chaos.s3proxy import FaultProxy
from ckptflow.tasks.config import TierConfig
from ckptflow.tasks.storage import Tier
from ckptflow.trainer.errors import CheckpointNotFoundError, CkptflowError
from ckptflow.trainer.format import layout
from tests.helpers import PY, REPO, torchrun_env

# ---- the proxy on its own -------------------------------------------------------------------


def _request(url: str, method: str = "GET", path: str = "/") -> tuple[int, bytes]:
    u = urllib.parse.urlsplit(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    try:
        c.request(method, path)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def test_the_proxy_forwards_and_breaks_requests_as_told(s3_endpoint, s3_bucket):
    with FaultProxy(s3_endpoint, share=0.0) as px:
        assert _request(px.url, path=f"/{s3_bucket}")[0] == 200
        px.set_faults(share=1.0, modes=("503",))
        status, body = _request(px.url, path=f"/{s3_bucket}")
        assert status == 503 and b"<Code>SlowDown</Code>" in body
        px.set_faults(modes=("500",))
        assert _request(px.url, path=f"/{s3_bucket}")[0] == 500
        px.set_faults(modes=("reset",))
        with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
            _request(px.url, path=f"/{s3_bucket}")
        px.set_faults(modes=("stall",), stall_s=(0.5, 0.5))
        t0 = time.monotonic()
        assert _request(px.url, path=f"/{s3_bucket}")[0] == 200 and time.monotonic() - t0 >= 0.5
        px.set_faults(modes=("reset_after",))
        import boto3
        from botocore.config import Config

        once = boto3.client("s3", endpoint_url=px.url, config=Config(retries={"total_max_attempts": 1}))
        with pytest.raises(Exception):  # noqa: B017 - botocore's connection error types vary
            once.put_object(Bucket=s3_bucket, Key="took-effect", Body=b"x")
        head = boto3.client("s3", endpoint_url=s3_endpoint).head_object(Bucket=s3_bucket, Key="took-effect")
        assert head["ContentLength"] == 1  # the request reached the store; only the answer was lost
        assert dict(px.stats.faults) == {"503": 1, "500": 1, "reset": 1, "stall": 1, "reset_after": 1}


@pytest.fixture
def hot(tiny_run, tmp_path) -> Tier:
    shutil.copytree(tiny_run, tmp_path / "hot" / "tiny")
    return Tier(TierConfig(name="hot", url=str(tmp_path / "hot")))


def test_an_archive_through_a_total_outage_fails_cleanly_and_commits_nothing(hot, s3_endpoint, s3_bucket):
    from ckptflow.tasks.transfer import archive

    with FaultProxy(s3_endpoint, share=1.0, modes=("503", "500")) as px:
        cold = Tier(TierConfig(name="cold", url=f"s3://{s3_bucket}/c", codec="zstd", endpoint_url=px.url))
        with pytest.raises(CkptflowError) as ei:
            archive(hot, cold, "tiny", 6)
        assert f"s3://{s3_bucket}/c/tiny/{layout.step_name(6)}" in str(ei.value)
        px.set_faults(share=0.0)
        assert cold.committed_steps("tiny") == []
        assert archive(hot, cold, "tiny", 6).files == 2  # the network heals: the re-run completes


def test_a_restore_whose_downloads_keep_failing_falls_back_cleanly(hot, s3_endpoint, s3_bucket, tmp_path):
    from ckptflow.tasks.transfer import archive, restore

    direct = Tier(TierConfig(name="cold", url=f"s3://{s3_bucket}/c", codec="zstd", endpoint_url=s3_endpoint))
    archive(hot, direct, "tiny", 6)
    with FaultProxy(s3_endpoint, share=1.0, modes=("reset",), paths=r"\.distcp") as px:
        cold = Tier(TierConfig(name="cold", url=f"s3://{s3_bucket}/c", codec="zstd", endpoint_url=px.url))
        with pytest.raises(CheckpointNotFoundError):
            restore([cold], "tiny", str(tmp_path / "out"))


def test_an_unreachable_store_is_a_clean_storage_error(hot, s3_bucket):
    from ckptflow.tasks.transfer import archive
    from tests.helpers import free_port

    cold = Tier(TierConfig(name="cold", url=f"s3://{s3_bucket}/c", endpoint_url=f"http://127.0.0.1:{free_port()}"))
    with pytest.raises(CkptflowError):
        archive(hot, cold, "tiny", 6)


def test_reconcile_finishes_a_lifecycle_whose_process_was_killed(prefect_api, tiny_run, tmp_path):
    """The campaign's flow-kill mode found this: the server keeps showing the dead run RUNNING,
    and reconcile used to leave its step alone forever."""
    hot = tmp_path / "hot"
    shutil.copytree(tiny_run, hot / "tiny")
    cfg = tmp_path / "ckptflow.toml"
    cfg.write_text(
        f'[hot]\nurl = "{hot}"\n[hot.retention]\nkeep_last = 5\n[warm]\nurl = "{tmp_path / "warm"}"\n'
        'codec = "zstd"\n[lifecycle]\nsanity_step = false\n'
    )
    env = dict(torchrun_env(), PREFECT_API_URL=prefect_api)
    cmd = [PY, "-m", "ckptflow.chaos.worker", "reconcile", "--config", str(cfg)]
    p = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    rec = hot / "tiny" / layout.LIFECYCLE_DIR / layout.step_name(4) / "verified.json"
    deadline = time.monotonic() + 240
    while not rec.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(p.pid, signal.SIGKILL)  # the worker node dies mid-lifecycle
    p.wait()
    for _ in range(2):
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (hot / "tiny" / layout.LIFECYCLE_DIR / layout.step_name(4) / "pruned.json").exists()


def test_one_failing_lifecycle_does_not_hold_back_reconcile(prefect_api, tiny_run, tmp_path):
    """Run "other" cannot be promoted (its warm run dir is a file, so every promote fails
    past its retries); reconcile reaches it first (runs are sorted) and must still finish
    run "tiny", then leave "other" for the next pass."""
    hot, warm = tmp_path / "hot", tmp_path / "warm"
    shutil.copytree(tiny_run, hot / "tiny")
    os.makedirs(hot / "other")
    shutil.copytree(os.path.join(tiny_run, layout.step_name(2)), hot / "other" / layout.step_name(2))
    man = hot / "other" / layout.step_name(2) / layout.MANIFEST
    man.write_text(man.read_text().replace('"run_id": "tiny"', '"run_id": "other"'))  # unsigned: fine
    os.makedirs(warm)
    (warm / "other").write_text("not a directory")
    cfg = tmp_path / "ckptflow.toml"
    cfg.write_text(
        f'[hot]\nurl = "{hot}"\n[hot.retention]\nkeep_last = 5\n[warm]\nurl = "{warm}"\n'
        "[lifecycle]\nsanity_step = false\n"
    )
    env = dict(torchrun_env(), PREFECT_API_URL=prefect_api)
    r = subprocess.run(
        [PY, "-m", "ckptflow.chaos.worker", "reconcile", "--config", str(cfg)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for step in (2, 4, 6):
        assert (hot / "tiny" / layout.LIFECYCLE_DIR / layout.step_name(step) / "pruned.json").exists()
    other = hot / "other" / layout.LIFECYCLE_DIR / layout.step_name(2)
    assert (other / "verified.json").exists() and not (other / "promoted.json").exists()
    assert "the next reconcile retries it" in r.stdout + r.stderr


def test_a_save_on_a_full_disk_says_the_disk_is_full(tmp_path, monkeypatch):
    from ckptflow.trainer.saver import disk_full_hint

    run = str(tmp_path / "run")
    assert disk_full_hint(run, 1 << 20) == ""  # this machine's tmp has room
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=4096))
    hint = disk_full_hint(run, 1 << 20)
    assert "the disk is full" in hint and run in hint and "4096 bytes free" in hint
