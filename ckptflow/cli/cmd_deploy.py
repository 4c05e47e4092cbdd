"""``ckptflow deploy``: register ckptflow's deployments with a process work pool."""

from __future__ import annotations

from pathlib import Path

import typer

from ckptflow.cli.common import config_option


def deploy(
    config: Path | None = config_option(),
    pool: str = typer.Option("ckptflow-pool", "--pool", help="The process work pool (created if missing)."),
) -> None:
    """Register the lifecycle (on ckptflow.checkpoint.committed), reconcile, restore drill and
    node-part deployments with a process work pool — what `prefect deploy --prefect-file
    deployments/prefect.yaml --all` does, from the installed package. Then start workers:
    `ckptflow worker --general` for the lifecycle, and `ckptflow worker` on every node whose
    hot root is its own disk. Needs PREFECT_API_URL.
    """
    from ckptflow.cli.common import fail, load, prefect_api_url
    from ckptflow.cli.errors import EXIT_USAGE
    from ckptflow.flows.serve import DEPLOYMENTS
    from ckptflow.flows.serve import deploy as apply

    load(config)
    if not prefect_api_url():
        fail("PREFECT_API_URL is not set: the deployments must go to the server your workers use", EXIT_USAGE)
    ids = apply(pool, str(config) if config else None)
    for d, i in zip(DEPLOYMENTS, ids, strict=True):
        typer.echo(f"deployed {d.flow().name}/{d.name} ({i}) to pool {pool}")


def register(app: typer.Typer) -> None:
    app.command("deploy")(deploy)
