"""``ckptflow advise``: the checkpoint interval that maximises effective training time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from ckptflow.cli.common import json_option

HELP = """Recommend a checkpoint interval (seconds and steps) and show what it costs.

\b
S  save cost: training seconds lost per save (async saves: the stall)
R  restart cost: seconds from a failure until training runs again
M  MTBF of the whole job;  T  interval: training seconds between saves
\b
Young (1974)   T = sqrt(2*S*M)
Daly (2006)    T = sqrt(2*S*M)*[1 + sqrt(S/(2M))/3 + S/(18M)] - S
               for S < 2M, else T = M
exact          T maximises A(T) = T / (M*e^(R/M)*(e^((T+S)/M) - 1)),
               Daly's expected-time model (FGCS 22(3), 2006):
               T = M*(1 + W0(-e^(-1-S/M))), solved numerically
\b
waste, first order   W1(T) = S/T + (T/2 + R)/M
                     (T = N_steps*T_step: the seed formula
                     (N_steps*T_step/2 + T_restart)/MTBF is its 2nd term)
waste, exact         W(T) = 1 - A(T)

The recommendation is the exact optimum in whole steps; a table compares
0.25x-4x of it and --current-steps. --from-run RUN_DIR measures S, R and
T_step from a run (docs/cli.md says how); flags given override them.
Exit 0; 2 a number is missing or invalid; 3 RUN_DIR does not exist.
"""


def advise(
    save_seconds: float | None = typer.Option(
        None, "--save-seconds", help="S: training seconds lost per checkpoint.", show_default=False
    ),
    restore_seconds: float | None = typer.Option(
        None, "--restore-seconds", help="R: seconds from a failure until training runs again.", show_default=False
    ),
    step_seconds: float | None = typer.Option(
        None, "--step-seconds", help="Seconds per training step (turns intervals into steps).", show_default=False
    ),
    mtbf_hours: float | None = typer.Option(
        None, "--mtbf-hours", help="M: mean time between failures of the whole job, in hours.", show_default=False
    ),
    from_run: Path | None = typer.Option(
        None, "--from-run", help="A run directory (<hot>/<run>): measure S, R and T_step from it.", show_default=False
    ),
    history_dir: Path | None = typer.Option(
        None, "--history-dir", help="Drill history for --from-run (default: <hot>/../drills).", show_default=False
    ),
    current_steps: int | None = typer.Option(
        None,
        "--current-steps",
        help="Your interval in steps, for the comparison (default with --from-run: the run's).",
        show_default=False,
    ),
    as_json: bool = json_option(),
) -> None:

    from ckptflow.cli.common import check_numbers, fail
    from ckptflow.cli.errors import EXIT_NOT_FOUND, EXIT_USAGE
    from ckptflow.tasks.advise import Inputs, measure_run
    from ckptflow.tasks.advise import advise as compute
    from ckptflow.trainer.errors import ConfigError

    check_numbers(
        (
            ("--save-seconds", save_seconds, True),
            ("--step-seconds", step_seconds, True),
            ("--mtbf-hours", mtbf_hours, True),
            ("--restore-seconds", restore_seconds, False),
        ),
        (("--current-steps", current_steps),),
    )
    measured = None
    if from_run is not None:
        if not from_run.is_dir():
            fail(f"{from_run}: no such run directory (give <hot root>/<run id>)", EXIT_NOT_FOUND)
        measured = measure_run(str(from_run), str(history_dir) if history_dir else None)
        if current_steps is None:
            current_steps = measured.save_every_steps
    src = f"measured from {from_run}" if from_run is not None else ""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, flag, given, got in (
        ("save_s", "--save-seconds", save_seconds, measured and measured.save_s),
        ("restore_s", "--restore-seconds", restore_seconds, measured and measured.restore_s),
        ("step_s", "--step-seconds", step_seconds, measured and measured.step_s),
        ("mtbf_s", "--mtbf-hours", None if mtbf_hours is None else mtbf_hours * 3600.0, None),
    ):
        if given is not None:
            values[key], sources[key] = given, flag
        elif got is not None:
            values[key], sources[key] = got, src
        else:
            why = (
                ""
                if measured is None or key == "mtbf_s"
                else f" ({'; '.join(measured.notes) or 'not measurable from ' + str(from_run)})"
            )
            fail(f"{flag} is required{why}", EXIT_USAGE)
    try:
        adv = compute(Inputs(**values, sources=sources), current_steps=current_steps)
    except ConfigError as e:
        fail(str(e), EXIT_USAGE)
    if as_json:
        doc = adv.to_json()
        doc["measured"] = measured.to_json() if measured else None
        print(json.dumps(doc, indent=1))
    else:
        _print(adv, measured)


def _dur(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.2f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    return f"{s:.3g} s"


def _print(adv: Any, measured: Any) -> None:
    from rich.table import Table

    from ckptflow.cli.common import console

    con = console()
    i = adv.inputs
    if measured is not None:
        m = measured
        con.print(
            f"measured from {m.run_dir}: {m.steps} steps, {m.saves} saves, {m.drills} drills; "
            f"commit latency {_dur(m.commit_s) if m.commit_s is not None else '-'} "
            "(not in the model: training does not wait for it)",
            highlight=False,
            markup=False,
        )
        for n in m.notes:
            con.print(f"  note: {n}", highlight=False, markup=False)
    con.print(
        f"S = {_dur(i.save_s)} ({i.sources.get('save_s')}), R = {_dur(i.restore_s)} "
        f"({i.sources.get('restore_s')}), T_step = {_dur(i.step_s)} ({i.sources.get('step_s')}), "
        f"MTBF = {_dur(i.mtbf_s)}",
        highlight=False,
        markup=False,
    )
    rec = Table(title="optimal interval", title_justify="left")
    for c in ("formula", "seconds", "steps", "waste (first order)", "waste (exact)"):
        rec.add_column(c, justify="left" if c == "formula" else "right")
    names = {"young": "Young  sqrt(2SM)", "daly": "Daly   higher order", "exact": "exact  max A(T)"}
    for k, r in adv.recommended.items():
        rec.add_row(
            names[k],
            f"{r.ideal_s:,.1f}",
            f"{r.steps:,}",
            f"{100 * r.waste_first_order:.3f} %",
            f"{100 * r.waste_exact:.3f} %",
        )
    con.print(rec)
    best = adv.recommended[adv.best]
    con.print(
        f"recommended: checkpoint every {best.steps:,} steps ({_dur(best.interval_s)}); expected "
        f"waste {100 * best.waste_exact:.2f} % of wall time",
        style="bold",
        highlight=False,
    )
    cmp_ = Table(title="comparison", title_justify="left")
    for c in ("interval", "steps", "seconds", "saves/h", "lost per failure", "waste (first order)", "waste (exact)"):
        cmp_.add_column(c, justify="left" if c == "interval" else "right")
    for r in adv.comparison:
        cmp_.add_row(
            r.label,
            f"{r.steps:,}",
            f"{r.interval_s:,.1f}",
            f"{r.saves_per_hour:.2f}",
            _dur(r.lost_per_failure_s),
            f"{100 * r.waste_first_order:.3f} %",
            f"{100 * r.waste_exact:.3f} %",
        )
    con.print(cmp_)


advise.__doc__ = HELP


def register(app: typer.Typer) -> None:
    app.command("advise", help=HELP)(advise)
