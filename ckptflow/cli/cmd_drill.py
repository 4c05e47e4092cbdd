"""``ckptflow drill RUN``: run the restore drill now (the nightly flow, on demand)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import typer

from ckptflow.cli.common import config_option, json_option, one_line_errors


@one_line_errors
def drill(
    run_id: str = typer.Argument(..., metavar="RUN", help="Run id."),
    step: int | None = typer.Option(
        None,
        "--step",
        help="Drill exactly this step (default: the newest, plus one random older one if [drill] random_older).",
        show_default=False,
    ),
    world_size: int | None = typer.Option(
        None,
        "--world-size",
        help="Processes to restore into (default: [drill] world_size; always differs from the saved one).",
        show_default=False,
    ),
    history_dir: Path | None = typer.Option(
        None,
        "--history-dir",
        help="Drill history and plots (default: drills/ next to the hot root).",
        show_default=False,
    ),
    scratch_dir: Path | None = typer.Option(
        None, "--scratch-dir", help="Where to restore into (default: the temp dir; removed after).", show_default=False
    ),
    config: Path | None = config_option(),
    as_json: bool = json_option(),
) -> None:
    """Restore from the coldest tier into scratch, verify, and load at another world size.

    Runs the `ckptflow-restore-drill` Prefect flow in this process (flows.drill): download
    -> decompress -> verify every file -> sanity step in a fresh torchrun job at a different
    world size -> probe loss and learning rate compared with the recorded ones. Prints one
    row per drilled checkpoint (recovery time and its phases) and the plot path; the result
    is appended to the drill history. Needs a Prefect API (PREFECT_API_URL) to record the
    run and fire alerts; without one Prefect starts a temporary local server. Exit 0 the
    drill passed; 1 it failed (the failing object or check is named); 3 RUN (or STEP) has
    no checkpoint on the drill tier.
    """
    from ckptflow.cli.common import check_run, fail, hint, load, prefect_api_url
    from ckptflow.cli.errors import EXIT_BAD, EXIT_NOT_FOUND, EXIT_USAGE

    run_id = check_run(run_id)
    if world_size is not None and world_size < 1:
        fail(f"--world-size {world_size} must be >= 1", EXIT_USAGE)
    cfg = load(config)
    from ckptflow.flows.drill import DrillFailed, default_history_dir, drill_tier, restore_drill
    from ckptflow.tasks.drill import read_history

    tier = drill_tier(cfg)
    steps = tier.committed_steps(run_id)
    if not steps or (step is not None and step not in steps):
        what = f"step {step}" if step is not None else "checkpoint"
        fail(
            f"run {run_id!r} has no committed {what} on the {tier.name} tier ({tier.url}), the tier "
            f"drills restore from; `ckptflow ls {run_id}` lists where its checkpoints are",
            EXIT_NOT_FOUND,
        )
    if not prefect_api_url():
        hint(
            "PREFECT_API_URL is not set: the drill runs against a temporary local Prefect server "
            "(slower start, run not kept, no alerts); export PREFECT_API_URL=http://127.0.0.1:4200/api"
        )
    hist = str(history_dir) if history_dir else default_history_dir(cfg)
    t0 = time.time()
    state = restore_drill(
        run_id=run_id,
        config=str(config) if config else None,
        step=step,
        world_size=world_size,
        history_dir=hist,
        scratch_dir=str(scratch_dir) if scratch_dir else None,
        return_state=True,
    )
    result = state.result(raise_on_failure=False)
    if isinstance(result, BaseException) and not isinstance(result, DrillFailed):
        raise result  # config/storage errors: one line and their exit code (flows.cli.errors)
    ok = not isinstance(result, BaseException)
    if ok:
        assert not isinstance(result, BaseException)  # that is what ok says
        run = result["runs"][run_id]
        results, plot = run["results"], run["plot"]
    else:
        # A failed flow run returns no value: read this drill's rows back from the history.
        results = [r for r in read_history(hist, run_id) if r.get("started_at", 0) >= t0 - 1]
        plot = _newest_plot(hist, run_id, t0)
    if as_json:
        print(
            json.dumps(
                {
                    "run_id": run_id,
                    "tier": tier.name,
                    "ok": ok,
                    "results": results,
                    "plot": plot,
                    "history": os.path.join(hist, f"{run_id}.jsonl"),
                    "failure": None if ok else str(result),
                },
                indent=1,
                default=str,
            )
        )
    else:
        _table(run_id, tier.name, results, plot, ok, None if ok else str(result))
    if not ok:
        raise typer.Exit(EXIT_BAD)


def _newest_plot(hist: str, run_id: str, t0: float) -> str | None:
    try:
        pngs = [
            os.path.join(hist, n) for n in os.listdir(hist) if n.startswith(f"{run_id}-drill-") and n.endswith(".png")
        ]
    except FileNotFoundError:
        return None
    pngs = [p for p in pngs if os.path.getmtime(p) >= t0 - 1]
    return max(pngs, key=os.path.getmtime) if pngs else None


def _table(
    run_id: str, tier: str, results: list[dict[str, Any]], plot: str | None, ok: bool, failure: str | None
) -> None:
    from rich.table import Table
    from rich.text import Text

    from ckptflow.cli.common import console

    con = console()
    tbl = Table(title=f"restore drill of {run_id} from {tier}", title_justify="left")
    cols = (
        "step",
        "result",
        "recovery s",
        "download",
        "decompress",
        "verify",
        "sanity",
        "world size",
        "probe",
        "bytes stored",
    )
    for c in cols:
        tbl.add_column(c, justify="left" if c in ("result", "probe") else "right")
    for r in results:
        sec = r.get("seconds") or {}
        res = Text("ok", style="green") if r.get("ok") else Text(f"FAILED: {r.get('failure')}", style="red")
        ws = f"{r.get('saved_world_size') or '?'} -> {r.get('world_size') or '?'}"
        tbl.add_row(
            str(r["step"]),
            res,
            f"{r.get('recovery_seconds', 0):.2f}",
            *[f"{sec[k]:.2f}" if k in sec else "-" for k in ("download", "decompress", "verify", "sanity")],
            ws,
            str(r.get("probe_match") or "-"),
            f"{r.get('bytes_stored', 0):,}",
        )
    con.print(tbl)
    con.print(f"plot: {plot or '(none)'}", highlight=False, markup=False)
    if ok:
        con.print("drill passed", style="green")
    else:
        con.print(f"drill FAILED: {failure}", style="red", highlight=False, markup=False)


def register(app: typer.Typer) -> None:
    app.command("drill")(drill)
