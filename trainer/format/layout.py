"""The one module that owns on-disk (and on-bucket) names.

Every tier stores a run the same way::

    <tier-root>/<run_id>/
      latest                       name of the newest committed step dir (hot/warm)
      step_000000500/              committed, never modified afterwards
        .metadata  __0_0.distcp …  DCP's own files
        manifest.json              the trainer's checksummed manifest (written last)
        tier.json                  a tier's own index of stored objects (warm/cold)
        _COMMITTED                 commit marker (object stores, which cannot rename)
      step_000000500.tmp/          in progress or crashed: never trusted, cleaned
      _outbox.jsonl                one line per commit, before the event is sent
      _lifecycle/step_000000500/   write-once stage records (verified.json, …)
      _pins/step_000000500         pinned: prune never deletes it
      _leases/<step>.<id>.json     a reader (restore, drill) holds this checkpoint
      _damaged/step_000000500.<t>/ a checkpoint found damaged, set aside (no longer committed), kept to inspect
      metrics.jsonl                the reference job's per-step loss and lr

Paths are plain "/"-joined strings, so ``s3://bucket/prefix`` keeps its ``//`` and the same helpers serve
local folders and object stores (fsspec).
"""

from __future__ import annotations

import re

from ckptflow.trainer.errors import ConfigError, UnsafePathError

__all__ = [
    "COMMIT_MARKER",
    "DAMAGED_DIR",
    "DCP_METADATA",
    "EXPECTATIONS",
    "HEARTBEAT",
    "LATEST",
    "LEASES_DIR",
    "LIFECYCLE_DIR",
    "MANIFEST",
    "METRICS",
    "NODE_ID",
    "OUTBOX",
    "PARTS_DIR",
    "PINS_DIR",
    "QUARANTINE_RECORD",
    "SCOPE_DIR",
    "SET_ASIDE_NOTE",
    "STATS",
    "STEP_DIGITS",
    "STEP_PREFIX",
    "TIER_MANIFEST",
    "TMP_SUFFIX",
    "check_member_name",
    "check_run_id",
    "join",
    "lifecycle_dir",
    "parse_step",
    "parse_tmp_step",
    "pin_path",
    "parse_set_aside",
    "quarantine_record",
    "run_dir",
    "set_aside_entries",
    "set_aside_name",
    "stage_record",
    "step_dir",
    "step_name",
    "tmp_name",
]


STEP_PREFIX = "step_"
STEP_DIGITS = 9
TMP_SUFFIX = ".tmp"
MANIFEST = "manifest.json"
TIER_MANIFEST = "tier.json"
COMMIT_MARKER = "_COMMITTED"
LATEST = "latest"
OUTBOX = "_outbox.jsonl"
LIFECYCLE_DIR = "_lifecycle"
PINS_DIR = "_pins"
LEASES_DIR = "_leases"
METRICS = "metrics.jsonl"
DCP_METADATA = ".metadata"
QUARANTINE_RECORD = "quarantined.json"
HEARTBEAT = "running.json"
"""Beside the stage records: a lifecycle that is running says so (``tasks/heartbeat.py``)."""
STATS = "stats.json"
"""Beside the records: per-tensor statistics of a verified checkpoint (the expectations)."""
EXPECTATIONS = "expectations.json"
"""Beside the records: the expectation suite's result for a step."""
NODE_ID = "_node.json"
"""At a tier root on a node's own disk: that disk's node id (``trainer/nodes/topology.py``)."""
PARTS_DIR = "parts"
"""Beside a step's stage records on warm: each node's report of its staged part (node-local roots)."""
SCOPE_DIR = "_scope"
"""In a run dir: the tokens ranks leave to find out which of them share the hot root."""
DAMAGED_DIR = "_damaged"
"""In a run dir: checkpoints found damaged, set aside (``atomicity``: damaged means no longer committed)."""
SET_ASIDE_NOTE = "set_aside.json"
"""In a set-aside checkpoint's folder (or, on an object store, beside it): who set it aside, when, and why."""

_STEP_RE = re.compile(rf"^{STEP_PREFIX}(\d{{{STEP_DIGITS}}})$")
_TMP_RE = re.compile(rf"^{STEP_PREFIX}(\d{{{STEP_DIGITS}}}){re.escape(TMP_SUFFIX)}$")
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_RESERVED_RUN_IDS = frozenset({LATEST, METRICS, "interval.jsonl"})
_RESERVED_RUN_RE = re.compile(rf"^{STEP_PREFIX}\d{{{STEP_DIGITS}}}(\..*)?$")  # a step, its .tmp or .deleting


def join(*parts: str) -> str:
    """Join path parts with "/" without collapsing a scheme's ``//``."""
    out = str(parts[0]).rstrip("/") if parts else ""
    for p in parts[1:]:
        p = str(p).strip("/")
        if p:
            out = f"{out}/{p}" if out else p
    return out


def check_run_id(run_id: str) -> str:
    """A run id becomes a folder and an S3 prefix: keep it to a safe alphabet, and off the names a run's own
    folder holds (``latest``, ``step_N``…): a run called ``latest`` makes its tier root look like a run folder,
    one called ``step_000000001`` like a damaged step."""
    if not isinstance(run_id, str) or not _RUN_ID_RE.match(run_id) or ".." in run_id:
        raise ConfigError(
            f"run_id {run_id!r} is not allowed: use 1-128 characters from "
            "[A-Za-z0-9._-], starting with a letter or digit, without '..'"
        )
    if run_id in _RESERVED_RUN_IDS or _RESERVED_RUN_RE.match(run_id):
        raise ConfigError(
            f"run_id {run_id!r} is not allowed: it is a name ckptflow uses inside a run's folder "
            f"({', '.join(sorted(_RESERVED_RUN_IDS))}, step_<{STEP_DIGITS} digits>); choose another run id"
        )
    return run_id


def step_name(step: int) -> str:
    if not isinstance(step, int) or step < 0 or step >= 10**STEP_DIGITS:
        raise ConfigError(f"step {step!r} must be an integer in [0, {10**STEP_DIGITS})")
    return f"{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def tmp_name(step: int) -> str:
    return step_name(step) + TMP_SUFFIX


def parse_step(name: str) -> int | None:
    """Step number of a committed step directory name, else None (tmp dirs included)."""
    m = _STEP_RE.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def parse_tmp_step(name: str) -> int | None:
    m = _TMP_RE.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def set_aside_name(step: int, stamp: str) -> str:
    """A set-aside checkpoint's name under ``_damaged/``: the step's name, a dot, and when (UTC, unique)."""
    return f"{step_name(step)}.{stamp}"


def parse_set_aside(name: str) -> int | None:
    """The step of a name under ``_damaged/`` (a set-aside checkpoint or its note), else None."""
    base = name.rstrip("/").rsplit("/", 1)[-1]
    head, dot, _ = base.partition(".")
    return parse_step(head) if dot else None


def set_aside_entries(names: list[str]) -> list[str]:
    """The set-aside checkpoints among the names in a ``_damaged/`` folder: not its retired records, not the
    note beside a set-aside symlink (a note cannot go inside one)."""
    return sorted(
        n for n in names if parse_set_aside(n) is not None and not (n.endswith(".json") and n[: -len(".json")] in names)
    )


def run_dir(root: str, run_id: str) -> str:
    return join(root, check_run_id(run_id))


def step_dir(root: str, run_id: str, step: int) -> str:
    return join(run_dir(root, run_id), step_name(step))


def lifecycle_dir(run_path: str, step: int) -> str:
    return join(run_path, LIFECYCLE_DIR, step_name(step))


def stage_record(run_path: str, step: int, stage: str) -> str:
    return join(lifecycle_dir(run_path, step), f"{stage}.json")


def quarantine_record(run_path: str, step: int) -> str:
    return join(lifecycle_dir(run_path, step), QUARANTINE_RECORD)


def pin_path(run_path: str, step: int) -> str:
    return join(run_path, PINS_DIR, step_name(step))


def check_member_name(name: str) -> str:
    """Validate a file name listed in a manifest or tier index: relative, "/"-separated, inside the checkpoint
    (no absolute paths, ``..``, empty or ``.`` components, backslashes or NULs). A manifest is data from
    storage; trusting its names would let an edited one make a restore write (or a prune delete) outside."""
    bad = (
        not isinstance(name, str)
        or not name
        or name.startswith("/")
        or "\\" in name
        or "\x00" in name
        or re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", name) is not None  # URL schemes, C:
    )
    if not bad:
        parts = name.split("/")
        bad = any(p in ("", ".", "..") for p in parts)
    if bad:
        raise UnsafePathError(
            f"unsafe file name {name!r} in a checkpoint index: names must be relative "
            "and stay inside the checkpoint directory; the manifest was edited or "
            "corrupted, do not use this checkpoint",
            path=str(name),
        )
    return name
