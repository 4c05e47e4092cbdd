"""The checkpoint-interval advice: each formula against an independent brute-force optimum,
and the numbers ``--from-run`` measures from a run's own files."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from ckptflow.tasks import advise as adv
from ckptflow.trainer import layout
from ckptflow.trainer.errors import ConfigError

H = 3600.0
# (S, M): a fast async save on a stable job ... a save that costs a sizeable part of the MTBF
CASES = [(2.0, 24 * H), (0.002, 10 * H), (10.0, 600.0), (60.0, 4 * H), (300.0, H), (1000.0, 1000.0)]


def grid(center: float, span: float = 100.0, n: int = 40001) -> np.ndarray:
    """Log-spaced intervals around ``center``: neighbours differ by < 0.03 %."""
    return np.exp(np.linspace(math.log(center / span), math.log(center * span), n))


def brute_first_order(s: float, r: float, m: float) -> float:
    t = grid(math.sqrt(2 * s * m))
    return float(t[np.argmin(s / t + (t / 2 + r) / m)])


def brute_exact(s: float, r: float, m: float) -> float:
    """argmax of Daly's availability T / (M e^{R/M} (e^{(T+S)/M} - 1)), written independently."""
    t = grid(min(math.sqrt(2 * s * m), m))
    t = t[(t + s) / m < 600]  # no overflow in exp
    a = t / (m * np.exp(r / m) * np.expm1((t + s) / m))
    return float(t[np.argmax(a)])


@pytest.mark.parametrize("s,m", CASES)
def test_young_is_the_first_order_optimum(s, m):
    assert adv.young_interval(s, m) == pytest.approx(brute_first_order(s, 30.0, m), rel=0.01)


@pytest.mark.parametrize("s,m", CASES)
def test_exact_interval_maximises_daly_availability(s, m):
    assert adv.exact_interval(s, m) == pytest.approx(brute_exact(s, 30.0, m), rel=0.01)


@pytest.mark.parametrize("s,m", CASES)
def test_restart_cost_never_moves_the_optimum(s, m):
    """R only scales A(T) (exact) or shifts W1(T) (first order) by a constant."""
    assert brute_exact(s, 0.0, m) == pytest.approx(brute_exact(s, 0.5 * m, m), rel=1e-9)
    assert brute_first_order(s, 0.0, m) == pytest.approx(brute_first_order(s, 0.5 * m, m), rel=1e-9)


@pytest.mark.parametrize("s,m", [c for c in CASES if c[0] / c[1] <= 0.1])
def test_daly_approximates_the_exact_optimum_when_saves_are_cheap(s, m):
    assert adv.daly_interval(s, m) == pytest.approx(adv.exact_interval(s, m), rel=0.01)


def test_daly_caps_at_the_mtbf_and_young_overshoots_for_costly_saves():
    assert adv.daly_interval(5000.0, 1000.0) == 1000.0  # S >= 2M
    s, m = 300.0, H
    assert adv.young_interval(s, m) > 1.1 * adv.exact_interval(s, m)
    assert adv.daly_interval(s, m) == pytest.approx(adv.exact_interval(s, m), rel=0.002)


@pytest.mark.parametrize("t", [1.0, 600.0, 5000.0])
def test_scalar_waste_functions_match_the_formulas(t):
    s, r, m = 7.0, 90.0, 6 * H
    assert adv.waste_first_order(t, s, r, m) == pytest.approx(s / t + (t / 2 + r) / m, rel=1e-12)
    a = t / (m * math.exp(r / m) * (math.exp((t + s) / m) - 1))
    assert adv.availability(t, s, r, m) == pytest.approx(a, rel=1e-9)
    assert adv.waste_exact(t, s, r, m) == pytest.approx(1 - a, rel=1e-9)
    assert 0 < adv.availability(1e7, s, r, m) < 1e-6  # no overflow far past the MTBF


def test_the_seed_articles_waste_formula_is_the_failure_term():
    """(N_steps*T_step/2 + T_restart)/MTBF: per failure, half an interval redone plus the restart."""
    n, t_step, s, r, m = 500, 0.8, 3.0, 240.0, 12 * H
    w = adv.waste_first_order(n * t_step, s, r, m)
    assert w - s / (n * t_step) == pytest.approx((n * t_step / 2 + r) / m, rel=1e-12)


def test_advice_rounds_to_steps_and_its_optimum_beats_every_other_row():
    inp = adv.Inputs(save_s=4.0, restore_s=300.0, step_s=1.5, mtbf_s=8 * H)
    a = adv.advise(inp, current_steps=100)
    assert a.recommended["exact"].steps == round(adv.exact_interval(4.0, 8 * H) / 1.5)
    assert a.recommended["exact"].interval_s == a.recommended["exact"].steps * 1.5
    labels = [r.label for r in a.comparison]
    assert {"0.25x optimum", "0.5x optimum", "1x optimum", "2x optimum", "4x optimum", "current"} == set(labels)
    assert [r.steps for r in a.comparison] == sorted(r.steps for r in a.comparison)
    best = a.recommended["exact"].waste_exact
    assert all(best <= r.waste_exact + 1e-12 for r in a.comparison)
    cur = next(r for r in a.comparison if r.label == "current")
    assert cur.steps == 100 and cur.lost_per_failure_s == pytest.approx(150 / 2 + 300)
    doc = json.loads(json.dumps(a.to_json()))
    assert doc["recommended"]["young"]["steps"] >= 1 and "sqrt(2*S*M)" in doc["formulas"]["young"]


@pytest.mark.parametrize("kw", [dict(save_s=0.0), dict(mtbf_s=-1.0), dict(step_s=0.0), dict(restore_s=-5.0),
                                dict(save_s=float("nan"))])
def test_invalid_inputs_name_the_field(kw):
    base = dict(save_s=1.0, restore_s=10.0, step_s=0.5, mtbf_s=H)
    with pytest.raises(ConfigError, match=next(iter(kw))):
        adv.Inputs(**{**base, **kw})


def fake_run(root, run_id="m1", *, step_s=0.5, stall_s=2.0, commit_s=3.0, every=10, steps=40,
             restart_at=25, drills=(100.0, 120.0, 110.0)) -> str:
    """A run's files as the trainer and the drill write them: saves every ``every`` steps,
    each adding ``stall_s`` to the next step; a torchrun restart resumes after ``restart_at``'s
    last checkpoint (steps repeat, ``t`` restarts from zero)."""
    run = os.path.join(root, "hot", run_id)
    os.makedirs(run)
    rows, outbox, wall0 = [], [], 1.8e9
    resume = (restart_at // every) * every
    for attempt, (first, last) in enumerate([(1, restart_at), (resume + 1, steps)]):
        t = 3.0  # start-up before the first step
        for s in range(first, last + 1):
            t += step_s + (stall_s if (s - 1) % every == 0 and s > 1 else 0.0)
            rows.append({"step": s, "loss": 1.0, "lr": 1e-3, "attempt": attempt, "t": round(t, 4),
                         "wall": wall0 + attempt * 1000 + t})
            if s % every == 0:
                outbox.append({"step": s, "committed_at": rows[-1]["wall"] + commit_s})
    with open(os.path.join(run, layout.METRICS), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
        f.write('{"step": 41, "t": ')  # a torn last line (killed mid-write) is ignored
    with open(os.path.join(run, layout.OUTBOX), "w") as f:
        f.writelines(json.dumps(o) + "\n" for o in outbox)
    for s in range(every, steps + 1, every):
        os.makedirs(os.path.join(run, layout.step_name(s)))
    hist = os.path.join(root, "drills")
    os.makedirs(hist)
    with open(os.path.join(hist, f"{run_id}.jsonl"), "w") as f:
        for d in drills:
            f.write(json.dumps({"run_id": run_id, "ok": True, "recovery_seconds": d}) + "\n")
        f.write(json.dumps({"run_id": run_id, "ok": False, "recovery_seconds": 5.0}) + "\n")  # failed: ignored
    return run


def test_measure_run_reads_step_time_stall_commit_and_drills(tmp_path):
    m = adv.measure_run(fake_run(str(tmp_path)))
    assert m.step_s == pytest.approx(0.5, abs=1e-3)
    assert m.save_s == pytest.approx(2.0, abs=1e-3)
    assert m.commit_s == pytest.approx(3.0, abs=1e-3)
    assert m.restore_s == pytest.approx(110.0)  # median of the successful drills
    assert m.save_every_steps == 10 and m.saves == 4 and m.drills == 3
    assert m.history and m.history.endswith("m1.jsonl")


def test_measure_run_says_what_it_could_not_measure(tmp_path):
    run = tmp_path / "hot" / "bare"
    run.mkdir(parents=True)
    m = adv.measure_run(str(run))
    assert (m.step_s, m.save_s, m.restore_s) == (None, None, None)
    assert any("metrics.jsonl" in n for n in m.notes) and any("drill" in n for n in m.notes)
    with pytest.raises(FileNotFoundError):
        adv.measure_run(str(tmp_path / "nope"))
