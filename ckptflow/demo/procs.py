"""Starting and stopping the demo's processes reliably.

Every child is started in its own session (``setsid``) and stopped by PID — a worker
started with ``&`` from a non-interactive shell ignored SIGTERM here. ``Supervisor``
remembers what it started and stops all of it on exit, Ctrl-C included.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import IO


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append(int(d))
        except (OSError, IndexError, ValueError):
            continue
    return sorted(out)


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class Supervisor:
    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, args: list[str], *, env: dict | None = None, cwd: str | None = None,
              log: IO | None = None) -> subprocess.Popen:
        p = subprocess.Popen(args, env=env, cwd=cwd, stdout=log or subprocess.DEVNULL,
                             stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
                             start_new_session=True)
        self.procs.append((name, p))
        return p

    def stop(self, p: subprocess.Popen, timeout: float = 10.0) -> None:
        if p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)  # the whole session: torchrun's workers too
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(5)

    def stop_all(self) -> None:
        for _, p in reversed(self.procs):
            self.stop(p)
        self.procs.clear()

    def __enter__(self) -> "Supervisor":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()
