"""A real run with failures, and the replay of the same failures: is ``ckptflow goodput`` right?

:func:`run_with_failures` runs the reference job under torchrun (``--max-restarts``, gloo) and
SIGKILLs one of its workers at exponentially distributed times (an MTBF scaled down to seconds),
as a lost GPU does; torchrun restarts every worker and the job resumes from its newest committed
checkpoint. Time zero is the start of the first attempt's training loop (what a replay calls
zero: process start-up before it is not part of any interval); the end is the commit of the
final checkpoint (the job's last act, which ``close()`` waits for).

:func:`check` measures the run's effective training time from its own files (every step of the
job, at the run's median step time, over the wall time from zero to the end), writes the kill
times as a trace, and asks ``ckptflow goodput --from-run RUN --trace KILLS --work-steps N`` what
it predicts for the run's own measured costs and the same failure times.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ckptflow.harness import PY, child_env, children_of, cmdline, kill_tree, reference_job
from ckptflow.trainer.events import read_outbox
from ckptflow.trainer.format import layout
from ckptflow.trainer.reference.metrics import read_metrics


@dataclass(slots=True)
class FailedRun:
    run_path: str
    interval: int
    max_steps: int
    kills_s: list[float]
    """When each SIGKILL landed, seconds after time zero (only those before the end)."""
    t0_wall: float
    end_wall: float
    attempts: int
    returncode: int
    log: str

    @property
    def wall_s(self) -> float:
        return self.end_wall - self.t0_wall


@dataclass(slots=True)
class Check:
    real: float
    predicted: float
    run: dict[str, Any]
    costs: dict[str, Any]
    predicted_parts: dict[str, float]
    kills: int
    notes: list[str] = field(default_factory=list)

    @property
    def diff_points(self) -> float:
        return 100.0 * (self.predicted - self.real)

    def to_json(self) -> dict[str, Any]:
        return dict(asdict(self), diff_points=self.diff_points)


def _first_row(run_path: str, timeout: float, proc: subprocess.Popen) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = read_metrics(run_path)
        if rows:
            return rows[0]
        if proc.poll() is not None:
            raise RuntimeError(f"the job exited ({proc.returncode}) before its first step; see its log")
        time.sleep(0.05)
    raise TimeoutError(f"no first step in {run_path} after {timeout:.0f} s")


def _workers(agent: int) -> list[int]:
    return [p for p in children_of(agent) if "ckptflow.trainer.train" in cmdline(p)]


def _mid_interval(run_path: str, interval: int, since_wall: float) -> bool:
    """Whether the job's newest step came after ``since_wall`` (so from the attempt now running)
    and sits 35-65 % of the way through a save interval."""
    rows = read_metrics(run_path)
    if not rows or not isinstance(rows[-1].get("wall"), (int, float)) or rows[-1]["wall"] <= since_wall:
        return False
    return 0.35 <= (rows[-1]["step"] % interval) / interval <= 0.65


def _final_commit(run_path: str, step: int) -> float | None:
    for rec in read_outbox(run_path):
        if rec.get("step") == step and isinstance(rec.get("committed_at"), (int, float)):
            return float(rec["committed_at"])
    return None


def run_with_failures(
    workdir: str,
    *,
    mtbf_s: float,
    max_steps: int,
    interval: int,
    seed: int = 0,
    nproc: int = 2,
    model: str = "tiny",
    step_sleep: float = 0.05,
    run_id: str = "goodput",
    timeout_s: float = 1800.0,
    mid_interval: bool = False,
) -> FailedRun:
    """Run the job to ``max_steps``, killing a worker at seeded exponential times.

    ``mid_interval``: hold each due kill until the job is in the middle of a save interval (its
    newest step, of the current attempt, 35-65 % of the way to the next save). A kill within a
    step or two of a commit is a coin flip for the run and the replay alike: which side of the
    commit it lands on decides whether a whole interval is lost, and the replay's clock drifts
    from the run's by a restart's jitter (about 0.5 s here). In a short check with three kills
    one such flip is 4 points, so the check holds kills where both agree on what is durable;
    the replay is still given the real kill times. A long benchmark leaves this off."""
    root = os.path.join(workdir, "hot")
    run_path = layout.run_dir(root, run_id)
    cmd = reference_job(
        root,
        run_id,
        max_steps=max_steps,
        save_every=interval,
        nproc=nproc,
        model=model,
        max_restarts=1000,
        extra=["--step-sleep", str(step_sleep), "--schedule-steps", str(max_steps)],
    )
    rng = random.Random(seed)
    log_path = os.path.join(workdir, "job.log")
    os.makedirs(workdir, exist_ok=True)
    kills: list[float] = []
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            first = _first_row(run_path, 300, proc)
            t0 = float(first["wall"]) - float(first["t"])
            deadline = time.monotonic() + timeout_s
            due = t0 + rng.expovariate(1.0 / mtbf_s)
            while proc.poll() is None and time.monotonic() < deadline:
                if _final_commit(run_path, max_steps) is not None:
                    break
                if time.time() < due:
                    time.sleep(min(0.02, max(0.0, due - time.time())))
                    continue
                if mid_interval and not _mid_interval(run_path, interval, t0 + (kills[-1] if kills else 0.0)):
                    time.sleep(0.01)
                    continue
                ws = _workers(proc.pid)
                if not ws:  # between attempts: the failure lands on the next worker that starts
                    time.sleep(0.01)
                    continue
                try:
                    os.kill(rng.choice(ws), signal.SIGKILL)
                except ProcessLookupError:
                    continue
                kills.append(time.time() - t0)
                due = time.time() + rng.expovariate(1.0 / mtbf_s)
            rc = proc.wait(max(1.0, deadline - time.monotonic()))
        except BaseException:
            kill_tree(proc)
            raise
    end = _final_commit(run_path, max_steps)
    if rc != 0 or end is None:
        raise RuntimeError(f"the job did not finish (exit {rc}, final commit {end}); see {log_path}")
    rows = read_metrics(run_path)
    attempts = len({r.get("attempt", 0) for r in rows})
    return FailedRun(
        run_path=run_path,
        interval=interval,
        max_steps=max_steps,
        kills_s=[k for k in kills if k < end - t0],
        t0_wall=t0,
        end_wall=end,
        attempts=attempts,
        returncode=rc,
        log=log_path,
    )


def real_effective(run: FailedRun) -> tuple[float, float]:
    """(effective, step seconds): every step of the job at the run's mean step time (the one the
    replay is given: ``tasks.goodput.step_and_stall``), over zero -> final commit."""
    from ckptflow.tasks.goodput import step_and_stall

    step_s, _ = step_and_stall(run.run_path)
    if step_s is None:
        raise RuntimeError(f"{run.run_path}: no step time measurable from metrics.jsonl")
    return run.max_steps * step_s / run.wall_s, step_s


def check(run: FailedRun, workdir: str) -> Check:
    """The run's real effective time against ``ckptflow goodput``'s replay of the same failures."""
    real, step_s = real_effective(run)
    trace = os.path.join(workdir, "kills.txt")
    with open(trace, "w", encoding="utf-8") as f:
        f.write(f"# SIGKILLs of one worker, seconds after the first training step\n# span_s: {run.wall_s:.3f}\n")
        f.writelines(f"{k:.3f} sigkill\n" for k in run.kills_s)
    empty = os.path.join(workdir, "no-drills")
    os.makedirs(empty, exist_ok=True)
    cmd = [
        PY,
        "-m",
        "ckptflow.cli.main",
        "goodput",
        "--from-run",
        run.run_path,
        "--history-dir",
        empty,
        "--trace",
        trace,
        "--interval-steps",
        str(run.interval),
        "--work-steps",
        str(run.max_steps),
        "--json",
    ]
    if not run.kills_s:
        raise RuntimeError("no failure landed during the run; raise max_steps or lower the MTBF")
    r = subprocess.run(cmd, cwd=workdir, env=child_env(), capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"ckptflow goodput failed ({r.returncode}): {r.stderr[-2000:]}")
    d = json.loads(r.stdout)
    restarts = _restart_costs(run, step_s)
    differ = _resume_points_differ(run, d["costs"])
    notes = [
        f"restart cost per failure, from the kill times: median {statistics.median(restarts):.2f} s, "
        f"min {min(restarts):.2f}, max {max(restarts):.2f}"
        if restarts
        else "no restart measurable from the kill times"
    ]
    return Check(
        real=real,
        predicted=float(d["effective"]),
        run={
            "wall_s": run.wall_s,
            "max_steps": run.max_steps,
            "interval": run.interval,
            "attempts": run.attempts,
            "kills_s": run.kills_s,
            "step_s": step_s,
        },
        costs=d["costs"],
        predicted_parts=d["parts"],
        kills=len(run.kills_s),
        notes=notes + differ + list(d.get("notes", [])),
    )


def _resume_points_differ(run: FailedRun, costs: dict[str, Any]) -> list[str]:
    """Where the run resumed from a step other than the one the replay rolled back to (a
    disagreement's first suspect: a save the model calls durable that the run did not have)."""
    from ckptflow.tasks.goodput import Costs, replay

    c = Costs(**{k: costs[k] for k in ("step_s", "save_s", "restore_s", "persist_s", "verify_s")})
    model = [step for _, step in replay(c, run.interval, run.kills_s, work_steps=run.max_steps).rollbacks]
    rows = read_metrics(run.run_path)
    real: list[int] = []
    for a, b in zip(rows, rows[1:], strict=False):
        if b.get("attempt", 0) != a.get("attempt", 0):
            real.append(int(b["step"]) - 1)
    if model == real:
        return [f"every resume point agrees with the replay's ({len(real)} resumes)"]
    return [f"resume points differ: the run resumed from steps {real}, the replay from {model}"]


def _restart_costs(run: FailedRun, step_s: float) -> list[float]:
    """Kill -> the end of the next attempt's first step, less that step: each restart's cost."""
    rows = read_metrics(run.run_path)
    firsts: dict[int, float] = {}
    for r in rows:
        a = int(r.get("attempt", 0))
        if a not in firsts and isinstance(r.get("wall"), (int, float)):
            firsts[a] = float(r["wall"]) - run.t0_wall
    starts = sorted(firsts.values())
    out = []
    for k in run.kills_s:
        nxt = [s for s in starts if s > k]
        if nxt:
            out.append(nxt[0] - step_s - k)
    return out
