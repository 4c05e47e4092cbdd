"""The reference job's per-step metrics: ``<run>/metrics.jsonl``, one JSON line per step.

Rank 0 appends ``{"step", "loss", "lr", "attempt", "t", "wall"}`` after every step, so a
step trained twice (before a failure and after the resume) appears twice, in order.
Everything that reads the file (advise, drill plots, the demo, chaos, tests) reads it here.
"""

from __future__ import annotations

import os
from typing import Any

from ckptflow.trainer.events import read_jsonl
from ckptflow.trainer.format import layout


def metrics_path(run_path: str) -> str:
    return os.path.join(run_path, layout.METRICS)


def read_metrics(run_path: str) -> list[dict[str, Any]]:
    """Every complete line, in order ([] without a file); a line torn by a kill is skipped (read as every
    run-folder record is: a FIFO or device there is refused, never opened)."""
    return [r for r in read_jsonl(metrics_path(run_path)) if isinstance(r.get("step"), int)]


def last_per_step(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The last row of each step (a step re-run after a resume overwrites the first)."""
    return {r["step"]: r for r in rows}
