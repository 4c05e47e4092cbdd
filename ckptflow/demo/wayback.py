"""The demo's last act: the hot tier is lost, and the same job comes back from cold by itself.

First the run goes on from hot for a few steps with the tiers off and no events (the reference: what
the run does next). Then the run's hot folder is wiped, as when a cluster is replaced, and its warm
folder is taken offline; the same command is started again with the config the CLI reads: its resume
finds nothing on hot or warm, brings the newest step back from cold (every byte checked), and trains
the same few steps, which must be bitwise the reference's.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from ckptflow.harness import torchrun
from ckptflow.trainer.reference.metrics import last_per_step, read_metrics

__all__ = ["WayBack", "way_back"]

_BROUGHT = re.compile(r"resumed from step (\d+) brought back from the (\w+) tier \((.*?)\): (\d+) files, (\d+) bytes")


@dataclass
class WayBack:
    ok: bool
    step: int | None = None
    tier: str | None = None
    bytes_fetched: int = 0
    seconds: float = 0.0
    """The job's wall time, start to exit (imports, the fetch, the load and the steps)."""
    steps: list[int] | None = None
    bitwise: bool = False
    problem: str = ""


def _job(root: str, run_id: str, steps: int, model: str, env: dict, log: str, *extra: str) -> int:
    args = ["--ckpt-root", root, "--run-id", run_id, "--max-steps", str(steps), "--save-every", str(steps)]
    cmd = torchrun("ckptflow.trainer.train", [*args, "--model", model, *extra], nproc=2)
    with open(log, "w") as f:
        # its own session: a job that outlives the timeout is stopped with its workers, not only torchrun
        p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return p.wait(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return -signal.SIGKILL


def way_back(
    *,
    root: str,
    warm: str,
    run_id: str,
    last: int,
    more: int,
    model: str,
    env: dict,
    log_dir: str,
    say: Callable[[str], None] = print,
) -> WayBack:
    """``last``: the run's newest step (on cold by now); ``more``: the steps trained after it, twice."""
    run = os.path.join(root, run_id)
    quiet = {k: v for k, v in env.items() if k not in ("PREFECT_API_URL", "CKPTFLOW_CONFIG")}
    ref_log, back_log = os.path.join(log_dir, "way-back-reference.log"), os.path.join(log_dir, "way-back.log")
    if _job(root, run_id, last + more, model, quiet, ref_log, "--tiers", "none") != 0:
        return WayBack(False, problem=f"the reference continuation failed; log: {ref_log}")
    rows = last_per_step(read_metrics(run))
    want = {s: (rows[s]["loss"], rows[s]["lr"]) for s in range(last + 1, last + more + 1) if s in rows}
    # Warm is taken offline (moved out of the tier, and back after: its exports are the demo's output)
    offline = os.path.join(os.path.dirname(os.path.abspath(warm)), f"warm-offline-{run_id}")
    try:
        os.rename(os.path.join(warm, run_id), offline)
    except OSError as e:
        return WayBack(False, problem=f"could not take warm offline ({e}); hot left as it was")
    shutil.rmtree(run)
    say(f"the way back: {run} wiped and warm offline; the same job started again ...")
    t0 = time.monotonic()
    try:
        # The config as the CLI reads it ($CKPTFLOW_CONFIG); no events: the demo's lifecycles are over
        quiet_api = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
        rc = _job(root, run_id, last + more, model, quiet_api, back_log)
    finally:
        try:
            os.rename(offline, os.path.join(warm, run_id))
        except OSError as e:
            say(f"could not put warm back ({e}); it is at {offline}")
    took = time.monotonic() - t0
    with open(back_log) as f:
        found = _BROUGHT.search(f.read())
    if rc != 0 or found is None:
        return WayBack(False, problem=f"the job did not come back from the tiers (exit {rc}); log: {back_log}")
    rows = last_per_step(read_metrics(run))
    got = {s: (r["loss"], r["lr"]) for s, r in rows.items()}
    out = WayBack(True, int(found[1]), found[2], int(found[5]), took, sorted(got), got == want)
    if not out.bitwise:
        out.ok, out.problem = False, f"steps after the way back differ from the run before: {got} vs {want}"
    return out
