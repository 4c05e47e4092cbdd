"""The CPU priority of a save's background threads: training first.

A save's persist (DCP's planning, the writer, fsync) and its commit (hashing, manifest, the
gather on rank 0) run on threads beside the training loop. Where the host has idle cores, as a
GPU node has, that costs training nothing. Where it has none (the 2 ranks of a 2-core job here,
or a host whose data loaders fill every core), every CPU-second they take at normal priority is
taken from a rank, and the other ranks then wait for that one at the next collective.

Linux schedules threads, not processes, so the calling thread alone is lowered; the threads it
starts afterwards (the writer's per-file threads) inherit its setting. The staging copy is not
lowered: the next ``optimizer.step`` waits for it.

Why this cannot starve a save for long: the next save's ``wait()`` blocks the training thread
until the previous save has committed, and a blocked training loop stops consuming its data
loaders' batches, so their workers block too. The cost is the durability window: on a host
with no spare CPU the commit lands later (up to the next save), never later than that.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

PRIORITIES = ("normal", "low", "idle")
"""``normal``: as the training thread. ``low``: nice 19 (a ~1.5 % share against each busy
training thread). ``idle``: Linux ``SCHED_IDLE``: only CPU no other thread wants, and a waking
training thread preempts it at once."""

LOW_NICE = 19


def check(priority: str) -> str:
    """``priority`` if it is one of ``PRIORITIES``; otherwise a ValueError that lists them."""
    if priority not in PRIORITIES:
        raise ValueError(f"background priority {priority!r} is unknown; choose one of {', '.join(PRIORITIES)}")
    return priority


def lower_this_thread(priority: str) -> bool:
    """Give the calling thread ``priority``; True if it changed.

    Lowering needs no privilege. It cannot be undone without ``CAP_SYS_NICE``, so call it only on
    threads that do nothing but background work. Outside Linux (or if the kernel refuses) the
    thread keeps its priority and a debug line says why.
    """
    if check(priority) == "normal":
        return False
    try:
        if priority == "idle":
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread
        else:
            # On Linux setpriority(PRIO_PROCESS, 0) is per thread (man 2 setpriority, BUGS).
            os.setpriority(os.PRIO_PROCESS, 0, max(LOW_NICE, os.getpriority(os.PRIO_PROCESS, 0)))
        return True
    except (AttributeError, OSError) as e:  # not Linux, or a seccomp profile that forbids it
        log.debug("background priority %s not applied: %r", priority, e)
        return False


def this_thread() -> str:
    """The calling thread's priority as one of ``PRIORITIES`` (tests, diagnostics)."""
    try:
        if os.sched_getscheduler(0) == os.SCHED_IDLE:
            return "idle"
        return "low" if os.getpriority(os.PRIO_PROCESS, 0) > 0 else "normal"
    except (AttributeError, OSError):
        return "normal"
