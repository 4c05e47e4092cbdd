"""The checkpoint-interval advice: each formula against an independent brute-force optimum,
and the numbers ``--from-run`` measures from a run's own files."""

from __future__ import annotations

import json
import math

import pytest

from ckptflow.tasks import advise as adv
from ckptflow.trainer.errors import ConfigError
from tests.helpers import brute_exact, brute_first_order, fake_run

H = 3600.0
# (S, M): a fast async save on a stable job ... a save that costs a sizeable part of the MTBF
CASES = [(2.0, 24 * H), (0.002, 10 * H), (10.0, 600.0), (60.0, 4 * H), (300.0, H), (1000.0, 1000.0)]


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


@pytest.mark.parametrize(
    "kw", [{"save_s": 0.0}, {"mtbf_s": -1.0}, {"step_s": 0.0}, {"restore_s": -5.0}, {"save_s": float("nan")}]
)
def test_invalid_inputs_name_the_field(kw):
    base = {"save_s": 1.0, "restore_s": 10.0, "step_s": 0.5, "mtbf_s": H}
    with pytest.raises(ConfigError, match=next(iter(kw))):
        adv.Inputs(**{**base, **kw})


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
