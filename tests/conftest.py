"""Shared fixtures: real servers, started once per session.

* ``s3_endpoint``: moto's S3-compatible server in its own process on 127.0.0.1,
  spoken to over HTTP exactly like a real object store.
* ``prefect_api``: one Prefect test harness (a real API server with SQLite) per
  session; it takes 20-30 s to start, so never per test.
* ``torchrun``: launches real ``torchrun`` jobs (gloo, CPU) and returns the result.
* ``tiny_run``: a committed run of the tiny reference model (read-only).
"""

from __future__ import annotations

import os
import uuid

import pytest

from ckptflow.harness import MotoServer
from tests.helpers import make_run, run_torchrun


@pytest.fixture(scope="session")
def s3_endpoint():
    """URL of a moto S3 server process; credentials are set in the environment."""
    with MotoServer() as srv:
        old = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
        os.environ.update(
            AWS_ACCESS_KEY_ID="testing-key-id",
            AWS_SECRET_ACCESS_KEY="testing-secret-key",
            AWS_DEFAULT_REGION="us-east-1",
        )
        yield srv.url
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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


@pytest.fixture
def torchrun():
    return run_torchrun


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A read-only committed run (steps 2, 4, 6) of the tiny model. Copy it before changing it."""
    return make_run(tmp_path_factory.mktemp("tiny_run"), "tiny", max_steps=6, save_every=2)


@pytest.fixture
def wide_tables(monkeypatch):
    """CLI tables on one line each, whatever the terminal."""
    monkeypatch.setenv("COLUMNS", "250")
