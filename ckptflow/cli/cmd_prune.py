"""``ckptflow prune [RUN] [--tier T] [--dry-run]``: apply each tier's retention policy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from ckptflow.cli.common import config_option, json_option, one_line_errors


@one_line_errors
def prune(
    run_id: str | None = typer.Argument(
        None, metavar="[RUN]", show_default=False, help="Run id (default: every run on the chosen tiers)."
    ),
    tier: str | None = typer.Option(
        None, "--tier", help="Only this tier: hot, warm or cold (default: every configured tier).", show_default=False
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Report what would be deleted; delete nothing."),
    config: Path | None = config_option(),
    as_json: bool = json_option(),
) -> None:
    """Delete the checkpoints no retention rule or protection keeps; print kept (and why) and deleted.

    Each tier's [TIER.retention] from the config (keep_last, keep_every, keep_best,
    keep_all). Whatever the policy, prune never deletes: the checkpoint `latest` names, the
    newest verified one, pinned ones (`ckptflow pin`), leased ones (a restore or drill is
    reading), and — on hot — any checkpoint not yet on the furthest configured tier
    (archived to cold, or promoted to warm when there is no cold tier). The same rules as
    the lifecycle's prune stage (tasks.prune.prune_run). Exit 0; 3 RUN not on any chosen
    tier; 4 some deletes failed (the others went ahead; re-run to retry).
    """
    from ckptflow.cli.common import check_run, fail, load, tiers
    from ckptflow.cli.errors import EXIT_ERROR, EXIT_NOT_FOUND
    from ckptflow.tasks.prune import prune_run

    cfg = load(config)
    chosen = tiers(cfg, tier)
    if run_id is not None:
        runs = [check_run(run_id)]
        if not any(t.committed_steps(runs[0]) for t in chosen):
            fail(
                f"run {run_id!r} has no committed checkpoint on "
                f"{', '.join(f'{t.name} ({t.url})' for t in chosen)}; `ckptflow ls` lists the runs",
                EXIT_NOT_FOUND,
            )
    else:
        runs = sorted({r for t in chosen for r in t.list_runs()})
    names = [t.name for t in chosen]
    reports = {run: prune_run(cfg, run, tiers=names, dry_run=dry_run) for run in runs}
    if as_json:
        print(
            json.dumps(
                {
                    "dry_run": dry_run,
                    "runs": {
                        run: {name: _rep_json(rep) for name, rep in reps.items()} for run, reps in reports.items()
                    },
                },
                indent=1,
            )
        )
    else:
        _table(reports, dry_run, runs)
    if any(rep.errors for reps in reports.values() for rep in reps.values()):
        raise typer.Exit(EXIT_ERROR)


def _rep_json(rep: Any) -> dict[str, Any]:
    return {
        "kept": {str(k): v for k, v in rep.kept.items()},
        "deleted": rep.deleted,
        "planned": rep.planned,
        "errors": {str(k): v for k, v in rep.errors.items()},
        "seconds": round(rep.seconds, 4),
    }


def _table(reports: dict[str, dict[str, Any]], dry_run: bool, runs: list[str]) -> None:
    from rich.table import Table
    from rich.text import Text

    from ckptflow.cli.common import console

    con = console()
    if not runs:
        con.print("no runs on the chosen tiers: nothing to prune")
        return
    verb = "would delete" if dry_run else "deleted"
    tbl = Table(title=f"prune{' (dry run: nothing deleted)' if dry_run else ''}", title_justify="left")
    for c in ("run", "tier", "step", "action", "why"):
        tbl.add_column(c, justify="right" if c == "step" else "left")
    totals = {"kept": 0, "gone": 0, "errors": 0}
    for run, reps in reports.items():
        for name, rep in reps.items():
            gone = set(rep.planned if dry_run else rep.deleted)
            # dict.fromkeys: a protection and a policy rule may both say "pinned"
            rows = [(s, Text("keep", style="green"), "; ".join(dict.fromkeys(w))) for s, w in rep.kept.items()]
            rows += [(s, Text(verb, style="yellow"), "no rule keeps it") for s in gone]
            rows += [(s, Text("ERROR", style="red"), e) for s, e in rep.errors.items()]
            for s, action, why in sorted(rows, key=lambda x: x[0]):
                tbl.add_row(run, name, str(s), action, Text(why))
            totals["kept"] += len(rep.kept)
            totals["gone"] += len(gone)
            totals["errors"] += len(rep.errors)
    con.print(tbl)
    con.print(f"{totals['kept']} kept, {totals['gone']} {verb}, {totals['errors']} failed", highlight=False)


def register(app: typer.Typer) -> None:
    app.command("prune")(prune)
