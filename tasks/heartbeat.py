"""Liveness of a running lifecycle: a heartbeat file beside the stage records.

A lifecycle whose process died (SIGKILL, a lost node) stays RUNNING on the Prefect
server: nothing is left to report its end. Reconcile must tell that apart from one
that is working, or it would leave the checkpoint alone forever. The running flow
keeps ``<hot run>/_lifecycle/step_N/running.json`` fresh; a beat from a process that no
longer exists on this host, or one older than ``STALE_AFTER_S``, means the run is dead.

The heartbeat is also the lifecycle's lock: it is created with a hard link (which fails if
the file exists), so of two lifecycles of one checkpoint — the event's run and reconcile's,
racing — exactly one runs the stages and the other sees a live beat and stands down
(:class:`LifecycleBusy`). A dead beat is moved aside (one mover wins the rename) and taken.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

from ckptflow.tasks.records import read_side_file, write_side_file
from ckptflow.trainer.format import layout

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


class LifecycleBusy(RuntimeError):
    """Another live lifecycle holds this checkpoint's heartbeat."""

    def __init__(self, path: str, owner: dict[str, Any] | None) -> None:
        super().__init__(f"{path}: another lifecycle is running this checkpoint ({owner}); standing down")
        self.owner = owner or {}


class Heartbeat:
    """Context manager: take the checkpoint's heartbeat (or raise :class:`LifecycleBusy`), beat
    every ``BEAT_EVERY_S`` from a daemon thread, clear on exit."""

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

    def _acquire(self) -> None:
        import json
        import uuid

        from ckptflow.trainer.fsutil import write_durable

        path = os.path.join(layout.lifecycle_dir(self.run_path, self.step), HEARTBEAT)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        for _ in range(3):
            tmp = f"{path}.{uuid.uuid4().hex}.part"
            write_durable(tmp, (json.dumps(dict(self.body, updated_at=time.time())) + "\n").encode())
            try:
                os.link(tmp, path)
                return
            except FileExistsError:
                beat = read_heartbeat(self.run_path, self.step)
                if heartbeat_alive(beat):
                    raise LifecycleBusy(path, beat) from None
                try:  # dead: move it aside; of several takers one rename succeeds
                    aside = f"{path}.stale.{uuid.uuid4().hex}"
                    os.rename(path, aside)
                    os.unlink(aside)
                except FileNotFoundError:
                    pass
            finally:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        raise LifecycleBusy(path, read_heartbeat(self.run_path, self.step))

    def __enter__(self) -> Heartbeat:
        self._acquire()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            os.unlink(os.path.join(layout.lifecycle_dir(self.run_path, self.step), HEARTBEAT))
        except OSError:
            pass
