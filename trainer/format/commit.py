"""The commit protocol on a local (hot) tier, and reading what it left behind.

Call order for one checkpoint of step N (coordinator = rank 0):

1. all ranks   DCP writes shards and ``.metadata`` into ``step_N.tmp/``; files fsynced
2. all ranks   each hashes the files it wrote; gathered to the coordinator
3. coordinator ``manifest.json`` written into ``step_N.tmp/`` and fsynced
4. coordinator rename ``step_N.tmp`` -> ``step_N``, fsync the run dir   <- commit point (``atomicity.RENAME``)
5. coordinator ``latest`` replaced atomically (write, fsync, rename, fsync)
6. coordinator outbox line appended (fsync), then the event is sent in the background

A crash before 4 leaves a ``.tmp`` dir, never trusted; ``latest`` moves only after 4, so it always names a complete
checkpoint. What a crash at each point leaves: docs/architecture.md, "The commit protocol and what a crash leaves".
"""

from __future__ import annotations

import logging
import os

from ckptflow.trainer import faults
from ckptflow.trainer.errors import IntegrityError
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.atomicity import RENAME, retire_records
from ckptflow.trainer.format.manifest import Manifest
from ckptflow.trainer.fsutil import remove_tree, replace_atomic, write_durable
from ckptflow.trainer.safeopen import read_small

__all__ = [
    "clean_stale_tmp",
    "commit_checkpoint",
    "committed_steps",
    "is_quarantined",
    "read_latest",
    "rename_then_latest",
    "set_aside",
    "set_aside_steps",
    "write_latest",
]


log = logging.getLogger(__name__)


def commit_checkpoint(run_path: str, manifest: Manifest) -> str:
    """Steps 3-5 above for a ``.tmp`` dir whose files are all written. Returns the final dir."""
    step = manifest.step
    tmp = RENAME.staging_url(run_path, step)
    final = os.path.join(run_path, layout.step_name(step))
    write_durable(os.path.join(tmp, layout.MANIFEST), manifest.to_json())
    faults.maybe_crash("after_manifest", step)
    rename_then_latest(run_path, step)
    return final


def rename_then_latest(run_path: str, step: int) -> None:
    """Steps 4-5 above, for a ``.tmp`` dir holding its manifest: the rename (the commit point), then ``latest``.
    Also a node's commit point on node-local roots (``trainer/nodes/twolevel.py``, phase 8)."""
    tmp = RENAME.staging_url(run_path, step)
    if (why := _refused_copy(run_path, step)) is not None:
        # What holds the step's name is one no resume would take (a symlink; quarantined, damaged, a manifest
        # this process cannot trust): the new save of the step replaces it, the old one set aside and kept.
        set_aside(run_path, step, [why], found_by="commit")
    if not RENAME.is_committed(run_path, step):
        retire_records(run_path, step)  # records of an earlier copy of this step, no longer committed
    if RENAME.is_committed(run_path, step):
        # A re-run of a step an earlier attempt committed and that still checks out: the committed dir is
        # immutable (a lifecycle flow may be reading it), so drop the duplicate.
        log.warning(
            "%s already committed; discarding the duplicate save in %s",
            layout.join(run_path, layout.step_name(step)),
            tmp,
        )
        remove_tree(tmp)
    else:
        RENAME.commit(run_path, step)  # <- the commit point
    faults.maybe_crash("after_rename", step)
    named = read_latest(run_path)
    if named is None or step >= named or not RENAME.is_committed(run_path, named):
        write_latest(run_path, step)
    else:  # a commit never moves `latest` back (adopting an older step); a resume repairs it to where it went on
        log.info("%s committed; 'latest' keeps naming the newer step %d", layout.step_name(step), named)
    faults.maybe_crash("after_latest", step)


def _refused_copy(run_path: str, step: int) -> str | None:
    """Why what holds ``step``'s name is not a copy a resume would take (a symlink; cheap checks of a committed
    copy: quarantine, the manifest read and authenticated for this step, every file there at its size), or
    None (nothing there, or a copy that checks out)."""
    from ckptflow.trainer.verify import files_present, verify_checkpoint

    path = layout.join(run_path, layout.step_name(step))
    if os.path.islink(path):
        return "a symlink under the step's name, not a folder ckptflow committed"
    if not RENAME.is_committed(run_path, step):
        return None
    if is_quarantined(run_path, step):
        return "quarantined by the lifecycle's verify stage"
    res = verify_checkpoint(path, only=[], expect=(os.path.basename(run_path), step))
    problems = res.problems or (files_present(path, res.manifest, part=True) if res.manifest else [])
    return "; ".join(str(p) for p in problems) or None


def set_aside(run_path: str, step: int, reasons: list[str], *, found_by: str) -> str | None:
    """Damaged means no longer committed (``atomicity``): move step ``step`` of this local run under
    ``_damaged/``, with its stage records and a note of ``reasons``; returns where (None: not committed)."""
    where = RENAME.set_aside(run_path, step, {"found_by": found_by, "reasons": reasons})
    if where is not None:
        log.warning(
            "%s is damaged (%s); set aside as %s: no longer committed, kept for inspection",
            layout.join(run_path, layout.step_name(step)),
            "; ".join(reasons)[:500],
            where,
        )
    return where


def set_aside_steps(run_path: str) -> list[str]:
    """What ``_damaged/`` holds for this local run (names; [] if nothing was ever set aside)."""
    try:
        names = os.listdir(os.path.join(run_path, layout.DAMAGED_DIR))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return layout.set_aside_entries(names)


def write_latest(run_path: str, step: int) -> None:
    replace_atomic(os.path.join(run_path, layout.LATEST), (layout.step_name(step) + "\n").encode())


def read_latest(run_path: str) -> int | None:
    """The step ``latest`` names, or None if absent or unreadable (never trusted blindly)."""
    try:
        return layout.parse_step(read_small(os.path.join(run_path, layout.LATEST), 64).decode().strip())
    except (OSError, UnicodeDecodeError, IntegrityError):  # missing, a FIFO, a device, garbage
        return None


def committed_steps(run_path: str) -> list[int]:
    """Steps of committed checkpoints on this local tier, newest first (``trainer.atomicity``)."""
    return RENAME.committed_steps(run_path)


def is_quarantined(run_path: str, step: int) -> bool:
    """The lifecycle's verify stage found this checkpoint bad: never resume from it."""
    return os.path.exists(layout.quarantine_record(run_path, step))


def clean_stale_tmp(run_path: str) -> list[str]:
    """Remove ``step_*.tmp`` dirs left by crashed saves. Call before any save starts."""
    removed: list[str] = []
    try:
        names = os.listdir(run_path)
    except FileNotFoundError:
        return removed
    for n in names:
        if layout.parse_tmp_step(n) is not None:
            path = os.path.join(run_path, n)
            try:
                remove_tree(path)
                removed.append(path)
            except OSError as e:  # leave it; it is never trusted, retry next start
                log.warning("could not remove stale %s: %s", path, e)
    if removed:
        log.info("removed %d stale .tmp checkpoint dir(s): %s", len(removed), removed)
    return removed
