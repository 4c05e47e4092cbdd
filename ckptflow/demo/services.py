"""The demo's local services: a Prefect server (SQLite) and an S3-compatible server.

Both are real servers on 127.0.0.1, started as child processes in their own session
and stopped by PID (``Supervisor``). Prefect keeps its database under the demo's
folder (``PREFECT_HOME``), so nothing outside the project is touched.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import urllib.request

from ckptflow.demo.procs import Supervisor

DEMO_AWS = {"AWS_ACCESS_KEY_ID": "ckptflow-demo", "AWS_SECRET_ACCESS_KEY": "ckptflow-demo-secret",
            "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, what: str, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:  # noqa: S310 - local URL
                if r.status < 500:
                    return
        except Exception:
            time.sleep(0.3)
    raise TimeoutError(f"{what} did not answer at {url} within {timeout:.0f} s")


def start_s3(sup: Supervisor, log_dir: str) -> tuple[str, object]:
    port = free_port()
    p = sup.start("s3", [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                  log=open(os.path.join(log_dir, "s3.log"), "w"))
    return f"http://127.0.0.1:{port}", p


def start_prefect(sup: Supervisor, home: str, log_dir: str) -> tuple[str, object]:
    port = free_port()
    env = dict(os.environ, PREFECT_HOME=home, PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_UI_ENABLED="false", PREFECT_API_URL=f"http://127.0.0.1:{port}/api")
    p = sup.start("prefect", [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                              "--port", str(port)], env=env, log=open(os.path.join(log_dir, "prefect.log"), "w"))
    return f"http://127.0.0.1:{port}/api", p


def make_bucket(endpoint: str, bucket: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=endpoint, **{k.lower(): v for k, v in DEMO_AWS.items()
                                                  if k != "AWS_DEFAULT_REGION"},
                 region_name=DEMO_AWS["AWS_DEFAULT_REGION"]).create_bucket(Bucket=bucket)


def demo_config(path: str, *, workdir: str, s3_endpoint: str, bucket: str) -> str:
    """The demo's ckptflow.toml: three tiers, with the cold one on the local S3 server."""
    text = f"""# Written by `ckptflow demo`. Every field is explained in deployments/ckptflow.example.toml.
[hot]
url = "{workdir}/hot"
[hot.retention]
keep_last = 3

[warm]
url = "{workdir}/warm"
codec = "bytegroup"
[warm.retention]
keep_last = 4

[cold]
url = "s3://{bucket}/ckptflow"
codec = "bytegroup"
endpoint_url = "{s3_endpoint}"
storage_class = "STANDARD_IA"
[cold.retention]
keep_last = 10

[prefect]
flow_concurrency = 2
"""
    with open(path, "w") as f:
        f.write(text)
    return path
