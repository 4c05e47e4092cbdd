"""``ckptflow pin RUN STEP`` / ``ckptflow unpin RUN STEP``: keep a checkpoint whatever retention says."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ckptflow.cli.common import config_option, json_option, one_line_errors

_TIER_HELP = "Only this tier: hot, warm or cold (default: every tier that has the checkpoint)."


@one_line_errors
def pin(
    run_id: str = typer.Argument(..., metavar="RUN", help="Run id."),
    step: int = typer.Argument(..., metavar="STEP", help="Step of a committed checkpoint."),
    tier: str | None = typer.Option(None, "--tier", help=_TIER_HELP, show_default=False),
    reason: str = typer.Option("", "--reason", help="Why (shown by prune and kept in the pin record)."),
    config: Path | None = config_option(),
    as_json: bool = json_option(),
) -> None:
    """Pin a checkpoint: prune never deletes it, on any tier it is pinned on, until unpinned.

    By default the pin goes on every tier where the checkpoint is committed. Exit 0; 3 when
    no chosen tier has that step committed.
    """
    from ckptflow.cli.common import check_run, fail, load, tiers
    from ckptflow.cli.errors import EXIT_NOT_FOUND, EXIT_USAGE

    run_id = check_run(run_id)
    if step < 0:
        fail(f"STEP {step} must be >= 0", EXIT_USAGE)
    cfg = load(config)
    chosen = tiers(cfg, tier)
    have = [t for t in chosen if t.is_committed(run_id, step)]
    if not have:
        fail(
            f"run {run_id!r} step {step} is not committed on "
            f"{', '.join(f'{t.name} ({t.url})' for t in chosen)}; `ckptflow ls {run_id}` lists its steps",
            EXIT_NOT_FOUND,
        )
    done = {t.name: t.pin(run_id, step, reason) for t in have}
    if as_json:
        print(json.dumps({"run_id": run_id, "step": step, "reason": reason, "pinned": done}, indent=1))
    else:
        for name, url in done.items():
            typer.echo(f"pinned {run_id} step {step} on {name} ({url})")


@one_line_errors
def unpin(
    run_id: str = typer.Argument(..., metavar="RUN", help="Run id."),
    step: int = typer.Argument(..., metavar="STEP", help="Step."),
    tier: str | None = typer.Option(None, "--tier", help="Only this tier (default: every tier).", show_default=False),
    config: Path | None = config_option(),
    as_json: bool = json_option(),
) -> None:
    """Remove a checkpoint's pins (on every tier by default); retention applies to it again.

    Idempotent: a checkpoint that is not pinned is reported, not an error (exit 0).
    """
    from ckptflow.cli.common import check_run, fail, load, tiers
    from ckptflow.cli.errors import EXIT_USAGE

    run_id = check_run(run_id)
    if step < 0:
        fail(f"STEP {step} must be >= 0", EXIT_USAGE)
    cfg = load(config)
    removed = []
    for t in tiers(cfg, tier):
        if step in t.pinned_steps(run_id):
            t.unpin(run_id, step)
            removed.append(t.name)
    if as_json:
        print(json.dumps({"run_id": run_id, "step": step, "unpinned": removed}, indent=1))
    elif removed:
        typer.echo(f"unpinned {run_id} step {step} on {', '.join(removed)}")
    else:
        typer.echo(f"{run_id} step {step} was not pinned on any chosen tier; nothing to do")


def register(app: typer.Typer) -> None:
    app.command("pin")(pin)
    app.command("unpin")(unpin)
