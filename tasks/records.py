"""Write-once lifecycle stage records: ``<hot run>/_lifecycle/step_N/<stage>.json``.

A stage writes its record only after its work is durable, and never rewrites it: the
record is created under a temporary name and *linked* into place, which fails if a
record already exists (an atomic create-if-absent on POSIX file systems). A stage
that finds its record skips its work, which is what makes re-running a lifecycle —
or running it after a crash half-way — converge to the same result.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

from ckptflow.trainer.errors import IntegrityError
from ckptflow.trainer.format import layout
from ckptflow.trainer.fsutil import fsync_dir, replace_atomic, write_durable
from ckptflow.trainer.safeopen import read_small

_MAX_RECORD = 1 << 20
_MAX_SIDE_FILE = 64 << 20  # per-tensor statistics of a big model

QUARANTINED = "quarantined"
"""The record of a checkpoint the verify stage found bad (the other records' names are the
stages' own: ``ckptflow.tasks.stages``)."""


def record_path(run_path: str, step: int, stage: str) -> str:
    return layout.stage_record(run_path, step, stage)


def read_record(run_path: str, step: int, stage: str) -> dict[str, Any] | None:
    try:
        rec = json.loads(read_small(record_path(run_path, step, stage), _MAX_RECORD))
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError, IntegrityError):
        # Records are linked into place complete, so this is outside damage (or a FIFO, a device, a
        # giant file planted there): treat it as absent so the stage re-runs (stages are idempotent)
        # rather than trusting it.
        return None
    return rec if isinstance(rec, dict) else None


def write_record(run_path: str, step: int, stage: str, data: dict[str, Any]) -> dict[str, Any]:
    """Create the record if absent; return the record that is now in place."""
    path = record_path(run_path, step, stage)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    body = dict(data, stage=stage, step=step, recorded_at=time.time())
    tmp = f"{path}.{uuid.uuid4().hex}.part"
    write_durable(tmp, (json.dumps(body, indent=1, sort_keys=True, default=str) + "\n").encode())
    try:
        os.link(tmp, path)  # fails with FileExistsError if another run got there first
        fsync_dir(os.path.dirname(path))
        return body
    except FileExistsError:
        existing = read_record(run_path, step, stage)
        return existing if existing is not None else body
    finally:
        os.unlink(tmp)


EXECUTIONS = "executions.jsonl"


def log_execution(run_path: str, step: int, stage: str, ok: bool) -> None:
    """One line per stage that actually ran (not skipped by its record): the audit that shows a
    checkpoint was never processed twice (``benchmarks/bench_fleet.py`` counts them)."""
    import socket

    path = os.path.join(layout.lifecycle_dir(run_path, step), EXECUTIONS)
    line = json.dumps({"stage": stage, "ok": ok, "host": socket.gethostname(), "pid": os.getpid(), "at": time.time()})
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (line + "\n").encode())  # one short write with O_APPEND: lines never interleave
        finally:
            os.close(fd)
    except OSError:
        pass  # an audit line is not worth failing a stage for


def read_executions(run_path: str, step: int) -> list[dict[str, Any]]:
    from ckptflow.trainer.events import read_jsonl

    return read_jsonl(os.path.join(layout.lifecycle_dir(run_path, step), EXECUTIONS))


def write_side_file(run_path: str, step: int, name: str, data: Any) -> str:
    """A companion file next to the records (stats, expectation results); replaced freely."""
    path = os.path.join(layout.lifecycle_dir(run_path, step), name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    replace_atomic(path, (json.dumps(data, indent=1, default=str) + "\n").encode())
    return path


def read_side_file(run_path: str, step: int, name: str) -> Any | None:
    try:
        return json.loads(read_small(os.path.join(layout.lifecycle_dir(run_path, step), name), _MAX_SIDE_FILE))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError, IntegrityError):
        return None


def quarantine(run_path: str, step: int, reasons: list[str], details: dict[str, Any] | None = None) -> dict:
    """Mark a checkpoint bad: never promoted, and the trainer's resume skips it."""
    return write_record(run_path, step, QUARANTINED, {"reasons": reasons, "details": details or {}})


def status(run_path: str, step: int, names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """The records of ``names`` present for a step (name -> record), in the order given."""
    return {n: r for n in names if (r := read_record(run_path, step, n)) is not None}


def steps_with_records(run_path: str) -> list[int]:
    try:
        names = os.listdir(os.path.join(run_path, layout.LIFECYCLE_DIR))
    except (FileNotFoundError, NotADirectoryError):  # no records yet, or a "run" that is a stray file
        return []
    return sorted(s for n in names if (s := layout.parse_step(n)) is not None)
