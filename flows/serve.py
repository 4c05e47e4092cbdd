"""Serve ckptflow's deployments from one process (the single-machine default).

    PREFECT_API_URL=http://127.0.0.1:4200/api python -m ckptflow.flows.serve [--config ckptflow.toml]

The same deployments as ``deployments/prefect.yaml`` (lifecycle on the commit event,
reconcile on an interval, the restore drill on a cron), run by ``serve()`` instead of a
work pool. ``serve()`` runs unboundedly many flow runs at once unless given ``limit``;
it is bounded by ``prefect.flow_concurrency`` so a burst of commits cannot start a
burst of sanity steps on the training machine. The runner polls every 2 s (default
10 s) so a commit starts its lifecycle within a few seconds.
"""

from __future__ import annotations

import argparse
import os
import sys

# Before prefect is imported: the runner reads these at import time.
os.environ.setdefault("PREFECT_RUNNER_POLL_FREQUENCY", "2")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

COMMITTED = "ckptflow.checkpoint.committed"
LIFECYCLE_PARAMETERS = {
    "run_id": "{{ event.payload.run_id }}",
    "step": "{{ event.payload.step }}",
    "uri": "{{ event.payload.uri }}",
    "root": "{{ event.payload.root }}",
}


def deployments(config: str | None, reconcile_every_s: int):
    from prefect.events import DeploymentEventTrigger

    from ckptflow.flows.lifecycle import lifecycle
    from ckptflow.flows.reconcile import reconcile
    from ckptflow.tasks.config import load_config

    cfg = load_config(config)
    params = {"config": config} if config else {}
    out = [
        lifecycle.to_deployment(
            name="lifecycle",
            triggers=[DeploymentEventTrigger(
                expect={COMMITTED}, match={"prefect.resource.id": "ckptflow.checkpoint.*"},
                parameters={**LIFECYCLE_PARAMETERS, **params})],
            description="verify -> compress -> promote -> archive -> prune, per committed checkpoint",
        ),
        reconcile.to_deployment(name="reconcile", interval=reconcile_every_s, parameters=params,
                                description="missed commits, age-based moves, stale .tmp clean-up"),
    ]
    try:
        from ckptflow.flows.drill import restore_drill
    except ImportError:  # the drill flow is optional in a minimal install
        restore_drill = None
    if restore_drill is not None:
        from prefect.client.schemas.schedules import CronSchedule

        out.append(restore_drill.to_deployment(
            name="restore-drill", parameters=params,
            schedule=CronSchedule(cron=cfg.drill.schedule_cron, timezone=cfg.drill.timezone),
            description="nightly: restore from cold, sanity step at another world size, RTO"))
    return out, cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckptflow.flows.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="ckptflow.toml (default: $CKPTFLOW_CONFIG, ./ckptflow.toml)")
    p.add_argument("--reconcile-every", type=int, default=300, help="seconds between reconcile runs")
    p.add_argument("--limit", type=int, default=None, help="concurrent flow runs (default: from config)")
    a = p.parse_args(argv)
    if not os.environ.get("PREFECT_API_URL"):
        print("PREFECT_API_URL is not set: without it every process starts its own temporary "
              "server and event triggers never fire. Start one (prefect server start) and export "
              "PREFECT_API_URL=http://127.0.0.1:4200/api", file=sys.stderr)
        return 2
    from prefect import serve

    deps, cfg = deployments(a.config, a.reconcile_every)
    serve(*deps, limit=a.limit or cfg.prefect.flow_concurrency, print_starting_message=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
