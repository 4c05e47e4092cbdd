"""Event-to-flow-start latency: from a commit to its lifecycle flow run starting.

    python -m benchmarks.bench_event_latency [--checkpoints 6]

Starts what the demo starts (a Prefect server with SQLite, ``flows.serve`` with its 2 s
poll), trains the tiny reference model with ``PREFECT_API_URL`` set, and for every
commit compares the outbox's ``committed_at`` (written just before the event is sent)
with the lifecycle flow run's ``created`` time (the trigger fired) and ``start_time``
(a runner picked it up). Lifecycles run with ``sanity_step``/``expectations`` off so
that a flow's own length does not delay the next one's start through the concurrency
limit of 2 more than it must.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from ckptflow.harness import PrefectServer, Supervisor, wait_deployments


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoints", type=int, default=6)
    a = p.parse_args(argv)
    wd = tempfile.mkdtemp(prefix="ckptflow-bench-latency-")
    logs = os.path.join(wd, "logs")
    os.makedirs(logs)
    try:
        with PrefectServer(os.path.join(wd, "prefect"), os.path.join(logs, "prefect.log")) as srv, Supervisor() as sup:
            api = srv.url
            cfg = os.path.join(wd, "ckptflow.toml")
            with open(cfg, "w") as f:
                f.write(
                    f'[hot]\nurl = "{wd}/hot"\n[hot.retention]\nkeep_all = true\n'
                    "[lifecycle]\nsanity_step = false\nexpectations = false\n"
                )
            os.environ.update(
                PREFECT_API_URL=api,
                PREFECT_HOME=os.path.join(wd, "prefect"),
                PREFECT_SERVER_ANALYTICS_ENABLED="false",
                PREFECT_LOGGING_LEVEL="WARNING",
            )
            env = dict(os.environ)
            sup.start(
                "serve",
                [sys.executable, "-m", "ckptflow.flows.serve", "--config", cfg, "--reconcile-every", "3600"],
                env=env,
                log=open(os.path.join(logs, "serve.log"), "w"),
            )
            wait_deployments(["ckptflow-lifecycle/lifecycle"], 90)
            time.sleep(3)
            n = a.checkpoints
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "ckptflow.trainer.train",
                    "--parallel",
                    "none",
                    "--ckpt-root",
                    f"{wd}/hot",
                    "--run-id",
                    "lat",
                    "--model",
                    "tiny",
                    "--max-steps",
                    str(4 * n),
                    "--save-every",
                    "4",
                    "--step-sleep",
                    "0.5",
                ],
                env=env,
                check=True,
                capture_output=True,
            )
            from prefect.client.orchestration import get_client
            from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

            from ckptflow.trainer.events import read_outbox

            outbox = {int(x["step"]): x["committed_at"] for x in read_outbox(f"{wd}/hot/lat")}
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                with get_client(sync_client=True) as c:
                    runs = c.read_flow_runs(
                        flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_="lifecycle-lat-step"))
                    )
                started = {int(r.name.rsplit("step", 1)[1]): r for r in runs if r.start_time is not None}
                if len(started) >= len(outbox):
                    break
                time.sleep(1)
            created = [started[s].created.timestamp() - t for s, t in outbox.items() if s in started]
            start = [started[s].start_time.timestamp() - t for s, t in outbox.items() if s in started]
            print(f"commits: {len(outbox)}, lifecycle runs started: {len(started)}")
            print(
                f"commit -> flow run created (trigger fired): median {statistics.median(created):.2f} s, "
                f"max {max(created):.2f} s"
            )
            print(
                f"commit -> flow run started (runner picked it up): median {statistics.median(start):.2f} s, "
                f"max {max(start):.2f} s"
            )
        return 0
    finally:
        shutil.rmtree(wd, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
