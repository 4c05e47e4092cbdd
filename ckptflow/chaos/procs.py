"""Launching the real processes a trial kills: training jobs and lifecycle workers.

Every command's output goes to a log file in the trial's folder (kept when the trial
fails), and every command has a timeout: a hang is a finding, not a stuck campaign.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from ckptflow.harness import PY, child_env, kill_group, reference_job
from ckptflow.trainer.reference.metrics import last_per_step, read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIGKILLED = -signal.SIGKILL


@dataclass(slots=True)
class Ran:
    rc: int | None
    """Exit status; negative = killed by that signal; None = timed out (then killed)."""
    seconds: float
    output: str
    log_path: str

    @property
    def killed(self) -> bool:
        """Died by SIGKILL: our fault fired (torchrun reports a worker's -9 in its summary)."""
        return self.rc == SIGKILLED or (self.rc not in (0, None) and "Signal 9 (SIGKILL)" in self.output)

    def summary(self) -> dict | None:
        """The reference job's ``ckptflow-summary`` line, if it printed one."""
        for line in reversed(self.output.splitlines()):
            if line.startswith("ckptflow-summary "):
                return json.loads(line[len("ckptflow-summary ") :])
        return None

    def tail(self, n: int = 1500) -> str:
        return self.output[-n:]


def base_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for trial processes: one thread, no stray faults, API or config."""
    return child_env(extra)


def run(
    cmd: list[str],
    *,
    env: dict[str, str],
    log_path: str,
    timeout: float,
    cwd: str = REPO,
    started: Callable[[subprocess.Popen], None] | None = None,
) -> Ran:
    """Run to completion (or timeout, then SIGKILL the whole process group). ``started`` is
    called with the process right after it starts (a trial's fault thread hooks in there)."""
    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        start_at = log.tell()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if started is not None:
            started(proc)
        try:
            rc: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
            kill_group(proc)
    seconds = time.monotonic() - t0
    with open(log_path, "rb") as f:
        f.seek(start_at)
        out = f.read().decode(errors="replace")
    return Ran(rc, seconds, out, log_path)


def train_cmd(
    root: str, run_id: str, *, nproc: int, max_steps: int, save_every: int, extra: list[str] | None = None
) -> list[str]:
    """The reference job (tiny model): a plain process at world size 1, torchrun above."""
    return reference_job(root, run_id, nproc=nproc, max_steps=max_steps, save_every=save_every, extra=extra)


def worker_cmd(*args: str) -> list[str]:
    return [PY, "-m", "ckptflow.chaos.worker", *args]


def metrics(run_path: str) -> dict[int, tuple[float, float]]:
    """Last (loss, lr) per step of the reference job's metrics (re-run steps overwrite)."""
    return {s: (r["loss"], r["lr"]) for s, r in last_per_step(read_metrics(run_path)).items()}
