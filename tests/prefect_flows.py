"""Small flows for tests that need a real deployment run by a real worker (imported by module path)."""

from __future__ import annotations

import json
import os
import time

from prefect import flow, get_run_logger


@flow(name="ckptflow-test-whoami")
def whoami(out: str, fail: bool = False, sleep_s: float = 0.0) -> int:
    """Write this flow run's process ids to ``out``, log a line, then sleep or fail if asked."""
    get_run_logger().info("whoami: flow run in pid %d", os.getpid())
    with open(out + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd()}, f)
    os.replace(out + ".tmp", out)
    if sleep_s:
        time.sleep(sleep_s)
    if fail:
        raise RuntimeError("whoami was asked to fail")
    return os.getpid()
