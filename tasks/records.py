"""Write-once lifecycle stage records: ``<hot run>/_lifecycle/step_N/<stage>.json``.

A stage writes its record only after its work is durable, and never rewrites it: the
record is created under a temporary name and *linked* into place, which fails if a
record already exists (an atomic create-if-absent on POSIX file systems). A stage
that finds its record skips its work, which is what makes re-running a lifecycle —
or running it after a crash half-way — converge to the same result.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

from ckptflow.trainer import layout
from ckptflow.trainer.fsutil import fsync_dir, write_durable

STAGES = ("verified", "compressed", "promoted", "archived", "pruned")
QUARANTINED = "quarantined"


def record_path(run_path: str, step: int, stage: str) -> str:
    return layout.stage_record(run_path, step, stage)


def read_record(run_path: str, step: int, stage: str) -> dict[str, Any] | None:
    try:
        with open(record_path(run_path, step, stage), encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError):
        # Records are linked into place complete, so this is outside damage: treat it
        # as absent so the stage re-runs (stages are idempotent) rather than trusting it.
        return None


def write_record(run_path: str, step: int, stage: str, data: dict[str, Any]) -> dict[str, Any]:
    """Create the record if absent; return the record that is now in place."""
    path = record_path(run_path, step, stage)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    body = dict(data, stage=stage, step=step, recorded_at=time.time())
    tmp = f"{path}.{uuid.uuid4().hex}.part"
    write_durable(tmp, (json.dumps(body, indent=1, sort_keys=True, default=str) + "\n").encode())
    try:
        os.link(tmp, path)  # fails with FileExistsError if another run got there first
        fsync_dir(os.path.dirname(path))
        return body
    except FileExistsError:
        existing = read_record(run_path, step, stage)
        return existing if existing is not None else body
    finally:
        os.unlink(tmp)


def write_side_file(run_path: str, step: int, name: str, data: Any) -> str:
    """A companion file next to the records (stats, expectation results); replaced freely."""
    from ckptflow.trainer.fsutil import replace_atomic

    path = os.path.join(layout.lifecycle_dir(run_path, step), name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    replace_atomic(path, (json.dumps(data, indent=1, default=str) + "\n").encode())
    return path


def read_side_file(run_path: str, step: int, name: str) -> Any | None:
    try:
        with open(os.path.join(layout.lifecycle_dir(run_path, step), name), encoding="utf-8") as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def quarantine(run_path: str, step: int, reasons: list[str], details: dict[str, Any] | None = None) -> dict:
    """Mark a checkpoint bad: never promoted, and the trainer's resume skips it."""
    return write_record(run_path, step, QUARANTINED, {"reasons": reasons, "details": details or {}})


def status(run_path: str, step: int) -> dict[str, dict[str, Any]]:
    """Every record present for a step (stage -> record)."""
    return {s: r for s in (*STAGES, QUARANTINED) if (r := read_record(run_path, step, s)) is not None}


def steps_with_records(run_path: str) -> list[int]:
    try:
        names = os.listdir(os.path.join(run_path, layout.LIFECYCLE_DIR))
    except FileNotFoundError:
        return []
    return sorted(s for n in names if (s := layout.parse_step(n)) is not None)


# ---- liveness of a running lifecycle ---------------------------------------------------
# A lifecycle whose process died (SIGKILL, a lost node) stays RUNNING on the Prefect
# server: nothing is left to report its end. Reconcile must tell that apart from one
# that is working, or it would leave the checkpoint alone forever. The running flow
# keeps a heartbeat file beside the records; a beat from a process that no longer
# exists on this host, or one older than STALE_AFTER_S, means the run is dead.

HEARTBEAT = "running.json"
BEAT_EVERY_S = 10.0
STALE_AFTER_S = 60.0


def _proc_start(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]  # starttime: tells a reused pid apart
    except (OSError, IndexError):
        return None


def read_heartbeat(run_path: str, step: int) -> dict[str, Any] | None:
    return read_side_file(run_path, step, HEARTBEAT)


def heartbeat_alive(beat: dict[str, Any] | None, *, now: float | None = None,
                    stale_after_s: float = STALE_AFTER_S) -> bool:
    if not beat:
        return False
    import socket

    if beat.get("host") == socket.gethostname():
        start = _proc_start(int(beat.get("pid", -1)))
        if start is None or start != beat.get("proc_start"):
            return False  # the process is gone (or its pid was reused): dead now, no wait
    return (now or time.time()) - float(beat.get("updated_at", 0)) < stale_after_s


class Heartbeat:
    """Context manager: beat every ``BEAT_EVERY_S`` from a daemon thread, clear on exit."""

    def __init__(self, run_path: str, step: int, owner: dict[str, Any]) -> None:
        import socket
        import threading

        self.run_path, self.step = run_path, step
        self.body = dict(owner, host=socket.gethostname(), pid=os.getpid(), proc_start=_proc_start(os.getpid()))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ckptflow-beat-{step}", daemon=True)

    def _beat(self) -> None:
        try:
            write_side_file(self.run_path, self.step, HEARTBEAT, dict(self.body, updated_at=time.time()))
        except OSError:
            pass  # a missed beat only makes the run look older; never fail the lifecycle for it

    def _run(self) -> None:
        while not self._stop.wait(BEAT_EVERY_S):
            self._beat()

    def __enter__(self) -> "Heartbeat":
        self._beat()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            os.unlink(os.path.join(layout.lifecycle_dir(self.run_path, self.step), HEARTBEAT))
        except OSError:
            pass
