"""``ckptflow worker``: this node's Prefect worker, on this node's own work queue."""

from __future__ import annotations

from pathlib import Path

import typer

from ckptflow.cli.common import config_option


def worker(
    config: Path | None = config_option(),
    pool: str = typer.Option("ckptflow-pool", "--pool", help="The process work pool (deployments/prefect.yaml's)."),
    general: bool = typer.Option(
        False, "--general", help="Serve the pool's default queue instead (lifecycle, reconcile, drill)."
    ),
) -> None:
    """Start a Prefect worker for this node: queue node-<node id> of the work pool.

    With node-local hot roots, a node's checkpoint part can only be read on that node: the
    lifecycle sends each node's part to that node's queue, and this worker — started on the
    node, with the node's config (its [hot] is the node's local disk) — runs it. The node id
    is read from the hot root (created there by the trainer, or now). The queue is created if
    missing, then `prefect worker start` takes over this process. Needs PREFECT_API_URL.
    """
    import os
    import sys

    from ckptflow.cli.common import fail, load, prefect_api_url
    from ckptflow.cli.errors import EXIT_USAGE

    cfg = load(config)
    if not prefect_api_url():
        fail("PREFECT_API_URL is not set: a worker needs the server the deployments are on", EXIT_USAGE)
    if general:
        queue = "default"
    else:
        from ckptflow.flows.nodes import queue_for
        from ckptflow.trainer.topology import node_id

        queue = queue_for(node_id(cfg.hot.url))
        _ensure_queue(pool, queue)
    typer.echo(f"ckptflow: worker for queue {queue} of pool {pool} (hot root {cfg.hot.url})", err=True)
    env = dict(os.environ)
    if config is not None:
        env["CKPTFLOW_CONFIG"] = str(Path(config).resolve())
    os.execve(
        sys.executable,
        [
            sys.executable,
            "-m",
            "prefect",
            "worker",
            "start",
            "--pool",
            pool,
            "--work-queue",
            queue,
            "--type",
            "process",
        ],
        env,
    )


def _ensure_queue(pool: str, queue: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as c:
        try:
            c.read_work_pool(pool)
        except ObjectNotFound:
            from prefect.client.schemas.actions import WorkPoolCreate

            try:
                c.create_work_pool(WorkPoolCreate(name=pool, type="process"))
            except ObjectAlreadyExists:
                pass
        try:
            c.create_work_queue(name=queue, work_pool_name=pool)
        except ObjectAlreadyExists:
            pass


def register(app: typer.Typer) -> None:
    app.command("worker")(worker)
