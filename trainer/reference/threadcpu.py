"""CPU seconds by thread, to tell a save's background work from training's (Linux ``/proc``).

The reference job snapshots every thread's CPU time when its loop starts and again after the
last save. Threads that existed at the start are the training thread and gloo's workers (which
run the collectives: a quarter of a rank's CPU here); the CPU of every thread started later —
staging, DCP's planning and writer, the commit — is what saves took beside training. A run
without saves gets ~0, so the figure needs no second run to subtract, unlike the process total,
whose gloo share varies by more than a save costs.
"""

from __future__ import annotations

import os
import time

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def snapshot() -> tuple[float, dict[int, float]]:
    """(process CPU seconds, {thread id: CPU seconds}) now; no threads outside Linux."""
    threads: dict[int, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        tids = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces and ')'
        except (OSError, IndexError):
            continue  # ended between the listing and the read
        threads[int(tid)] = (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime
    return time.process_time(), threads


def started_since(before: tuple[float, dict[int, float]]) -> float:
    """CPU seconds since ``before`` of the threads started after it (ended ones included)."""
    p0, t0 = before
    p1, t1 = snapshot()
    if not t0:
        return float("nan")
    old = sum(t1.get(tid, cpu) - cpu for tid, cpu in t0.items())
    return max(0.0, (p1 - p0) - old)
