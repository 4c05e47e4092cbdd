"""Launching the real processes a trial kills: training jobs and lifecycle workers.

Every command's output goes to a log file in the trial's folder (kept when the trial
fails), and every command has a timeout: a hang is a finding, not a stuck campaign.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from ckptflow.trainer import layout

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
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
                return json.loads(line[len("ckptflow-summary "):])
        return None

    def tail(self, n: int = 1500) -> str:
        return self.output[-n:]


def base_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for trial processes: this repo importable, one thread, no stray faults."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    for k in ("CKPTFLOW_FAULT", "PREFECT_API_URL", "PREFECT_API_KEY", "CKPTFLOW_CONFIG"):
        env.pop(k, None)
    env.update(extra or {})
    return env


def run(cmd: list[str], *, env: dict[str, str], log_path: str, timeout: float, cwd: str = REPO,
        started: Callable[[subprocess.Popen], None] | None = None) -> Ran:
    """Run to completion (or timeout, then SIGKILL the whole process group). ``started`` is
    called with the process right after it starts (a trial's fault thread hooks in there)."""
    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        start_at = log.tell()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        if started is not None:
            started(proc)
        try:
            rc: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
            _kill_group(proc)
    seconds = time.monotonic() - t0
    with open(log_path, "rb") as f:
        f.seek(start_at)
        out = f.read().decode(errors="replace")
    return Ran(rc, seconds, out, log_path)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)


def train_cmd(root: str, run_id: str, *, nproc: int, max_steps: int, save_every: int,
              extra: list[str] | None = None) -> list[str]:
    """The reference job (tiny model): a plain process at world size 1, torchrun above."""
    args = ["--ckpt-root", root, "--run-id", run_id, "--max-steps", str(max_steps),
            "--save-every", str(save_every), "--model", "tiny", *(extra or [])]
    if nproc == 1:
        return [PY, "-m", "ckptflow.trainer.train", "--parallel", "none", *args]
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "--max-restarts=0", "--monitor-interval=0.5", "-m", "ckptflow.trainer.train", *args]


def worker_cmd(*args: str) -> list[str]:
    return [PY, "-m", "ckptflow.chaos.worker", *args]


def metrics(run_path: str) -> dict[int, tuple[float, float]]:
    """Last (loss, lr) per step of the reference job's metrics.jsonl (re-run steps overwrite)."""
    out: dict[int, tuple[float, float]] = {}
    try:
        with open(os.path.join(run_path, layout.METRICS)) as f:
            for line in f:
                try:
                    d = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line torn by the kill
                out[int(d["step"])] = (d["loss"], d["lr"])
    except FileNotFoundError:
        pass
    return out
