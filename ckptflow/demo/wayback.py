"""The demo's last act: the hot tier is lost, and the same job comes back from cold by itself.

First the run goes on from hot for a few steps with the tiers off and no events (the reference: what
the run does next). Then the run's hot folder is wiped (on node-local roots, every node's disk), as
when a cluster is replaced, and its warm folder is taken offline; the same command is started again
with the config the CLI reads: its resume finds nothing on hot or warm, brings the newest step back
from cold (every byte checked; on node-local roots each node what its ranks read), and trains the
same few steps, which must be bitwise the reference's.
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

__all__ = ["WayBack", "torchrun_job", "way_back"]

# The trainer's line, one shared root or node-local roots
_BROUGHT = re.compile(
    r"resumed from step (\d+)(?: on \d+ nodes,)? brought back from the (\w+) tier \((.*?)\): (\d+) files, (\d+) bytes"
)

Job = Callable[[int, list[str], dict, str], tuple[int, str]]
"""Runs the demo's training job to a step with extra flags, an environment and a log name (under the demo's
logs); returns its exit code and its output."""


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
    node_parts: dict[str, list[int]] | None = None
    """On node-local roots: per node, [files, bytes] it brought back (what its ranks read)."""


def torchrun_job(root: str, run_id: str, model: str, log_dir: str) -> Job:
    """The single-root demo's job: 2 ranks under torchrun, a checkpoint at its last step only."""

    def job(steps: int, extra: list[str], env: dict, log_name: str) -> tuple[int, str]:
        args = ["--ckpt-root", root, "--run-id", run_id, "--max-steps", str(steps), "--save-every", str(steps)]
        cmd = torchrun("ckptflow.trainer.train", [*args, "--model", model, *extra], nproc=2)
        log = os.path.join(log_dir, log_name)
        with open(log, "w") as f:
            # its own session: a job that outlives the timeout is stopped with its workers, not only torchrun
            p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = p.wait(timeout=600)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                rc = -signal.SIGKILL
        with open(log) as f:
            return rc, f.read()

    return job


def _rows(runs: list[str]) -> dict[int, dict]:
    """The last row of each step across the runs' folders (on node-local roots, whichever held rank 0)."""
    return last_per_step(sorted((r for run in runs for r in read_metrics(run)), key=lambda r: r["wall"]))


def way_back(
    *,
    runs: list[str],
    wipe: list[str],
    warm: str,
    run_id: str,
    last: int,
    more: int,
    job: Job,
    env: dict,
    say: Callable[[str], None] = print,
) -> WayBack:
    """``last``: the run's newest step (on cold by now); ``more``: the steps trained after it, twice. ``runs``: the
    run's hot folders (one per node); ``wipe``: the folders emptied, as a replaced disk is."""
    quiet = {k: v for k, v in env.items() if k not in ("PREFECT_API_URL", "CKPTFLOW_CONFIG")}
    rc, _ = job(last + more, ["--tiers", "none"], quiet, "way-back-reference.log")
    if rc != 0:
        return WayBack(False, problem="the reference continuation failed; see way-back-reference in the logs")
    rows = _rows(runs)
    want = {s: (rows[s]["loss"], rows[s]["lr"]) for s in range(last + 1, last + more + 1) if s in rows}
    # Warm is taken offline (moved out of the tier, and back after: its exports are the demo's output)
    offline = os.path.join(os.path.dirname(os.path.abspath(warm)), f"warm-offline-{run_id}")
    try:
        os.rename(os.path.join(warm, run_id), offline)
    except OSError as e:
        return WayBack(False, problem=f"could not take warm offline ({e}); hot left as it was")
    try:
        for folder in wipe:
            shutil.rmtree(folder)
            os.makedirs(folder)
        say(f"the way back: {', '.join(wipe)} wiped and warm offline; the same job started again ...")
        t0 = time.monotonic()
        # The config as the CLI reads it ($CKPTFLOW_CONFIG); no events: the demo's lifecycles are over
        rc, text = job(last + more, [], {k: v for k, v in env.items() if k != "PREFECT_API_URL"}, "way-back.log")
    finally:
        try:
            os.rename(offline, os.path.join(warm, run_id))
        except OSError as e:
            say(f"could not put warm back ({e}); it is at {offline}")
    took = time.monotonic() - t0
    found = _BROUGHT.search(text)
    if rc != 0 or found is None:
        return WayBack(False, problem=f"the job did not come back from the tiers (exit {rc}); see way-back in the logs")
    got = {s: (r["loss"], r["lr"]) for s, r in _rows(runs).items()}
    out = WayBack(True, int(found[1]), found[2], int(found[5]), took, sorted(got), got == want)
    line = text[found.start() : text.find("\n", found.start())]
    parts = re.findall(r"node (\S+) (\d+) files, (\d+) bytes", line)
    if parts:
        out.node_parts = {n: [int(f), int(b)] for n, f, b in parts}
    if not out.bitwise:
        out.ok, out.problem = False, f"steps after the way back differ from the run before: {got} vs {want}"
    return out
