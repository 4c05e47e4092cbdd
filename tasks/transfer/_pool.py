"""Run one function over items in threads, failing fast.

``ThreadPoolExecutor.map`` submits every item at once and keeps running them after one
has failed; for uploads that means more bytes sent for an archive that is already
lost. Here at most ``workers`` items are in flight, nothing new starts once one has
failed, the running ones are waited for, and the first failure is raised.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def run_all(fn: Callable[[T], R], items: Sequence[T], workers: int, name: str = "ckptflow") -> list[R]:
    """``[fn(x) for x in items]`` on up to ``workers`` threads, results in input order."""
    if not items:
        return []
    workers = max(1, min(workers, len(items)))
    results: list = [None] * len(items)
    failure: BaseException | None = None
    running: dict[Future, int] = {}
    nxt = 0
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name) as ex:
        while running or (nxt < len(items) and failure is None):
            while failure is None and nxt < len(items) and len(running) < workers:
                running[ex.submit(fn, items[nxt])] = nxt
                nxt += 1
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for f in done:
                i = running.pop(f)
                if f.exception() is not None:
                    failure = failure or f.exception()
                else:
                    results[i] = f.result()
    if failure is not None:
        raise failure
    return results
