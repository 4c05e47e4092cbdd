"""Per-machine limits on the lifecycle's heavy stages: Prefect global concurrency limits.

A fleet's lifecycles run on several workers, and what hurts a machine is not the number of
flow runs but how many sanity steps (a fresh process that rebuilds and runs the model) and S3
uploads (bandwidth, memory for multipart parts) it runs at once. So each machine has two
global concurrency limits, named after it:

* ``ckptflow-sanity-<host>`` (``[prefect] sanity_per_machine``, default 1) around the verify
  stage;
* ``ckptflow-upload-<host>`` (``[prefect] uploads_per_machine``, default 2) around archive.

``ckptflow worker`` creates (or updates) its machine's two at start-up; a lifecycle takes a
slot of the limit of the machine it runs on. Where a limit does not exist (a flow run in a
test, under ``ckptflow serve`` without a worker), the stage runs unlimited: the limit is a
guard for a machine, not a condition of correctness. The lifecycle deployment's own
``concurrency_limit`` caps the fleet as a whole.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator

log = logging.getLogger(__name__)

STAGE_LIMITS = {"verify": "sanity", "archive": "upload"}
"""Which stages take a slot, and of which limit."""

SLOT_LEASE_S = 60.0
"""How long the server keeps a slot whose holder stopped renewing it (the holder renews every
45 s). A lifecycle killed while it holds a slot (SIGKILL, OOM, a lost node) cannot release it;
with Prefect's default lease (300 s) its machine then verified nothing for 5 minutes. 60 s is
the shortest lease the server accepts. The price: a holder cut off from the server for over a
minute loses its slot, and two sanity steps may overlap on that machine once — a guard for the
machine's load, never for correctness."""


def host() -> str:
    """This machine's name as limits use it: ``CKPTFLOW_HOST`` (set it where several "machines"
    share one host, as tests do), else the host name; [A-Za-z0-9-] only."""
    raw = os.environ.get("CKPTFLOW_HOST") or socket.gethostname()
    return "".join(c if c.isalnum() or c == "-" else "-" for c in raw)[:63] or "host"


def limit_name(kind: str, machine: str | None = None) -> str:
    return f"ckptflow-{kind}-{machine or host()}"


def ensure_machine_limits(sanity: int, uploads: int, machine: str | None = None) -> dict[str, int]:
    """Create or update this machine's two limits; returns ``{name: limit}``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    want = {limit_name("sanity", machine): sanity, limit_name("upload", machine): uploads}
    with get_client(sync_client=True) as c:
        for name, n in want.items():
            update = GlobalConcurrencyLimitUpdate(limit=n, active=True)
            try:
                c.read_global_concurrency_limit_by_name(name)
                c.update_global_concurrency_limit(name, update)
            except ObjectNotFound:
                try:
                    c.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=n, active=True))
                except ObjectAlreadyExists:
                    # Another worker of this machine created it between our read and create (two
                    # workers started at once: seen in tests/test_node_lifecycle.py, where the
                    # losing worker exited). Same machine, same limits: set ours on theirs.
                    c.update_global_concurrency_limit(name, update)
    return want


@contextlib.contextmanager
def machine_slot(stage: str) -> Iterator[None]:
    """A slot of this machine's limit for ``stage`` (nothing for a stage without one)."""
    kind = STAGE_LIMITS.get(stage)
    if kind is None or not os.environ.get("PREFECT_API_URL"):
        yield
        return
    from prefect.concurrency.sync import concurrency

    # strict=False: without the limit (no worker made it) the stage runs unlimited.
    with concurrency(limit_name(kind), occupy=1, strict=False, lease_duration=SLOT_LEASE_S):
        yield
