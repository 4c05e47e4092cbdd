"""The goodput replay: hand-checked cases, its accounting, the closed form it must agree with,
traces, the CLI, and the trainer's own interval planner (``interval="auto"``)."""

from __future__ import annotations

import json
import math
import random
import subprocess
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptflow.tasks import goodput as gp
from ckptflow.trainer.errors import ConfigError
from ckptflow.trainer.interval import AutoInterval
from ckptflow.trainer.optimum import availability, exact_interval
from tests.helpers import PY, REPO

# ---- hand-checked replays ---------------------------------------------------------------------


def test_no_failures_costs_only_the_stalls_and_the_final_save():
    c = gp.Costs(step_s=1.0, save_s=2.0, restore_s=60.0, persist_s=5.0)
    r = gp.replay(c, 10, [], work_steps=30)
    # saves after 10 and 20 stall 2 s each (the previous is durable by the next), the last is
    # waited for in full (5 s)
    assert r.wall_s == pytest.approx(30 + 2 + 2 + 5)
    assert r.parts == pytest.approx({"useful": 30, "stall": 9, "verify": 0, "lost": 0, "restart": 0})
    assert r.saves == 3 and r.failures == 0 and r.kept_steps == 30


def test_a_failure_rolls_back_to_the_last_durable_save_and_pays_the_restart():
    c = gp.Costs(step_s=1.0, save_s=0.0, restore_s=5.0)
    r = gp.replay(c, 10, [15.0], work_steps=20)
    # 15 steps, failure: back to step 10 (5 lost), 5 s restart, 10 more steps
    assert r.wall_s == pytest.approx(30)
    assert r.parts == pytest.approx({"useful": 20, "stall": 0, "verify": 0, "lost": 5, "restart": 5})


def test_a_save_still_in_flight_is_no_recovery_point():
    c = gp.Costs(step_s=1.0, save_s=0.0, restore_s=0.0, persist_s=3.0)
    r = gp.replay(c, 10, [12.0], work_steps=20)
    # the save at step 10 would be durable at t=13; the failure at 12 takes everything
    assert r.parts["lost"] == pytest.approx(12)
    c2 = gp.Costs(step_s=1.0, save_s=0.0, restore_s=0.0, persist_s=1.0)
    assert gp.replay(c2, 10, [12.0], work_steps=20).parts["lost"] == pytest.approx(2)


def test_a_save_due_while_the_previous_is_in_flight_waits_for_it():
    c = gp.Costs(step_s=1.0, save_s=0.5, restore_s=0.0, persist_s=4.0)
    r = gp.replay(c, 2, [], work_steps=6)
    # save@2 at t=2 (stall .5, durable at 6); save@4 at t=4.5 waits 1.5, stalls .5 (durable at
    # 4.5 + 1.5 + 4 = 10); final save@6 at t=8.5 waits 1.5 for it, then 4 in full
    assert r.parts["stall"] == pytest.approx(0.5 + 2.0 + 5.5)
    assert r.wall_s == pytest.approx(6 + 8.0)


def test_failures_during_the_restart_restart_it():
    c = gp.Costs(step_s=1.0, save_s=0.0, restore_s=10.0)
    r = gp.replay(c, 5, [3.0, 8.0], work_steps=5)
    # 3 steps lost; restart from 3, failure at 8 (5 s in): restart again from 8 to 18; 5 steps
    assert r.failures == 2
    assert r.parts == pytest.approx({"useful": 5, "stall": 0, "verify": 0, "lost": 3, "restart": 15})
    assert r.wall_s == pytest.approx(23)


@settings(max_examples=150, deadline=None)
@given(
    step=st.floats(0.05, 2.0),
    save=st.floats(0.0, 3.0),
    persist=st.floats(0.0, 20.0),
    restore=st.floats(0.0, 30.0),
    verify=st.floats(0.0, 1.0),
    n=st.integers(1, 40),
    mtbf=st.floats(5.0, 500.0),
    seed=st.integers(0, 1000),
)
def test_every_second_lands_in_one_part_and_the_shortcut_changes_nothing(
    step, save, persist, restore, verify, n, mtbf, seed
):
    c = gp.Costs(step_s=step, save_s=save, restore_s=restore, persist_s=persist, verify_s=verify)
    fails = gp.exponential_failures(mtbf, 3000.0, random.Random(seed))
    for kw in ({"horizon_s": 3000.0}, {"work_steps": 400}):
        fast = gp.replay(c, n, fails, **kw)
        slow = gp.replay(c, n, fails, fast_forward=False, **kw)
        assert fast.wall_s == pytest.approx(slow.wall_s, rel=1e-9, abs=1e-6)
        assert fast.kept_steps == slow.kept_steps and fast.failures == slow.failures and fast.saves == slow.saves
        for k in fast.parts:
            assert fast.parts[k] == pytest.approx(slow.parts[k], rel=1e-9, abs=1e-6), k
        assert sum(fast.parts.values()) == pytest.approx(fast.wall_s, rel=1e-9, abs=1e-6)
        assert all(v >= -1e-9 for v in fast.parts.values())


def test_the_replay_agrees_with_dalys_exact_model():
    # Daly's model is the replay's with a save durable when its stall ends.
    c = gp.Costs(step_s=1.0, save_s=20.0, restore_s=60.0, persist_s=20.0)
    m = 3600.0
    for mult in (0.5, 1.0, 3.0):
        n = round(mult * exact_interval(20.0, m))
        e = gp.estimate(c, n, horizon_s=1500 * m, mtbf_s=m, trials=6, seed=7)
        want = availability(n * 1.0, 20.0, 60.0, m)
        assert e.low - 0.002 <= want <= e.high + 0.002, (mult, e, want)


def test_seeded_replays_are_reproducible_and_trials_give_an_interval():
    c = gp.Costs(step_s=1.0, save_s=0.1, restore_s=30.0)  # 10x fewer steps to replay than 0.1 s steps
    a = gp.goodput(c, mtbf_s=3600.0, trials=4, seed=3, sweep_points=5)
    b = gp.goodput(c, mtbf_s=3600.0, trials=4, seed=3, sweep_points=5)
    assert a.to_json() == b.to_json()
    assert a.chosen.low < a.chosen.effective < a.chosen.high
    assert gp.goodput(c, mtbf_s=3600.0, trials=4, seed=4, sweep_points=5).chosen.effective != a.chosen.effective


def test_the_advised_interval_respects_one_save_in_flight():
    c = gp.Costs(step_s=0.1, save_s=0.001, restore_s=1.0, persist_s=60.0)
    # optimum sqrt(2 * 0.001 * 3600) = 2.7 s, but a save takes a minute to be durable
    assert gp.advised_steps(c, 3600.0) == math.ceil((60.0 - 0.001) / 0.1)
    rep = gp.goodput(c, mtbf_s=3600.0, interval_steps=10, sweep_points=3)
    assert any("one save in flight" in n for n in rep.notes)


# ---- traces ---------------------------------------------------------------------------------


def test_the_sample_trace_is_what_its_generator_writes():
    with open(gp.SAMPLE_TRACE, encoding="utf-8") as f:
        assert f.read().splitlines() == gp.llama3_trace_lines()
    tr = gp.read_trace(gp.SAMPLE_TRACE)
    assert len(tr.times_s) == 419 and tr.span_s == 54 * 86400
    assert tr.causes.count("faulty-gpu") == 148 and tr.causes.count("gpu-hbm3-memory") == 72
    assert 2.9 * 3600 < tr.mtbf_s < 3.3 * 3600


def test_a_bad_trace_line_is_named_with_its_file_and_line(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("# span_s: 100\n10 gpu\nten minutes\n")
    with pytest.raises(ConfigError, match=r"t\.txt:3: 'ten' is not a failure time"):
        gp.read_trace(str(p))
    p.write_text("# span_s: 5\n10\n")
    with pytest.raises(ConfigError, match="shorter than its last failure"):
        gp.read_trace(str(p))
    p.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="no failure times"):
        gp.read_trace(str(p))
    with pytest.raises(FileNotFoundError):
        gp.read_trace(str(tmp_path / "missing.txt"))


# ---- the CLI ---------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "ckptflow.cli.main", "goodput", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_cli_json_plot_and_the_target(tmp_path):
    png = tmp_path / "g.png"
    r = _cli(
        "--save-seconds",
        "0.005",
        "--step-seconds",
        "0.1",
        "--restore-seconds",
        "30",
        "--persist-seconds",
        "1",
        "--trace",
        "sample",
        "--trials",
        "3",
        "--plot",
        str(png),
        "--json",
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert 0.98 < d["effective"] < 1.0 and d["effective_low"] <= d["effective"] <= d["effective_high"]
    assert sum(d["parts"].values()) == pytest.approx(1.0)
    assert d["interval_steps"] == d["optima_steps"]["exact"] and "meets" in d["verdict"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a slow restart at a short MTBF: below target, and the verdict names the term
    r = _cli("--save-seconds", "1", "--step-seconds", "1", "--restore-seconds", "600", "--mtbf-hours", "1")
    assert r.returncode == 0, r.stderr
    assert "below the 98 % target" in r.stdout and "largest loss is restart" in r.stdout


def test_cli_errors_say_what_is_missing(tmp_path):
    r = _cli("--save-seconds", "1", "--step-seconds", "1", "--restore-seconds", "1")
    assert r.returncode == 2 and "--mtbf-hours" in r.stderr
    r = _cli("--step-seconds", "1", "--restore-seconds", "1", "--mtbf-hours", "3")
    assert r.returncode == 2 and "--save-seconds is required" in r.stderr
    r = _cli("--save-seconds", "1", "--step-seconds", "1", "--restore-seconds", "1", "--trace", str(tmp_path / "x"))
    assert r.returncode == 3 and "x" in r.stderr
    r = _cli("--save-seconds", "1", "--step-seconds", "-1", "--restore-seconds", "1", "--mtbf-hours", "3")
    assert r.returncode == 2 and "--step-seconds" in r.stderr


# ---- the trainer's interval planner ------------------------------------------------------------


@dataclass
class _T:
    committed_s: float


def _drive(auto: AutoInterval, *, step_s: float, stall_s: float, persist_s: float, steps: int) -> list[int]:
    """Feed the planner a loop of ``steps`` steps the way CheckpointManager.save does."""
    now, saves, timings = 0.0, [], []
    after_save = False
    for step in range(1, steps + 1):
        now += step_s + (stall_s if after_save else 0.0)
        after_save = False
        auto.tick(step, now)
        if auto.due(step):
            auto.plan(step, timings)
            saves.append(step)
            timings.append(_T(persist_s))
            auto.saved(step)
            after_save = True
    return saves


def test_auto_interval_settles_on_the_exact_optimum_and_logs_why(tmp_path):
    auto = AutoInterval(mtbf_s=3600.0, first=10, run_path=str(tmp_path))
    saves = _drive(auto, step_s=0.01, stall_s=0.02, persist_s=0.05, steps=5000)
    want = round(exact_interval(0.02, 3600.0) / 0.01)  # 1200 steps of 10 ms
    assert auto.interval == pytest.approx(want, rel=0.02)
    assert saves[:2] == [10, 20] and saves[2] - saves[1] == auto.interval
    rows = [json.loads(x) for x in (tmp_path / "interval.jsonl").read_text().splitlines()]
    assert rows[0]["old"] == 10 and rows[0]["new"] == auto.interval and "optimum" in rows[0]["reason"]
    assert len(rows) == 1  # noise within 10 % does not flap


def test_auto_interval_never_saves_faster_than_one_in_flight():
    auto = AutoInterval(mtbf_s=3600.0, first=5)
    _drive(auto, step_s=0.01, stall_s=0.0005, persist_s=30.0, steps=400)
    assert auto.interval == math.ceil((30.0 - 0.0005) / 0.01)
    assert "durable before the next is due" in auto.decisions[-1].reason


def test_auto_interval_bounds():
    auto = AutoInterval(mtbf_s=3600.0 * 1000, first=10, max_steps=50)
    _drive(auto, step_s=0.01, stall_s=0.02, persist_s=0.03, steps=200)
    assert auto.interval == 50 and "auto_max_interval=50" in auto.decisions[-1].reason


def test_auto_config_is_checked():
    from ckptflow.trainer.config import CheckpointConfig

    with pytest.raises(ConfigError, match="needs mtbf_hours"):
        CheckpointConfig(root="/tmp/x", run_id="r", interval="auto")
    with pytest.raises(ConfigError, match="only with interval='auto'"):
        CheckpointConfig(root="/tmp/x", run_id="r", interval=10, mtbf_hours=3.0)
    with pytest.raises(ConfigError, match="integer >= 1 or 'auto'"):
        CheckpointConfig(root="/tmp/x", run_id="r", interval="often")
    CheckpointConfig(root="/tmp/x", run_id="r", interval="auto", mtbf_hours=3.0)


# ---- real runs (slow) ---------------------------------------------------------------------------
