"""Shared fixtures: real servers, started once per session.

* ``s3_endpoint``: moto's S3-compatible server in its own process on 127.0.0.1,
  spoken to over HTTP exactly like a real object store.
* ``prefect_api``: one Prefect test harness (a real API server with SQLite) per
  session; it takes 20-30 s to start, so never per test.
* ``run_torchrun``: launches real ``torchrun`` jobs (gloo, CPU) and returns the result.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


@pytest.fixture(scope="session")
def s3_endpoint():
    """URL of a moto S3 server process; credentials are set in the environment."""
    port = free_port()
    proc = subprocess.Popen([PY, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_port(port)
        old = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
        os.environ.update(AWS_ACCESS_KEY_ID="testing-key-id", AWS_SECRET_ACCESS_KEY="testing-secret-key",
                          AWS_DEFAULT_REGION="us-east-1")
        yield f"http://127.0.0.1:{port}"
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh, empty bucket per test."""
    import boto3

    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def prefect_api():
    """A real Prefect API (test harness) for the whole session; yields its URL."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        from prefect.settings import PREFECT_API_URL

        yield PREFECT_API_URL.value()


def torchrun_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("PREFECT_API_URL", None)
    env.pop("CKPTFLOW_FAULT", None)
    if extra:
        env.update(extra)
    return env


def run_torchrun(args: list[str], *, nproc: int = 2, max_restarts: int = 0, env: dict | None = None,
                 module: str = "ckptflow.trainer.train", timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", "--monitor-interval=0.5", "-m", module, *args]
    return subprocess.run(cmd, cwd=REPO, env=torchrun_env(env), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def torchrun():
    return run_torchrun


def make_run(root: str, run_id: str = "r1", *, max_steps: int = 6, save_every: int = 2,
             nproc: int = 1, extra_args: list[str] | None = None, env: dict | None = None) -> str:
    """Train the tiny reference model and commit checkpoints; returns the run dir.

    ``nproc=1`` runs a plain process (no torchrun, ~5 s); more launches torchrun.
    """
    args = ["--ckpt-root", str(root), "--run-id", run_id, "--max-steps", str(max_steps),
            "--save-every", str(save_every), "--model", "tiny", *(extra_args or [])]
    if nproc == 1:
        r = subprocess.run([PY, "-m", "ckptflow.trainer.train", "--parallel", "none", *args], cwd=REPO,
                           env=torchrun_env(env), capture_output=True, text=True, timeout=300)
    else:
        r = run_torchrun(args, nproc=nproc, env=env)
    if r.returncode != 0:
        raise AssertionError(f"training failed (rc={r.returncode}):\n{r.stderr[-4000:]}")
    return os.path.join(str(root), run_id)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A read-only committed run (steps 2, 4, 6) of the tiny model. Copy it before changing it."""
    return make_run(tmp_path_factory.mktemp("tiny_run"), "tiny", max_steps=6, save_every=2)
