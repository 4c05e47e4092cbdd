"""A Prefect flow-run process forked from the worker's warm fork server, not started fresh.

    python -m ckptflow.flows.forkrun          # the flow-run command of ``ckptflow worker --general``

Why: after the fork server took the lifecycle's checks and stages (docs/benchmarks.md,
"Fleet"), what was left of a lifecycle's cost on 2 cores was the fresh process Prefect's
process worker starts for every flow run: the interpreter, ``import prefect.engine`` (1.2-1.9
CPU-seconds), then the flow's module, before the run even reports that it started. That is
CPU the cores run out of at a fleet's commit rate, and it is in every commit's start latency.

How: the worker (``flows/worker.py``) starts each flow run with this module instead of
``python -m prefect.engine``. This module imports nothing heavy: it asks the fork server for
a child (:func:`ckptflow.tasks.forkserver.run_attached`, with this process's standard
streams, environment and directory) and waits. The child — a fork of a process that already
imported Prefect's engine and ckptflow's flows — runs exactly what ``python -m prefect.engine``
runs (its ``__main__``), with the flow-run id, the control channel and the settings this
process was given, then exits as an interpreter would (Prefect drains its logs and events).
This process exits with the child's exit code; SIGTERM/SIGINT reach the child (Prefect's
cancellation), and if this process is killed the child dies too. With no fork server (or none
answering) it becomes ``python -m prefect.engine`` itself (``exec``): nothing changes but the
speed.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ckptflow.tasks import forkserver

JOB = "flowrun"

PRELOAD = (
    "prefect.engine",
    "prefect.flow_engine",
    "prefect.client.orchestration",
    "ckptflow.flows.lifecycle",
    "ckptflow.flows.reconcile",
    "ckptflow.flows.drill",
    "ckptflow.flows.nodes",
    "ckptflow.flows.forkrun",  # registers the job in the server
)
"""What the fork server imports for flow runs: Prefect's engine, and the flows our deployments
name (a flow run loads its flow by module path; a module already imported loads for free)."""

NODE_PRELOAD = PRELOAD + ("ckptflow.tasks.transfer._parts", "ckptflow.tasks.prune", "ckptflow.trainer.topology")
"""A node worker's: its flow runs are a node's part (stage it on warm, prune hot), in-process."""


def _flowrun(args: dict[str, Any]) -> dict[str, int]:
    """``python -m prefect.engine`` in this (forked) process: the environment is already the
    caller's (the fork server set it), so the flow-run id and the control channel are too."""
    import runpy

    from prefect.context import refresh_global_settings_context

    # The server read Prefect's settings from its own environment at import; this run's
    # environment is the worker's job environment (it may set PREFECT_* variables).
    refresh_global_settings_context()
    argv = sys.argv
    sys.argv = ["prefect.engine", *[str(a) for a in args.get("argv", [])]]
    saved = sys.modules.pop("prefect.engine", None)  # run as __main__, as Prefect's own bootstrap does
    try:
        runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)
        rc = 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
        if saved is not None:
            sys.modules["prefect.engine"] = saved
    return {"rc": rc}


forkserver.register(JOB, _flowrun, keeps_faults=True)


def main() -> int:
    rc = forkserver.run_attached(JOB, {"argv": sys.argv[1:]})
    if rc is None:  # no fork server here: the flow run the usual way, in this very process
        os.execv(sys.executable, [sys.executable, "-m", "prefect.engine", *sys.argv[1:]])
    return rc


if __name__ == "__main__":
    sys.exit(main())
