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
        from ckptflow.trainer.nodes.topology import node_id

        queue = queue_for(node_id(cfg.hot.url))
        from ckptflow.flows.serve import ensure_pool

        ensure_pool(pool, queue)
    from ckptflow.flows.limits import ensure_machine_limits, host

    limits = ensure_machine_limits(cfg.prefect.sanity_per_machine, cfg.prefect.uploads_per_machine)
    typer.echo(
        f"ckptflow: worker for queue {queue} of pool {pool} (hot root {cfg.hot.url}); machine {host()}: "
        + ", ".join(f"{k} <= {v}" for k, v in limits.items())
        + f"; at most {cfg.prefect.flow_concurrency} flow runs at once",
        err=True,
    )
    env = dict(os.environ)
    if config is not None:
        env["CKPTFLOW_CONFIG"] = str(Path(config).resolve())
    limit = str(cfg.prefect.flow_concurrency)
    if general and cfg.prefect.forkserver:
        # The lifecycle's stages and checks fork from one warm process (torch, DCP, Great
        # Expectations, boto3, s3fs imported once); Prefect's flow-run processes start as Prefect
        # starts them. A node queue's flows (stage a part on warm, prune hot) need none of it.
        from ckptflow.tasks.forkserver import enable

        enable(env)
    # Prefect's own process worker replaces this process (same PID: the fork server, started
    # with this PID as its parent, exits when the worker does).
    cmd = ["-m", "prefect", "worker", "start", "--pool", pool, "--work-queue", queue, "--type", "process"]
    os.execve(sys.executable, [sys.executable, *cmd, "--limit", limit], env)


def register(app: typer.Typer) -> None:
    app.command("worker")(worker)
