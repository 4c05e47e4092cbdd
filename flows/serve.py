"""ckptflow's deployments, declared once, and ``ckptflow serve``: all of them from one process.

    PREFECT_API_URL=http://127.0.0.1:4200/api python -m ckptflow.flows.serve [--config ckptflow.toml]

:data:`DEPLOYMENTS` is the one declaration: ``serve()`` builds from it, and
``deployments/prefect.yaml`` (the same deployments for a work pool) is checked against it
by ``tests/unit/test_serve.py``. ``serve()`` runs unboundedly many flow runs at once unless
given ``limit``; it is bounded by ``prefect.flow_concurrency`` so a burst of commits cannot
start a burst of sanity steps on the training machine. The runner polls every 2 s
(default 10 s) so a commit starts its lifecycle within a few seconds.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any

# Before prefect is imported: the runner reads these at import time.
os.environ.setdefault("PREFECT_RUNNER_POLL_FREQUENCY", "2")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from ckptflow.trainer.events import COMMITTED  # noqa: E402 - after the runner's settings


@dataclass(frozen=True)
class Deployment:
    name: str
    entrypoint: str
    """``module:flow`` (a module path: the flow loads under its one import name)."""
    description: str
    concurrency_limit: int | None = None
    """Flow runs at once under a work pool (``serve`` bounds all of them with ``limit``)."""
    trigger: dict[str, Any] | None = None
    """An event trigger: ``expect``, ``match`` and templated ``parameters``."""
    interval_s: int | None = None
    cron_from_config: bool = False
    """Scheduled by ``[drill] schedule_cron`` / ``timezone`` of the config."""
    parameters: dict[str, Any] = field(default_factory=dict)
    pool_only: bool = False
    """Only under a work pool: it runs on a queue chosen per run (``serve()`` has no queues)."""

    def flow(self) -> Any:
        mod, _, name = self.entrypoint.partition(":")
        return getattr(importlib.import_module(mod), name)


LIFECYCLE_PARAMETERS = {
    "run_id": "{{ event.payload.run_id }}",
    "step": "{{ event.payload.step }}",
    "uri": "{{ event.payload.uri }}",
    "root": "{{ event.payload.root }}",
    "scope": "{{ event.payload.scope }}",
    "nodes": "{{ event.payload.nodes | join(',') }}",
}

DEPLOYMENTS = (
    Deployment(
        "lifecycle",
        "ckptflow.flows.lifecycle:lifecycle",
        "verify -> compress -> promote -> export -> archive -> prune, per committed checkpoint",
        concurrency_limit=16,  # the fleet's cap; each machine limits its sanity steps and uploads (flows/limits.py)
        trigger={
            "expect": [COMMITTED],
            "match": {"prefect.resource.id": "ckptflow.checkpoint.*"},
            "parameters": LIFECYCLE_PARAMETERS,
        },
    ),
    Deployment(
        "reconcile",
        "ckptflow.flows.reconcile:reconcile",
        "missed commits, age-based tier moves, stale .tmp clean-up",
        concurrency_limit=1,
        interval_s=300,
    ),
    Deployment(
        "node-part",
        "ckptflow.flows.nodes:node_part",
        "one node's part of a node-local checkpoint's lifecycle; runs on that node's queue node-<id>",
        pool_only=True,
    ),
    Deployment(
        "restore-drill",
        "ckptflow.flows.drill:restore_drill",
        "restore the newest cold checkpoint into scratch, sanity step at another world size, RTO",
        concurrency_limit=1,
        cron_from_config=True,
    ),
)


def deployments(
    config: str | None, reconcile_every_s: int | None = None, *, work_pool: str | None = None
) -> tuple[list[Any], Any]:
    """The deployments of :data:`DEPLOYMENTS`, and the loaded config: for ``serve()``, or with
    ``work_pool`` for ``apply()`` to a process work pool (module entrypoints, each deployment's
    concurrency limit; a node's part takes the node worker's own config, not ``config``)."""
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.deployments.runner import EntrypointType
    from prefect.events import DeploymentEventTrigger

    from ckptflow.tasks.config import load_config

    cfg = load_config(config)
    out = []
    for d in DEPLOYMENTS:
        if d.pool_only and work_pool is None:
            continue
        params = {"config": config} if config and not d.pool_only else {}
        kw: dict[str, Any] = {"name": d.name, "description": d.description, "parameters": dict(params)}
        if work_pool is not None:
            kw.update(
                work_pool_name=work_pool,
                entrypoint_type=EntrypointType.MODULE_PATH,
                concurrency_limit=d.concurrency_limit,
            )
        if d.trigger is not None:
            kw["triggers"] = [
                DeploymentEventTrigger(
                    expect=set(d.trigger["expect"]),
                    match=d.trigger["match"],
                    parameters={**d.trigger["parameters"], **params},
                )
            ]
            kw.pop("parameters")
        if d.interval_s is not None:
            kw["interval"] = reconcile_every_s or d.interval_s
        if d.cron_from_config:
            kw["schedule"] = CronSchedule(cron=cfg.drill.schedule_cron, timezone=cfg.drill.timezone)
        out.append(d.flow().to_deployment(**kw))
    return out, cfg


def ensure_pool(pool: str, queue: str | None = None) -> None:
    """The process work pool ``pool`` (and its queue ``queue``) exist afterwards."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as c:
        try:
            c.read_work_pool(pool)
        except ObjectNotFound:
            try:
                c.create_work_pool(WorkPoolCreate(name=pool, type="process"))
            except ObjectAlreadyExists:
                pass
        if queue is not None:
            try:
                c.create_work_queue(name=queue, work_pool_name=pool)
            except ObjectAlreadyExists:
                pass


def deploy(pool: str = "ckptflow-pool", config: str | None = None, reconcile_every_s: int | None = None) -> list[str]:
    """Register every deployment with the process work pool ``pool`` (creating it if missing):
    what ``prefect deploy --prefect-file deployments/prefect.yaml --all`` does, from the package.
    Returns the deployment ids."""
    ensure_pool(pool)
    deps, _ = deployments(config, reconcile_every_s, work_pool=pool)
    return [str(d.apply()) for d in deps]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ckptflow.flows.serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", default=None, help="ckptflow.toml (default: $CKPTFLOW_CONFIG, ./ckptflow.toml)")
    p.add_argument("--reconcile-every", type=int, default=300, help="seconds between reconcile runs")
    p.add_argument("--limit", type=int, default=None, help="concurrent flow runs (default: from config)")
    a = p.parse_args(argv)
    if not os.environ.get("PREFECT_API_URL"):
        print(
            "PREFECT_API_URL is not set: without it every process starts its own temporary "
            "server and event triggers never fire. Start one (prefect server start) and export "
            "PREFECT_API_URL=http://127.0.0.1:4200/api",
            file=sys.stderr,
        )
        return 2
    from prefect import serve

    deps, cfg = deployments(a.config, a.reconcile_every)
    if cfg.prefect.forkserver:  # the served flow runs' checks fork from one warm process
        from ckptflow.tasks.forkserver import enable

        enable(os.environ)
    serve(*deps, limit=a.limit or cfg.prefect.flow_concurrency, print_starting_message=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
