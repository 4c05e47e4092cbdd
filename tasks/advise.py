"""How often to checkpoint: the interval that maximises effective training time.

Pure functions (no I/O except :func:`measure_run`, which reads a run's files). Notation,
all in seconds:

    S  save cost: training time lost per checkpoint (with async saves: the stall)
    R  restart cost: time from a failure until training runs again (restore + reload)
    M  mean time between failures (MTBF) of the whole job
    T  the checkpoint interval: *work* (training time) between two saves
    t  one training step; the interval in steps is T / t

Three answers, from the simplest to the exact one:

* **Young (1974)**, first order: ``T = sqrt(2·S·M)``. It minimises the first-order waste
  (fraction of wall time not spent on new training)::

      W1(T) = S/T + (T/2 + R)/M

  ``S/T``: time spent saving; ``(T/2 + R)/M``: per failure (one every M seconds) half an
  interval of work is redone on average, plus the restart. With ``T = N_steps·t_step``
  the second term is the familiar ``(N_steps·T_step/2 + T_restart)/MTBF``.
* **Daly (2006)**, higher order: ``T = sqrt(2·S·M)·[1 + (1/3)·sqrt(S/(2M)) + (1/9)·(S/(2M))] − S``
  for ``S < 2M``, else ``T = M``. J. T. Daly, "A higher order estimate of the optimum
  checkpoint interval for restart dumps", Future Generation Computer Systems 22(3),
  2006, 303-312: an approximation of the optimum of the exact model below.
* **Exact (availability-optimal)**: Daly's expected wall time for a job of ``W`` seconds of
  work, failures exponential with mean M (his eq. for the complete restart model)::

      E[wall] = M · e^{R/M} · (e^{(T+S)/M} − 1) · W/T

  so the effective fraction (availability) is ``A(T) = T / (M·e^{R/M}·(e^{(T+S)/M} − 1))``
  and the waste is ``1 − A(T)``. ``A`` is maximal where ``(1 − T/M)·e^{(T+S)/M} = 1``,
  i.e. ``T = M·(1 + W₀(−e^{−1−S/M}))`` with the Lambert W function; it is solved here
  numerically (bisection to machine precision, no SciPy needed).

R never moves the optimum (in both models it only adds a constant to the waste); it
matters for the waste numbers. The three agree when ``S ≪ M`` and part when a save
costs a noticeable share of the MTBF.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ckptflow.trainer.errors import ConfigError
from ckptflow.trainer.events import read_jsonl
from ckptflow.trainer.optimum import availability, check_costs, exact_interval  # shared with the trainer

FORMULAS = {
    "young": "T = sqrt(2*S*M)  (Young 1974, first order)",
    "daly": "T = sqrt(2*S*M)*[1 + sqrt(S/(2M))/3 + (S/(2M))/9] - S  for S < 2M, else M  (Daly 2006)",
    "exact": "maximise A(T) = T / (M*e^(R/M)*(e^((T+S)/M) - 1))  (Daly 2006 exact model): T = M*(1 + W0(-e^(-1-S/M)))",
    "waste_first_order": "W1(T) = S/T + (T/2 + R)/M",
    "waste_exact": "W(T) = 1 - A(T)",
}
DEFAULT_MULTIPLES = (0.25, 0.5, 1.0, 2.0, 4.0)


# ---- Young, Daly, the waste (the exact optimum and availability: trainer/optimum.py) --------


def young_interval(save_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum ``sqrt(2·S·M)`` (minimises :func:`waste_first_order`)."""
    check_costs(save_s=save_s, mtbf_s=mtbf_s)
    return math.sqrt(2.0 * save_s * mtbf_s)


def daly_interval(save_s: float, mtbf_s: float) -> float:
    """Daly's higher-order estimate of the exact optimum (``M`` once ``S >= 2M``)."""
    check_costs(save_s=save_s, mtbf_s=mtbf_s)
    if save_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = save_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * save_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - save_s


def waste_first_order(interval_s: float, save_s: float, restore_s: float, mtbf_s: float) -> float:
    """``S/T + (T/2 + R)/M``: expected fraction of wall time lost (first order; may exceed 1 for absurd inputs)."""
    check_costs(interval_s=interval_s, save_s=save_s, restore_s=restore_s, mtbf_s=mtbf_s)
    return save_s / interval_s + (interval_s / 2.0 + restore_s) / mtbf_s


def waste_exact(interval_s: float, save_s: float, restore_s: float, mtbf_s: float) -> float:
    """``1 − availability``: expected fraction of wall time lost (exact model)."""
    return 1.0 - availability(interval_s, save_s, restore_s, mtbf_s)


# ---- advice --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Inputs:
    save_s: float
    restore_s: float
    step_s: float
    mtbf_s: float
    sources: dict[str, str] = field(default_factory=dict)
    """Where each number came from ("--save-seconds", "metrics.jsonl: …")."""

    def __post_init__(self) -> None:
        check_costs(save_s=self.save_s, restore_s=self.restore_s, step_s=self.step_s, mtbf_s=self.mtbf_s)


@dataclass(frozen=True, slots=True)
class Row:
    """One interval and what it costs."""

    label: str
    interval_s: float
    """The interval the row evaluates: ``steps · step_s``."""
    steps: int
    ideal_s: float
    """The unrounded interval the label names (before rounding to whole steps)."""
    waste_first_order: float
    waste_exact: float
    saves_per_hour: float
    lost_per_failure_s: float
    """``T/2 + R``: redone work plus restart, on average, per failure."""


@dataclass(slots=True)
class Advice:
    inputs: Inputs
    recommended: dict[str, Row]
    """young, daly, exact: each optimum rounded to whole steps."""
    comparison: list[Row]
    best: str = "exact"

    def to_json(self) -> dict[str, Any]:
        return {
            "inputs": asdict(self.inputs),
            "formulas": FORMULAS,
            "best": self.best,
            "recommended": {k: asdict(r) for k, r in self.recommended.items()},
            "comparison": [asdict(r) for r in self.comparison],
        }


def to_steps(interval_s: float, step_s: float) -> int:
    """An interval in whole steps (nearest, at least 1)."""
    check_costs(interval_s=interval_s, step_s=step_s)
    return max(1, round(interval_s / step_s))


def row(label: str, ideal_s: float, inp: Inputs, *, steps: int | None = None) -> Row:
    n = to_steps(ideal_s, inp.step_s) if steps is None else steps
    t = n * inp.step_s
    return Row(
        label=label,
        interval_s=t,
        steps=n,
        ideal_s=ideal_s,
        waste_first_order=waste_first_order(t, inp.save_s, inp.restore_s, inp.mtbf_s),
        waste_exact=waste_exact(t, inp.save_s, inp.restore_s, inp.mtbf_s),
        saves_per_hour=3600.0 / (t + inp.save_s),
        lost_per_failure_s=t / 2.0 + inp.restore_s,
    )


def advise(inp: Inputs, *, current_steps: int | None = None, multiples: Sequence[float] = DEFAULT_MULTIPLES) -> Advice:
    """The three optima in seconds and steps, and a table of intervals around the exact one."""
    opt = {
        "young": young_interval(inp.save_s, inp.mtbf_s),
        "daly": daly_interval(inp.save_s, inp.mtbf_s),
        "exact": exact_interval(inp.save_s, inp.mtbf_s),
    }
    rec = {k: row(k, v, inp) for k, v in opt.items()}
    table = [row(f"{m:g}x optimum", m * opt["exact"], inp) for m in multiples]
    if current_steps is not None:
        if not isinstance(current_steps, int) or current_steps < 1:
            raise ConfigError(f"current_steps={current_steps!r} must be a positive integer")
        table.append(row("current", current_steps * inp.step_s, inp, steps=current_steps))
    table.sort(key=lambda r: (r.steps, r.label))
    return Advice(inputs=inp, recommended=rec, comparison=table)


# ---- numbers measured from a run ------------------------------------------------------


@dataclass(slots=True)
class RunMeasurement:
    """What a run's own files say about S, R, t and its save interval (None: not measurable).

    * ``step_s`` — median of the ``t`` deltas between consecutive steps in
      ``metrics.jsonl`` (same torchrun attempt), leaving out the steps right after a save;
    * ``save_s`` — the stall: median over saves of (delta of the step after the save −
      ``step_s``), at least 1 ms. The stall lands in the next step's delta: ``save()``
      returns after staging starts, and the next ``optimizer.step()`` waits for it;
    * ``commit_s`` — median of (``committed_at`` in ``_outbox.jsonl`` − the step's ``wall``
      in ``metrics.jsonl``): how long a checkpoint takes to become durable (reported,
      not used: with async saves training does not wait for it);
    * ``restore_s`` — median ``recovery_seconds`` of the successful restore drills in
      ``<drills>/<run>.jsonl`` (download + decompress + verify + load + sanity);
    * ``save_every_steps`` — median gap between committed steps.
    """

    run_dir: str
    step_s: float | None = None
    save_s: float | None = None
    commit_s: float | None = None
    restore_s: float | None = None
    save_every_steps: int | None = None
    steps: int = 0
    saves: int = 0
    drills: int = 0
    history: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


MIN_STALL_S = 1e-3


def measure_run(run_dir: str, history_dir: str | None = None) -> RunMeasurement:
    """Read ``metrics.jsonl``, ``_outbox.jsonl``, the step dirs and the drill history of a run.

    ``history_dir`` defaults to the drills' default (``drills/`` next to the hot root, i.e.
    ``<run_dir>/../../drills``). Raises FileNotFoundError when ``run_dir`` is not a directory.
    """
    from ckptflow.trainer.format import layout
    from ckptflow.trainer.reference.metrics import read_metrics

    run_dir = os.path.abspath(run_dir)
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(2, "no such run directory", run_dir)
    out = RunMeasurement(run_dir=run_dir)
    rows = read_metrics(run_dir)
    outbox = read_jsonl(os.path.join(run_dir, layout.OUTBOX))
    committed = {s for n in os.listdir(run_dir) if (s := layout.parse_step(n)) is not None}
    saves = committed | {int(o["step"]) for o in outbox if isinstance(o.get("step"), int)}
    out.saves = len(saves)
    if len(saves) > 1:
        ss = sorted(saves)
        out.save_every_steps = int(statistics.median(b - a for a, b in zip(ss, ss[1:], strict=False)))
    if not rows:
        out.notes.append(f"no {layout.METRICS} in {run_dir}: step time and save stall unknown")
    deltas = step_deltas(rows)
    out.steps = len({r["step"] for r in rows if isinstance(r.get("step"), int)})
    plain = [d for s, d in deltas.items() if (s - 1) not in saves]
    if plain:
        out.step_s = statistics.median(plain)
    after = [d for s, d in deltas.items() if (s - 1) in saves]
    if out.step_s is not None and after:
        stall = statistics.median(after) - out.step_s
        if stall < MIN_STALL_S:
            out.notes.append(
                f"save stall below the step-time noise ({stall * 1e3:.2f} ms); using {MIN_STALL_S * 1e3:g} ms"
            )
        out.save_s = max(stall, MIN_STALL_S)
    elif rows:
        out.notes.append("no step follows a save in metrics.jsonl: save stall unknown")
    wall = {r["step"]: r["wall"] for r in rows if isinstance(r.get("wall"), (int, float))}
    lat = [
        float(o["committed_at"]) - wall[o["step"]]
        for o in outbox
        if o.get("step") in wall and isinstance(o.get("committed_at"), (int, float))
    ]
    if lat:
        out.commit_s = max(0.0, statistics.median(lat))
    hdir = history_dir or os.path.join(os.path.dirname(os.path.dirname(run_dir)), "drills")
    hist = os.path.join(hdir, f"{os.path.basename(run_dir)}.jsonl")
    drills = [d for d in read_jsonl(hist) if d.get("ok") and isinstance(d.get("recovery_seconds"), (int, float))]
    if drills:
        out.restore_s = statistics.median(float(d["recovery_seconds"]) for d in drills)
        out.drills, out.history = len(drills), hist
    else:
        out.notes.append(f"no successful restore drill in {hist}: restore time unknown")
    return out


def step_deltas(rows: Iterable[dict[str, Any]]) -> dict[int, float]:
    """``{step: t(step) − t(step − 1)}`` for consecutive steps of the same attempt (the last
    seen wins when a restart re-ran a step)."""
    out: dict[int, float] = {}
    prev: dict[str, Any] | None = None
    for r in rows:
        ok = isinstance(r.get("step"), int) and isinstance(r.get("t"), (int, float))
        if (
            ok
            and prev is not None
            and r.get("attempt", 0) == prev.get("attempt", 0)
            and r["step"] == prev["step"] + 1
            and r["t"] >= prev["t"]
        ):
            out[r["step"]] = float(r["t"]) - float(prev["t"])
        prev = r if ok else None
    return out
