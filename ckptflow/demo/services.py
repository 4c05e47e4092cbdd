"""The demo's local services: a Prefect server (SQLite) and an S3-compatible server.

Both are real servers on 127.0.0.1 from the shared harness (``ckptflow.harness``), in
their own sessions and stopped by PID. Prefect keeps its database under the demo's folder
(``PREFECT_HOME``), so nothing outside the project is touched.
"""

from __future__ import annotations

import os
from contextlib import ExitStack

from ckptflow.harness import LOCAL_AWS, MotoServer, PrefectServer


def start_services(stack: ExitStack, workdir: str, log_dir: str, bucket: str) -> tuple[str, str]:
    """Start Prefect (in the background: it takes 20-30 s) and moto, make the bucket; returns
    (Prefect API URL, S3 endpoint). Both stop when ``stack`` closes."""
    prefect = stack.enter_context(
        PrefectServer(os.path.join(workdir, "prefect"), os.path.join(log_dir, "prefect.log"), start=False)
    )
    prefect.launch()
    s3 = stack.enter_context(MotoServer(os.path.join(log_dir, "s3.log")))
    os.environ.update(LOCAL_AWS)
    s3.make_bucket(bucket)
    prefect.wait_ready()
    return prefect.url, s3.url


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

[export]
when = "every"
cold = true

[prefect]
flow_concurrency = 2
"""
    with open(path, "w") as f:
        f.write(text)
    return path
