"""``trainer/reference/threadcpu.py``: the CPU of threads started since a snapshot, which the
end-to-end benchmark reads as what saves took beside training."""

from __future__ import annotations

import threading
import time

from ckptflow.trainer.reference import threadcpu


def _burn(seconds: float, go: threading.Event | None = None, burnt: threading.Event | None = None) -> None:
    if go is not None:
        go.wait()
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass
    if burnt is not None:
        burnt.set()


def test_counts_the_threads_started_since_the_snapshot_and_only_those():
    go, burnt, end = threading.Event(), threading.Event(), threading.Event()

    def old_thread() -> None:  # alive at both snapshots (as gloo's workers are), busy between
        _burn(0.3, go, burnt)
        end.wait()

    old = threading.Thread(target=old_thread)
    old.start()
    before = threadcpu.snapshot()
    go.set()
    _burn(0.3)  # the calling thread: there at the snapshot too
    new = threading.Thread(target=_burn, args=(0.4,))  # started and ended since
    new.start()
    new.join()
    assert burnt.wait(30)
    got = threadcpu.started_since(before)
    end.set()
    old.join()
    # 0.4 s of the new thread; the other 0.6 s belong to threads the snapshot saw. /proc counts
    # in clock ticks (10 ms), so allow a few.
    assert 0.35 < got < 0.5, got
