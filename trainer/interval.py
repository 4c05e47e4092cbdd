"""``CheckpointConfig(interval="auto")``: the trainer picks its save interval from what it measures.

Per rank, from the ``save(step)`` calls: the step time (between calls without a save), the stall (the extra time of
the step after a save) and the persist time (save to committed). At each save it is due to make, the ranks all-gather
these and take the largest of each, so all compute the same interval: ``optimum.exact_interval`` in whole steps,
never fewer than one save in flight allows, within ``[auto_min_interval, auto_max_interval]``. A change over
:data:`CHANGE` (or forced by that floor) is applied and logged by rank 0, also to :data:`INTERVAL_LOG`. See
docs/architecture.md, "Goodput and the interval".
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from ckptflow.trainer.distenv import gather
from ckptflow.trainer.optimum import availability, exact_interval

__all__ = ["AutoInterval", "CHANGE", "Decision", "INTERVAL_LOG", "MIN_STALL_S", "Measured"]


log = logging.getLogger(__name__)

INTERVAL_LOG = "interval.jsonl"
MIN_STALL_S = 1e-4
CHANGE = 0.10


@dataclass(frozen=True, slots=True)
class Measured:
    step_s: float | None
    stall_s: float | None
    persist_s: float | None


@dataclass(frozen=True, slots=True)
class Decision:
    step: int
    old: int
    new: int
    reason: str
    step_s: float
    stall_s: float
    persist_s: float
    mtbf_s: float
    optimum_s: float
    expected_effective: float


class AutoInterval:
    """One rank's interval planner: ``tick`` on every ``save()`` call, ``due`` to decide, ``plan`` (collective)
    right before a save it is due to make, ``saved`` after it."""

    def __init__(
        self,
        *,
        mtbf_s: float,
        first: int,
        min_steps: int = 1,
        max_steps: int = 1_000_000,
        rank: int = 0,
        world: int = 1,
        group: Any = None,
        run_path: str | None = None,
    ) -> None:
        self.mtbf_s, self.min_steps, self.max_steps = mtbf_s, min_steps, max_steps
        self.restore_s = 0.0
        """The last resume's seconds (set by the manager after its load): the restart cost in ``expected_effective``."""
        self.rank, self.world, self.group, self.run_path = rank, world, group, run_path
        self.interval = min(max(first, min_steps), max_steps)
        self.next_due = self.interval
        self.decisions: list[Decision] = []
        self._plain: deque[float] = deque(maxlen=64)
        self._after: deque[float] = deque(maxlen=16)
        self._last: tuple[int, float] | None = None
        self._saved_at: int | None = None
        self._warned = False

    def tick(self, step: int, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        if self._last is not None and step == self._last[0] + 1:
            d = now - self._last[1]
            (self._after if self._saved_at == self._last[0] else self._plain).append(d)
        self._last = (step, now)

    def start_at(self, step: int) -> None:
        """Resumed (or started) at ``step``: the first save is one interval after it."""
        self.next_due = step + self.interval
        self._last = None

    def due(self, step: int) -> bool:
        return step >= self.next_due

    def measured(self, timings: list[Any]) -> Measured:
        step_s = statistics.median(self._plain) if self._plain else None
        stall = None
        if step_s is not None and self._after:
            stall = max(MIN_STALL_S, statistics.median(self._after) - step_s)
        done = [t.committed_s for t in timings[-8:] if getattr(t, "committed_s", 0.0) > 0]
        return Measured(step_s, stall, statistics.median(done) if done else None)

    def plan(self, step: int, timings: list[Any]) -> Decision | None:
        mine = self.measured(timings)
        every = gather(asdict(mine), self.group) if self.world > 1 else [asdict(mine)]
        agreed = {k: _max(e[k] for e in every) for k in ("step_s", "stall_s", "persist_s")}
        d = self._decide(step, agreed["step_s"], agreed["stall_s"], agreed["persist_s"])
        if d is not None:
            self.interval = d.new
            self.decisions.append(d)
            if self.rank == 0:
                log.info("checkpoint interval %d -> %d steps at step %d: %s", d.old, d.new, d.step, d.reason)
                self._record(d)
        return d

    def saved(self, step: int) -> None:
        self._saved_at = step
        self.next_due = step + self.interval

    def _decide(
        self, step: int, step_s: float | None, stall_s: float | None, persist_s: float | None
    ) -> Decision | None:
        if step_s is None or stall_s is None:
            if step_s is None and not self._warned and self.rank == 0 and self._saved_at is not None:
                self._warned = True
                log.warning(
                    "interval=auto measures the step time between consecutive save() calls; none seen "
                    "yet, so the interval stays %d (call save(step) after every step)",
                    self.interval,
                )
            return None
        persist = persist_s if persist_s is not None else stall_s
        opt = exact_interval(stall_s, self.mtbf_s)
        want = max(1, round(opt / step_s))
        floor = max(1, math.ceil(max(0.0, persist - stall_s) / step_s))
        new = min(max(want, floor, self.min_steps), self.max_steps)
        old = self.interval
        forced = old < floor <= new
        if new == old or (not forced and abs(new - old) <= CHANGE * old):
            return None
        why = [
            f"step {step_s * 1e3:.3g} ms, stall {stall_s * 1e3:.3g} ms, persist {persist * 1e3:.4g} ms, "
            f"MTBF {self.mtbf_s / 3600:.3g} h: the optimum is {opt:.3g} s of training = {want} steps"
        ]
        if new == floor and floor > want:
            why.append(f"raised to {floor} steps so a save is durable before the next is due (one in flight)")
        if new == self.min_steps and self.min_steps > max(want, floor):
            why.append(f"raised to auto_min_interval={self.min_steps}")
        if new == self.max_steps and self.max_steps < max(want, floor):
            why.append(f"capped at auto_max_interval={self.max_steps}")
        eff = availability(new * step_s, stall_s, self.restore_s, self.mtbf_s)
        return Decision(step, old, new, "; ".join(why), step_s, stall_s, persist, self.mtbf_s, opt, eff)

    def _record(self, d: Decision) -> None:
        if not self.run_path:
            return
        try:
            with open(os.path.join(self.run_path, INTERVAL_LOG), "a", encoding="utf-8") as f:
                f.write(json.dumps(asdict(d)) + "\n")
        except OSError as e:  # a log line is not worth stopping training for
            log.warning("could not record the interval change in %s: %s", self.run_path, e)


def _max(values: Any) -> float | None:
    got = [v for v in values if v is not None]
    return max(got) if got else None
