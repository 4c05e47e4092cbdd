"""The demo's training job: 2-rank torchrun with checkpoints, one worker SIGKILLed mid-run."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field

from ckptflow.harness import Supervisor, children_of, cmdline, torchrun
from ckptflow.trainer.reference.metrics import read_metrics


@dataclass
class TrainOutcome:
    run_dir: str
    returncode: int
    killed_pid: int | None = None
    killed_at_step: int | None = None
    resumed_from: int | None = None
    steps: int = 0
    attempts: int = 1
    seconds: float = 0.0
    log_path: str = ""
    losses: list = field(default_factory=list)


def _worker_pids(agent_pid: int) -> list[int]:
    return [p for p in children_of(agent_pid) if "ckptflow.trainer.train" in cmdline(p)]


def run_training(
    sup: Supervisor,
    *,
    root: str,
    run_id: str,
    steps: int,
    save_every: int,
    model: str,
    nproc: int = 2,
    kill_at: int | None = None,
    env: dict | None = None,
    log_dir: str,
    say=print,
) -> TrainOutcome:
    """Run the reference job under torchrun (--max-restarts=1); SIGKILL one worker at ``kill_at``."""
    run_dir = os.path.join(root, run_id)
    log_path = os.path.join(log_dir, f"train-{run_id}.log")
    args = torchrun(
        "ckptflow.trainer.train",
        [
            "--ckpt-root",
            root,
            "--run-id",
            run_id,
            "--max-steps",
            str(steps),
            "--save-every",
            str(save_every),
            "--model",
            model,
        ],
        nproc=nproc,
        max_restarts=1,
    )
    out = TrainOutcome(run_dir, -1, log_path=log_path)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        p = sup.start("torchrun", args, env=env, log=log)
        while p.poll() is None:
            rows = read_metrics(run_dir)
            if kill_at is not None and out.killed_pid is None and rows and rows[-1]["step"] >= kill_at:
                workers = _worker_pids(p.pid)
                if workers:
                    out.killed_pid, out.killed_at_step = workers[-1], rows[-1]["step"]
                    os.kill(out.killed_pid, signal.SIGKILL)
                    say(f"  killed worker pid {out.killed_pid} with SIGKILL after step {out.killed_at_step}")
            time.sleep(0.2)
    out.returncode = p.returncode
    out.seconds = time.monotonic() - t0
    rows = read_metrics(run_dir)
    out.steps = max((r["step"] for r in rows), default=0)
    out.attempts = len({r.get("attempt", 0) for r in rows})
    first_retry = [r["step"] for r in rows if r.get("attempt", 0) > 0]
    out.resumed_from = (first_retry[0] - 1) if first_retry else None
    out.losses = [(r["step"], r["loss"], r.get("attempt", 0)) for r in rows]
    return out
