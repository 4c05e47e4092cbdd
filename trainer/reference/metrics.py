"""The reference job's per-step metrics: ``<run>/metrics.jsonl``, one JSON line per step.

Rank 0 appends ``{"step", "loss", "lr", "attempt", "t", "wall"}`` after every step, so a
step trained twice (before a failure and after the resume) appears twice, in order.
Everything that reads the file (advise, drill plots, the demo, chaos, tests) reads it here.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ckptflow.trainer.format import layout


def metrics_path(run_path: str) -> str:
    return os.path.join(run_path, layout.METRICS)


def read_metrics(run_path: str) -> list[dict[str, Any]]:
    """Every complete line, in order ([] without a file); a line torn by a kill is skipped."""
    out = []
    try:
        with open(metrics_path(run_path), encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(row, dict) and isinstance(row.get("step"), int):
                    out.append(row)
    except FileNotFoundError:
        pass
    return out


def last_per_step(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The last row of each step (a step re-run after a resume overwrites the first)."""
    return {r["step"]: r for r in rows}
