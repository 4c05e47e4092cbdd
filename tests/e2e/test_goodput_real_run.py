"""The goodput replay: hand-checked cases, its accounting, the closed form it must agree with,
traces, the CLI, and the trainer's own interval planner (``interval="auto"``)."""

from __future__ import annotations

import json

import pytest

# ---- hand-checked replays ---------------------------------------------------------------------


def test_auto_interval_in_a_real_two_rank_run_changes_together_on_every_rank(tmp_path):
    from ckptflow.trainer.events import read_outbox
    from tests.helpers import run_torchrun

    root = tmp_path / "hot"
    r = run_torchrun(
        [
            "--ckpt-root",
            str(root),
            "--run-id",
            "auto",
            "--model",
            "tiny",
            "--max-steps",
            "240",
            "--save-every",
            "auto",
            "--mtbf-hours",
            "0.02",
            "--step-sleep",
            "0.01",
        ],
        nproc=2,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    run = root / "auto"
    decisions = [json.loads(x) for x in (run / "interval.jsonl").read_text().splitlines()]
    assert decisions and decisions[0]["old"] == 10 and decisions[0]["step"] == 20
    saved = sorted({int(o["step"]) for o in read_outbox(str(run))})
    assert saved[:2] == [10, 20]
    # each gap is the interval in force after the save that opened it (the last save is forced)
    interval, changes = 10, {d["step"]: d["new"] for d in decisions}
    for a, b in zip(saved, saved[1:-1], strict=False):
        interval = changes.get(a, interval)
        assert b - a == interval, (saved, decisions)
    out = r.stdout + r.stderr  # torchrun may forward a worker's stdout to either
    summary = json.loads(out.split("ckptflow-summary ", 1)[1].splitlines()[0])
    assert summary["interval"] == decisions[-1]["new"] and summary["interval_changes"] == len(decisions)
    # the CPU figures the end-to-end benchmark subtracts (saves run off the training thread)
    assert 0 < summary["cpu_off_main_thread_s"] < summary["cpu_s"], summary
    assert 0 < summary["cpu_new_threads_s"] <= summary["cpu_off_main_thread_s"] + 0.05, summary


@pytest.mark.serial  # restart times feed the replay: a neighbour's CPU would stretch them
def test_the_replay_matches_a_real_run_with_failures(tmp_path):
    """A real torchrun job, SIGKILLed at exponential times, against ``ckptflow goodput``'s replay of
    the same kill times for the run's own measured costs.

    The benchmark (docs/benchmarks.md, "Goodput") meets the 2-point target in every recorded run; here 3
    points. The MTBF stays well above the restart time, as on a real cluster (hours against
    minutes): at 20 s on a loaded machine, failures came faster than restarts finished and the
    replay was 5 points pessimistic. This seed draws 3 kills, about 9, 23 and 37 s after the first
    step, in a run of about 55 s at MTBF 30 s. Each kill waits for the middle of a save interval
    (``mid_interval``): the first one, drawn 0.1 s after step 100's save, once landed before that
    save's commit in the run and after it in the replay, and the check failed by 3.3 points on one
    lost interval. With the kills held so, the replay was +0.61 and -0.07 points from the run beside
    one and two busy-loop processes."""
    from ckptflow.realrun import check, run_with_failures

    run = run_with_failures(str(tmp_path), mtbf_s=30.0, max_steps=450, interval=25, seed=80, mid_interval=True)
    c = check(run, str(tmp_path))
    assert c.kills >= 2, c.to_json()
    assert any(n.startswith("every resume point agrees") for n in c.notes), c.to_json()
    assert 0.3 < c.real < 0.99
    assert abs(c.diff_points) <= 3.0, c.to_json()
