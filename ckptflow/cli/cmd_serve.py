"""``ckptflow serve``: run the lifecycle, reconcile and drill deployments from this process."""

from __future__ import annotations

from pathlib import Path

import typer

from ckptflow.cli.common import config_option


def serve(
    config: Path | None = config_option(),
    limit: int | None = typer.Option(
        None, "--limit", help="Flow runs at once (default: [prefect] flow_concurrency).", show_default=False
    ),
    reconcile_every: int = typer.Option(300, "--reconcile-every", help="Seconds between reconcile runs."),
) -> None:
    """Serve the lifecycle, reconcile and drill deployments from this process.

    flows.serve: the lifecycle on every commit event, reconcile on an interval, the restore
    drill on its cron. Runs until interrupted.

    Needs PREFECT_API_URL (a lasting server: without one event triggers never fire). Exit 2
    when it is not set or an option is invalid.
    """
    from ckptflow.cli.common import fail, load
    from ckptflow.cli.errors import EXIT_USAGE
    from ckptflow.flows.serve import main

    if limit is not None and limit < 1:
        fail(f"--limit {limit} must be >= 1", EXIT_USAGE)
    if reconcile_every < 1:
        fail(f"--reconcile-every {reconcile_every} must be >= 1 second", EXIT_USAGE)
    load(config)  # a bad config fails here, in one line, before the server is contacted
    argv = ["--reconcile-every", str(reconcile_every)]
    if config is not None:
        argv += ["--config", str(config)]
    if limit is not None:
        argv += ["--limit", str(limit)]
    raise typer.Exit(main(argv))


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
