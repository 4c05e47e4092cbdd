"""A Prefect process worker whose flow runs fork from the fork server (``flows/forkrun.py``).

    python -m ckptflow.flows.worker --pool P --work-queue Q --limit N   # ``ckptflow worker --general`` execs this

It is Prefect's own process worker (same pool type, queues, limits, heartbeats, cancellation)
with one change: a flow run whose deployment sets no ``command`` of its own is started with
``python -m ckptflow.flows.forkrun`` instead of ``python -m prefect.engine``, when this worker
has a fork server (``$CKPTFLOW_FORKSERVER``). A deployment that sets a command keeps it.
The start-up is what ``prefect worker start`` does for a known pool: its signal handling
(first SIGTERM/SIGINT stops polling, the second kills), then the worker's loops.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from prefect.utilities.processutils import command_to_string
from prefect.workers.process import ProcessJobConfiguration, ProcessWorker

from ckptflow.tasks import forkserver

FORKRUN = "ckptflow.flows.forkrun"


class ForkingJobConfiguration(ProcessJobConfiguration):
    def prepare_for_flow_run(self, *args: Any, **kwargs: Any) -> None:
        super().prepare_for_flow_run(*args, **kwargs)
        if not self._command_configured and forkserver.available():
            self.command = command_to_string([sys.executable, "-m", FORKRUN])
            self._command_configured = True


class ForkingProcessWorker(ProcessWorker):
    """Prefect's process worker (``type`` stays ``process``: the pool's) with forked flow runs."""

    job_configuration = ForkingJobConfiguration

    @classmethod
    def __dispatch_key__(cls) -> str:
        # Prefect keys its worker registry by type; ours must not replace "process" in it.
        return "ckptflow-forking-process"


async def _run(pool: str, queues: list[str], limit: int | None) -> None:
    from prefect.settings import PREFECT_WORKER_HEARTBEAT_SECONDS, PREFECT_WORKER_PREFETCH_SECONDS

    worker = ForkingProcessWorker(
        work_pool_name=pool,
        work_queues=queues,
        limit=limit,
        prefetch_seconds=PREFECT_WORKER_PREFETCH_SECONDS.value(),
        heartbeat_interval_seconds=int(PREFECT_WORKER_HEARTBEAT_SECONDS.value()),
    )
    try:
        await worker.start(printer=print)
    except asyncio.CancelledError:
        print(f"Worker {worker.name!r} stopped!", flush=True)


def main(argv: list[str] | None = None) -> int:
    from prefect.utilities.processutils import setup_signal_handlers_worker

    p = argparse.ArgumentParser(prog="python -m ckptflow.flows.worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--pool", required=True)
    p.add_argument("--work-queue", action="append", default=[])
    p.add_argument("--limit", type=int, default=None)
    a = p.parse_args(argv)
    setup_signal_handlers_worker(os.getpid(), "the process worker", print)
    try:
        asyncio.run(_run(a.pool, a.work_queue, a.limit))
    except KeyboardInterrupt:  # the handlers turn SIGTERM into SIGINT: a requested stop
        print("Worker stopped (interrupted).", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
