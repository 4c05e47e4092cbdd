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

A lifecycle killed while it holds a slot cannot give it back. The lease bounds that for a machine
that vanished with it; on a machine that goes on, the next lifecycle that finds the limit full
releases the slots of the machine's dead holders (:class:`_Holders`), within ``POLL_S``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

STAGE_LIMITS = {"verify": "sanity", "archive": "upload"}
"""Which stages take a slot, and of which limit."""

SLOT_LEASE_S = 60.0
"""How long the server keeps a slot whose holder stopped renewing it (the holder renews every
``RENEW_S``). It bounds a slot whose holder's whole machine vanished; a holder that died on a machine
that goes on is noticed sooner (:func:`reap_dead_holders`). 60 s is the shortest lease the
server accepts."""

RENEW_S = SLOT_LEASE_S / 3
"""How often a holder renews its slot's lease."""

POLL_S = 2.0
"""The longest wait between two tries for a full limit: each try first releases the slots of
this machine's dead holders, so a killed lifecycle holds its machine's slot for about this long."""


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
                    # workers started at once: seen in tests/integration/test_node_lifecycle.py, where the
                    # losing worker exited). Same machine, same limits: set ours on theirs.
                    c.update_global_concurrency_limit(name, update)
    return want


@contextlib.contextmanager
def machine_slot(stage: str) -> Iterator[None]:
    """A slot of this machine's limit for ``stage`` (nothing for a stage without one).

    Taken with a lease through Prefect's client (not ``prefect.concurrency.sync.concurrency``,
    which keeps the lease to itself): the lease id goes into this machine's holder registry
    (:class:`_Holders`), so that when this process is killed while it holds the slot — SIGKILL,
    the OOM killer — the next lifecycle on this machine releases the slot at its next try,
    instead of the whole machine verifying nothing until the lease runs out."""
    kind = STAGE_LIMITS.get(stage)
    if kind is None or not os.environ.get("PREFECT_API_URL"):
        yield
        return
    from prefect.client.orchestration import get_client

    name = limit_name(kind)
    holders = _Holders(name)
    with get_client(sync_client=True) as c:
        lease = _acquire(c, name, holders)
    if lease is None:  # no such limit (no worker made it): the stage runs unlimited
        yield
        return
    holders.add(lease)
    stop = threading.Event()
    # In the caller's context: the Prefect settings it took the slot with (a plain thread sees only
    # the process's root settings, and without an API URL there its client starts a local server).
    renewer = threading.Thread(
        target=contextvars.copy_context().run, args=(_renew, lease, stop), name=f"lease-{name}", daemon=True
    )
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join()
        _release(lease)
        holders.remove(lease)


def _acquire(client: Any, name: str, holders: _Holders) -> str | None:
    """Wait for a slot of limit ``name``; its lease id, or None when the limit does not exist."""
    import httpx

    while True:
        holders.reap(client)
        try:
            got = client.increment_concurrency_slots_with_lease(
                names=[name], slots=1, mode="concurrency", lease_duration=SLOT_LEASE_S
            ).json()
        except httpx.HTTPStatusError as e:
            if e.response.status_code != 423:  # 423 Locked: full; anything else is an error
                raise
            # The server's hint follows the slots' average occupancy (up to 30 s); a dead holder
            # is found only by trying again, so never wait longer than POLL_S.
            time.sleep(min(float(e.response.headers.get("Retry-After", POLL_S)), POLL_S))
            continue
        return str(got["lease_id"]) if got.get("limits") else None


def _renew(lease: str, stop: threading.Event) -> None:
    """Renew ``lease`` until ``stop``; a failed renewal is logged and retried (the stage goes on:
    the limit guards the machine's load, never correctness)."""
    from prefect.client.orchestration import get_client

    if stop.wait(RENEW_S):  # most stages end before a renewal is due: no client at all
        return
    with get_client(sync_client=True) as c:
        while True:
            try:
                c.renew_concurrency_lease(lease_id=uuid.UUID(lease), lease_duration=SLOT_LEASE_S)
            except Exception as e:
                log.warning("could not renew concurrency lease %s: %s", lease, e)
            if stop.wait(RENEW_S):
                return


def _release(lease: str, client: Any = None) -> None:
    from prefect.client.orchestration import get_client

    try:
        if client is not None:
            client.release_concurrency_slots_with_lease(lease_id=uuid.UUID(lease))
            return
        with get_client(sync_client=True) as c:
            c.release_concurrency_slots_with_lease(lease_id=uuid.UUID(lease))
    except Exception as e:  # the lease runs out by itself within SLOT_LEASE_S
        log.warning("could not release concurrency lease %s: %s", lease, e)


class _Holders:
    """This machine's holders of limit ``name``: one file per lease, named by its id, holding the
    holder's pid and that process's start time (so a reused pid is not taken for the holder).

    The files live in the machine's temporary folder, per API server and limit: only processes
    of this machine read them, and a pid means something only here."""

    def __init__(self, name: str) -> None:
        import hashlib
        import tempfile

        server = hashlib.sha1(os.environ.get("PREFECT_API_URL", "").encode()).hexdigest()[:12]
        self.dir = os.path.join(tempfile.gettempdir(), f"ckptflow-slots-{os.getuid()}", server, name)

    def add(self, lease: str) -> None:
        os.makedirs(self.dir, exist_ok=True)
        tmp = os.path.join(self.dir, f".{lease}.tmp")
        with open(tmp, "w") as f:
            f.write(f"{os.getpid()} {_started(os.getpid())}")
        os.replace(tmp, os.path.join(self.dir, lease))

    def remove(self, lease: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.dir, lease))

    def reap(self, client: Any) -> list[str]:
        """Release the slot of every holder here whose process is gone; the leases released."""
        try:
            names = [n for n in os.listdir(self.dir) if not n.startswith(".")]
        except FileNotFoundError:
            return []
        reaped = []
        for lease in names:
            path = os.path.join(self.dir, lease)
            try:
                with open(path) as f:
                    pid, started = f.read().split()
            except (OSError, ValueError):
                continue  # being written, or taken by another reaper
            if _started(int(pid)) == started:
                continue  # alive
            claim = os.path.join(self.dir, f".{lease}.reaping-{os.getpid()}")
            try:
                os.rename(path, claim)  # one reaper per dead holder: the server's release is not atomic
            except FileNotFoundError:
                continue
            _release(lease, client)
            os.unlink(claim)
            log.warning("released the %s slot of pid %s, which died holding it", os.path.basename(self.dir), pid)
            reaped.append(lease)
        return reaped


def _started(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot), or ``"gone"``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return "gone"
    # Fields 3 and 22 (state, start time); the command name (field 2) may hold spaces, so count
    # from its closing paren. A zombie is dead: it holds nothing, its parent just has not reaped it.
    fields = stat[stat.rindex(")") + 2 :].split()
    return "gone" if fields[0] in ("Z", "X") else fields[19]
