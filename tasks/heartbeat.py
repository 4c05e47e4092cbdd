"""Liveness of a running lifecycle: a heartbeat file beside the stage records.

A lifecycle whose process died (SIGKILL, a lost node) stays RUNNING on the Prefect
server: nothing is left to report its end. Reconcile must tell that apart from one
that is working, or it would leave the checkpoint alone forever. The running flow
keeps ``<hot run>/_lifecycle/step_N/running.json`` fresh; a beat from a process that no
longer exists on this host, or one older than ``STALE_AFTER_S``, means the run is dead.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

from ckptflow.tasks.records import read_side_file, write_side_file
from ckptflow.trainer import layout

HEARTBEAT = layout.HEARTBEAT
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


def heartbeat_alive(
    beat: dict[str, Any] | None, *, now: float | None = None, stale_after_s: float = STALE_AFTER_S
) -> bool:
    if not beat:
        return False
    if beat.get("host") == socket.gethostname():
        start = _proc_start(int(beat.get("pid", -1)))
        if start is None or start != beat.get("proc_start"):
            return False  # the process is gone (or its pid was reused): dead now, no wait
    return (now or time.time()) - float(beat.get("updated_at", 0)) < stale_after_s


class Heartbeat:
    """Context manager: beat every ``BEAT_EVERY_S`` from a daemon thread, clear on exit."""

    def __init__(self, run_path: str, step: int, owner: dict[str, Any]) -> None:
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

    def __enter__(self) -> Heartbeat:
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
