"""Deliberate crashes at named phases, for the commit-protocol tests and ``ckptflow chaos``.

Set ``CKPTFLOW_FAULT`` to ``<phase>[@<step>][:rank<r>][:attempt<a>|attempt*][:sleep<s>]`` (comma-separated
specs) and the process SIGKILLs itself at that phase, like a dead node or the OOM killer: nothing cleans up.
With ``sleep<s>`` it sleeps there instead (a slow disk or network); ``CKPTFLOW_FAULT_MARKS`` names a folder
where the sleep first creates ``<phase>@<step>.rank<r>``, so a harness can act on the wire while the rank is
held (``ckptflow.harness.NetNodes``). Without the variable each call is one dictionary lookup.

Trainer phases, in commit order: ``step`` (end of a training step), ``staging`` (save() returned, the stager
still copying), ``write`` (this rank's DCP writer about to write, in the background), ``shards`` (this rank's
files written, others maybe not), ``after_shards`` (all files written, before the manifest),
``after_manifest`` (manifest durable in the .tmp dir, before the rename), ``after_rename`` (committed, before
``latest``), ``after_latest`` (before the outbox line and event). Lifecycle stages add their own phases, and
adoption (``tasks/adopt.py``) ``adopt.copy`` (after each file copied into the ``.tmp`` folder).

With ``snapshot`` the process lives on: it copies the ``os.pathsep``-separated paths of ``CKPTFLOW_SNAPSHOT_OF``
to ``CKPTFLOW_SNAPSHOT_TO/<phase>/<i>``, exactly what a SIGKILL there would leave, so one run yields a crash
state per phase. Valid only while nothing else writes under those paths meanwhile (where every other rank
waits for this one: a commit coordinator's phases); elsewhere, kill.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from dataclasses import dataclass

__all__ = ["ENV", "MARKS", "FaultSpec", "SNAPSHOT_OF", "SNAPSHOT_TO", "also_kill", "maybe_crash", "parse"]


ENV = "CKPTFLOW_FAULT"
MARKS = "CKPTFLOW_FAULT_MARKS"
SNAPSHOT_OF = "CKPTFLOW_SNAPSHOT_OF"
SNAPSHOT_TO = "CKPTFLOW_SNAPSHOT_TO"


@dataclass(frozen=True, slots=True)
class FaultSpec:
    phase: str
    step: int | None = None
    rank: int | None = None
    attempt: int | None = 0  # by default only the first attempt crashes, so a restart heals
    sleep: float | None = None  # sleep instead of crashing
    snapshot: bool = False  # copy the paths of CKPTFLOW_SNAPSHOT_OF instead of crashing

    def matches(self, phase: str, step: int | None, rank: int, attempt: int) -> bool:
        return (
            self.phase == phase
            and (self.step is None or self.step == step)
            and (self.rank is None or self.rank == rank)
            and (self.attempt is None or self.attempt == attempt)
        )


def parse(text: str) -> list[FaultSpec]:
    specs = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        head, *quals = item.split(":")
        phase, _, step = head.partition("@")
        attempt: int | None
        rank, attempt, sleep, snapshot = None, 0, None, False
        for q in quals:
            if q.startswith("rank"):
                rank = int(q[4:])
            elif q.startswith("attempt"):
                attempt = None if q[7:] == "*" else int(q[7:])
            elif q.startswith("sleep"):
                sleep = float(q[5:])
            elif q == "snapshot":
                snapshot = True
            else:
                raise ValueError(f"{ENV}: unknown qualifier {q!r} in {item!r}")
        specs.append(FaultSpec(phase, int(step) if step else None, rank, attempt, sleep, snapshot))
    return specs


_ALSO_KILL: list[int] = []


def also_kill(pid: int) -> None:
    """A crash here also SIGKILLs ``pid`` first: a fork-server child running a stage for a flow-run process
    (``tasks/forkserver.py``) dies as that process would have."""
    _ALSO_KILL.append(pid)


def maybe_crash(phase: str, step: int | None = None) -> None:
    """SIGKILL this process if ``CKPTFLOW_FAULT`` names this phase (and step/rank/attempt)."""
    text = os.environ.get(ENV)
    if not text:
        return
    rank = int(os.environ.get("RANK", 0))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    for spec in parse(text):
        if spec.matches(phase, step, rank, attempt):
            if spec.sleep is not None:
                marks = os.environ.get(MARKS)
                if marks:
                    with open(os.path.join(marks, f"{phase}@{step}.rank{rank}"), "w"):
                        pass
                time.sleep(spec.sleep)
            elif spec.snapshot:
                _snapshot(phase)
            else:
                for pid in _ALSO_KILL:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                os.kill(os.getpid(), signal.SIGKILL)


def _snapshot(phase: str) -> None:
    """Copy every path of ``CKPTFLOW_SNAPSHOT_OF`` to ``CKPTFLOW_SNAPSHOT_TO/<phase>/<i>``."""
    dest = os.path.join(os.environ[SNAPSHOT_TO], phase)
    for i, src in enumerate(p for p in os.environ[SNAPSHOT_OF].split(os.pathsep) if p):
        shutil.copytree(src, os.path.join(dest, str(i)), symlinks=True)
