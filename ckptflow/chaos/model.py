"""What a trial is and what it found; the campaign totals are computed from these alone.

A trial injects one kind of fault into a scratch copy of the storage tiers, then checks
invariants with ckptflow's real code paths. It reports, in plain fields:

* ``injected``   how many faults actually happened (a kill that was never reached is 0;
                 an S3 trial counts every request the proxy broke);
* ``undetected`` damage or partial state that some reader trusted (a committed half
                 checkpoint, a record written before its work was durable, an unclean
                 exception that hid what failed);
* ``lost``       checkpoints that should exist and exist on no tier in a form that verifies;
* ``violations`` any other broken promise (resume not exact, restore returned bad bytes,
                 training stalled, work done twice, an unclean exception);
* ``findings``   weaknesses that lose nothing and hide nothing but should be fixed (an
                 error that does not say the disk is full); reported, not failing;
* ``recovered``  the checked recovery (resume, re-running the stage, restore) finished;
* ``recovery_s`` how long that recovery took, wall clock.

A trial passes when it injected nothing, or when it detected, recovered, lost nothing
and broke nothing. ``error`` is for the harness itself failing (a server that did not
start): such a trial proves nothing and fails the campaign too.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

KINDS = ("kill", "corrupt", "s3", "prefect", "enospc", "net")
DEFAULT_KINDS = tuple(k for k in KINDS if k != "net")
"""Every kind but ``net``, which needs root: it runs nodes in network namespaces of their own."""


@dataclass(frozen=True, slots=True)
class TrialPlan:
    index: int
    kind: str
    seed: int
    params: dict[str, Any]
    """Chosen up front from the campaign seed, so a campaign is replayable trial by trial."""


@dataclass(slots=True)
class TrialResult:
    index: int
    kind: str
    fault: str
    """Short label of what was injected, e.g. ``SIGKILL at archive.uploaded@6``."""
    params: dict[str, Any] = field(default_factory=dict)
    injected: int = 0
    recovered: bool = False
    recovery_s: float | None = None
    undetected: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Observations that break no promise (garbage left for reconcile to clean, timings)."""
    detail: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    seconds: float = 0.0
    workdir: str | None = None
    """Kept on failure for a post-mortem; None when cleaned up."""

    @property
    def detected(self) -> bool:
        return self.injected > 0 and not self.undetected

    @property
    def ok(self) -> bool:
        if self.error:
            return False
        if not self.injected:
            return not (self.lost or self.violations or self.undetected)
        return self.detected and self.recovered and not self.lost and not self.violations

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), detected=self.detected, ok=self.ok)


@dataclass(slots=True)
class KindSummary:
    kind: str
    trials: int = 0
    faults: int = 0
    """Faults injected (kill/corrupt/enospc/prefect: one per trial that reached it; s3: requests)."""
    faulted_trials: int = 0
    detected: int = 0
    recovered: int = 0
    lost: int = 0
    undetected: int = 0
    violations: int = 0
    findings: int = 0
    errors: int = 0
    not_injected: int = 0
    longest_recovery_s: float = 0.0
    longest_recovery_trial: int | None = None
    by_fault: Counter = field(default_factory=Counter)

    def add(self, r: TrialResult) -> None:
        self.trials += 1
        self.faults += r.injected
        self.by_fault[r.fault.split(" (", 1)[0]] += 1
        if r.error:
            self.errors += 1
        if not r.injected:
            self.not_injected += 1
        else:
            self.faulted_trials += 1
            self.detected += r.detected
            self.recovered += r.recovered
        self.lost += len(r.lost)
        self.undetected += bool(r.undetected)
        self.violations += bool(r.violations)
        self.findings += bool(r.findings)
        if r.recovery_s is not None and r.recovery_s > self.longest_recovery_s:
            self.longest_recovery_s, self.longest_recovery_trial = r.recovery_s, r.index

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["by_fault"] = dict(sorted(self.by_fault.items()))
        return d


def summarize(results: list[TrialResult]) -> dict[str, KindSummary]:
    """Per kind, plus ``total``."""
    out: dict[str, KindSummary] = {}
    total = KindSummary("total")
    for r in results:
        out.setdefault(r.kind, KindSummary(r.kind)).add(r)
        total.add(r)
    ordered = {k: out[k] for k in KINDS if k in out}
    ordered["total"] = total
    return ordered


def campaign_ok(results: list[TrialResult]) -> bool:
    return all(r.ok for r in results)
