"""``ckptflow goodput``: replay failures against a checkpoint interval, report effective time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from ckptflow.cli.common import json_option

HELP = """Replay failures against a checkpointing strategy; print the effective training time.

\b
effective = kept progress / wall time, and the rest in parts:
  stall    training paused by saves (async: the staging copy; a save
           due while the previous one is still in flight waits for it)
  verify   verification that competes with training (--verify-seconds)
  lost     work since the newest *durable* checkpoint, redone after a failure
  restart  failure -> training again (--restore-seconds), again if a
           failure hits the restart
\b
Failures: --mtbf-hours (exponential) or --trace FILE (one failure time in
seconds per line; 'sample' is 419 failures in 54 days shaped like Llama 3
405B's interruptions). Costs: typed in with advise's flags, or measured
with --from-run RUN_DIR (flags given override). Without --interval-steps:
the advised interval (the exact optimum, never shorter than one save in
flight allows). Seeded: --seed replays the same failures; --trials N gives
a 95 % interval. --plot PNG draws effective time against the interval with
Young, Daly and the exact optimum marked.
Exit 0; 2 a number is missing or invalid; 3 a file or run does not exist.
"""


def goodput(
    save_seconds: float | None = typer.Option(
        None, "--save-seconds", help="Training seconds lost per save (the stall).", show_default=False
    ),
    restore_seconds: float | None = typer.Option(
        None, "--restore-seconds", help="Seconds from a failure until training runs again.", show_default=False
    ),
    step_seconds: float | None = typer.Option(None, "--step-seconds", help="Seconds per step.", show_default=False),
    mtbf_hours: float | None = typer.Option(
        None, "--mtbf-hours", help="MTBF of the whole job, hours (exponential failures).", show_default=False
    ),
    interval_steps: int | None = typer.Option(
        None, "--interval-steps", help="Steps between saves (default: the advised interval).", show_default=False
    ),
    persist_seconds: float | None = typer.Option(
        None,
        "--persist-seconds",
        help="Save start -> committed; until then the save is no recovery point (default: the stall).",
        show_default=False,
    ),
    verify_seconds: float = typer.Option(
        0.0, "--verify-seconds", help="Training seconds lost per save to verification competing with it."
    ),
    trace: str | None = typer.Option(
        None, "--trace", help="Failure trace file, or 'sample' (Llama 3-shaped, 54 days).", show_default=False
    ),
    restore_from: str = typer.Option(
        "hot", "--restore-from", help="Where restores come from: hot, peer, warm, cold (picks the measured cost)."
    ),
    from_run: Path | None = typer.Option(
        None, "--from-run", help="A run directory (<hot>/<run>): measure the costs from it.", show_default=False
    ),
    history_dir: Path | None = typer.Option(
        None, "--history-dir", help="Drill history for --from-run (default: <hot>/../drills).", show_default=False
    ),
    hours: float | None = typer.Option(
        None,
        "--hours",
        help="Wall-clock window replayed (default: the trace's span, or 200 x MTBF).",
        show_default=False,
    ),
    work_steps: int | None = typer.Option(
        None,
        "--work-steps",
        help="Replay a job of this many steps (ending in its final save) instead of a window: "
        "how a finished run is checked against its replay.",
        show_default=False,
    ),
    trials: int = typer.Option(1, "--trials", min=1, help="Replays (seeded) for a 95 % confidence interval."),
    seed: int = typer.Option(0, "--seed", help="Seed of the failure times (and of trace offsets)."),
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG of effective time vs interval here."),
    target: float = typer.Option(98.0, "--target", help="Effective time (%) to judge the result against."),
    as_json: bool = json_option(),
) -> None:
    from ckptflow.cli.common import check_numbers, fail
    from ckptflow.cli.errors import EXIT_NOT_FOUND, EXIT_USAGE
    from ckptflow.tasks import goodput as gp
    from ckptflow.trainer.errors import ConfigError

    check_numbers(
        (
            ("--save-seconds", save_seconds, False),
            ("--step-seconds", step_seconds, True),
            ("--mtbf-hours", mtbf_hours, True),
            ("--restore-seconds", restore_seconds, False),
            ("--persist-seconds", persist_seconds, False),
            ("--verify-seconds", verify_seconds, False),
            ("--hours", hours, True),
        ),
        (("--interval-steps", interval_steps), ("--work-steps", work_steps)),
    )
    if restore_from not in gp.RESTORE_SOURCES:
        fail(f"--restore-from {restore_from!r}: choose one of {', '.join(gp.RESTORE_SOURCES)}", EXIT_USAGE)
    if trace is None and mtbf_hours is None:
        fail("give --mtbf-hours H (exponential failures) or --trace FILE|sample", EXIT_USAGE)
    measured: dict[str, Any] = {"values": {}, "sources": {}}
    notes: list[str] = []
    if from_run is not None:
        if not from_run.is_dir():
            fail(f"{from_run}: no such run directory (give <hot root>/<run id>)", EXIT_NOT_FOUND)
        measured, notes = gp.costs_from_run(
            str(from_run), str(history_dir) if history_dir else None, restore_source=restore_from
        )
    values: dict[str, float] = {}
    sources: dict[str, str] = {}
    for key, flag, given in (
        ("step_s", "--step-seconds", step_seconds),
        ("save_s", "--save-seconds", save_seconds),
        ("restore_s", "--restore-seconds", restore_seconds),
        ("persist_s", "--persist-seconds", persist_seconds),
    ):
        if given is not None:
            values[key], sources[key] = given, flag
        elif key in measured["values"]:
            values[key], sources[key] = measured["values"][key], measured["sources"][key]
        elif key == "persist_s":
            continue  # optional: defaults to the stall
        else:
            why = f" ({'; '.join(notes) or 'not measurable from ' + str(from_run)})" if from_run else ""
            fail(f"{flag} is required{why}", EXIT_USAGE)
    tr = None
    if trace is not None:
        path = gp.SAMPLE_TRACE if trace == "sample" else trace
        try:
            tr = gp.read_trace(path)
        except FileNotFoundError as e:
            fail(f"{e.filename}: {e.strerror}", EXIT_NOT_FOUND)
        except ConfigError as e:
            fail(str(e), EXIT_USAGE)
    try:
        costs = gp.Costs(**values, verify_s=verify_seconds, sources=sources)
        rep = gp.goodput(
            costs,
            interval_steps=interval_steps,
            mtbf_s=mtbf_hours * 3600.0 if mtbf_hours is not None else None,
            trace=tr,
            horizon_s=hours * 3600.0 if hours is not None else None,
            trials=trials,
            seed=seed,
            restore_source=restore_from,
            work_steps=work_steps,
        )
    except ConfigError as e:
        fail(str(e), EXIT_USAGE)
    rep.notes[:0] = notes
    png = gp.plot(rep, str(plot)) if plot is not None else None
    verdict = _verdict(rep, target)
    if as_json:
        doc = rep.to_json()
        doc.update(plot=png, target=target / 100.0, verdict=verdict)
        print(json.dumps(doc, indent=1))
    else:
        _print(rep, png, verdict)


def _verdict(rep: Any, target: float) -> str:
    from ckptflow.tasks.goodput import largest_loss

    eff = 100 * rep.chosen.effective
    part, share = largest_loss(rep.chosen.fractions)
    if eff >= target:
        return f"meets the {target:g} % target ({eff:.2f} %)"
    return (
        f"below the {target:g} % target by {target - eff:.2f} points; the largest loss is {part} "
        f"({100 * share:.2f} % of wall time)"
    )


def _dur(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.2f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    return f"{s:.3g} s"


def _print(rep: Any, png: str | None, verdict: str) -> None:
    from rich.table import Table

    from ckptflow.cli.common import console

    con = console()
    c = rep.costs
    out = con.print
    span = f"a job of {rep.work_steps:,} steps" if rep.work_steps else f"window {_dur(rep.horizon_s)}"
    out(f"failures: {rep.source}; {span}; seed {rep.seed}", highlight=False, markup=False)
    for key, name in (("step_s", "step"), ("save_s", "stall"), ("persist_s", "persist"), ("restore_s", "restart")):
        out(f"  {name:8s} {_dur(getattr(c, key))}  ({c.sources.get(key, 'default')})", highlight=False, markup=False)
    if c.verify_s:
        out(f"  verify   {_dur(c.verify_s)} per save (--verify-seconds)", highlight=False, markup=False)
    out(f"  restore from {rep.restore_source}", highlight=False, markup=False)
    for n in rep.notes:
        out(f"  note: {n}", highlight=False, markup=False)
    ch = rep.chosen
    tab = Table(title=f"every {ch.interval_steps:,} steps ({_dur(ch.interval_steps * c.step_s)})", title_justify="left")
    tab.add_column("part")
    tab.add_column("share of wall time", justify="right")
    for k, v in ch.fractions.items():
        tab.add_row("effective" if k == "useful" else k, f"{100 * v:.3f} %")
    con.print(tab)
    ci = f" (95 % CI {100 * ch.low:.2f}-{100 * ch.high:.2f} %, {ch.trials} trials)" if ch.trials > 1 else ""
    out(
        f"effective training time {100 * ch.effective:.2f} %{ci}; {ch.failures_per_trial:.0f} failures per replay",
        style="bold",
        highlight=False,
    )
    opt = ", ".join(f"{k} {_dur(v)} ({rep.optima_steps[k]:,} steps)" for k, v in rep.optima_s.items())
    out(f"optima: {opt}", highlight=False, markup=False)
    out(verdict, highlight=False, markup=False)
    if png:
        out(f"plot: {png}", highlight=False, markup=False)


goodput.__doc__ = HELP


def register(app: typer.Typer) -> None:
    app.command("goodput", help=HELP)(goodput)
