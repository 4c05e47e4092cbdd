"""How a checkpoint becomes trusted on one kind of storage, and stops being trusted: the one definition of
"committed" that the trainer, the tiers, promote and archive all ask.

* :class:`RenameCommit` (file systems): committed = a ``step_N`` directory, ``step_N.tmp`` renamed.
* :class:`MarkerCommit` (object stores): committed = a step with its ``_COMMITTED`` marker, written last.

Withdrawing (to ``step_N.deleting``, or the marker removed) is a delete's first act, so a crash mid-delete never
leaves a half that looks committed. The marker rule works on any fsspec-like file system object it is given and
imports none. See docs/architecture.md, "Storage tiers and commit rules".

**Damaged means no longer committed.** A committed checkpoint found damaged (its bytes, files or manifest no
longer what it committed) is *set aside* (:meth:`CommitRule.set_aside`): moved out of the committed names, under
``<run>/_damaged/step_N.<when>/`` with a note of who found what, its stage records with it. From then on nothing
resumes from it, restores it, promotes it or names it in ``latest``, and a new save of that step commits as any
other. Its bytes stay for inspection; removing them is a person's decision (``ckptflow ls`` lists them).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any, Protocol

from ckptflow.trainer.errors import StorageError
from ckptflow.trainer.format import layout
from ckptflow.trainer.fsutil import fsync_dir, remove_tree, rename_durable, write_durable

__all__ = ["CommitRule", "DELETING_SUFFIX", "MarkerCommit", "RENAME", "RenameCommit", "retire_records"]


DELETING_SUFFIX = ".deleting"
"""A step dir being deleted on a file system: never committed, removed by ``clean_stale``."""


class CommitRule(Protocol):
    kind: str
    """``"rename"`` or ``"marker"``."""

    def staging_url(self, run_url: str, step: int) -> str:
        """Where a checkpoint's files are written before its commit."""
        ...

    def committed_steps(self, run_url: str) -> list[int]:
        """Committed steps of the run, newest first ([] if the run does not exist)."""
        ...

    def is_committed(self, run_url: str, step: int) -> bool: ...

    def commit(self, run_url: str, step: int, *, marker: bytes = b"") -> str:
        """The commit point (everything staged must be durable already); returns the step's URL."""
        ...

    def withdraw(self, run_url: str, step: int) -> str | None:
        """Make a committed step uncommitted; returns what is left to remove (None: nothing)."""
        ...

    def set_aside(self, run_url: str, step: int, note: dict[str, Any]) -> str | None:
        """Damaged means no longer committed: take the step out of the committed names and keep it, with
        ``note`` (who found it, why), under ``_damaged/``; returns where (None: it was not committed)."""
        ...


class RenameCommit:
    """Commit by renaming ``step_N.tmp`` to ``step_N`` on a local or shared file system."""

    kind = "rename"

    def staging_url(self, run_url: str, step: int) -> str:
        return layout.join(run_url, layout.tmp_name(step))

    def committed_steps(self, run_url: str) -> list[int]:
        try:
            names = os.listdir(run_url)
        except (FileNotFoundError, NotADirectoryError):
            return []
        steps = [s for n in names if (s := layout.parse_step(n)) is not None and _real_dir(os.path.join(run_url, n))]
        return sorted(steps, reverse=True)

    def is_committed(self, run_url: str, step: int) -> bool:
        return _real_dir(layout.join(run_url, layout.step_name(step)))

    def commit(self, run_url: str, step: int, *, marker: bytes = b"") -> str:
        tmp, final = self.staging_url(run_url, step), layout.join(run_url, layout.step_name(step))
        if os.path.lexists(final):
            # rename(2) silently replaces an *empty* directory; the caller decides what a second copy means
            raise StorageError(f"{final} already exists; a committed checkpoint is never replaced")
        fsync_dir(tmp)  # every staged file's entry is durable before the rename vouches for it
        rename_durable(tmp, final)
        return final

    def withdraw(self, run_url: str, step: int) -> str | None:
        final = layout.join(run_url, layout.step_name(step))
        if not os.path.isdir(final):
            return None
        doomed = final + DELETING_SUFFIX
        if os.path.lexists(doomed):  # an earlier delete crashed after its rename
            remove_tree(doomed)
        try:
            rename_durable(final, doomed)
        except FileNotFoundError:  # another delete (a concurrent prune) withdrew it first: that is success
            return None
        return doomed

    def set_aside(self, run_url: str, step: int, note: dict[str, Any]) -> str | None:
        final = layout.join(run_url, layout.step_name(step))
        if os.path.islink(final):  # a link under a step's name: never committed here, in the way of one that is
            note = dict(note, symlink_to=os.readlink(final))
        elif not os.path.isdir(final):
            return None
        aside_root = layout.join(run_url, layout.DAMAGED_DIR)
        os.makedirs(aside_root, exist_ok=True)
        aside = layout.join(aside_root, layout.set_aside_name(step, _stamp()))
        rename_durable(final, aside)  # <- no longer committed
        if "symlink_to" in note:  # the link moved aside, its target untouched; the note sits beside it
            write_durable(aside + ".json", _note_bytes(step, note))
            return aside
        # Its stage records describe this copy, not the next save of the step: they go with it. A crash right
        # here leaves them behind; the next commit of the step moves them then (retire_records).
        retire_records(run_url, step, into=aside)
        write_durable(layout.join(aside, layout.SET_ASIDE_NOTE), _note_bytes(step, note))
        return aside

    @staticmethod
    def is_leftover(name: str) -> bool:
        """A staging or half-deleted step dir: never trusted, safe to remove once old."""
        if layout.parse_tmp_step(name) is not None:
            return True
        return name.endswith(DELETING_SUFFIX) and layout.parse_step(name[: -len(DELETING_SUFFIX)]) is not None


RETIRED_RECORDS = "_records"
"""Under ``_damaged/``: stage records of a step's earlier copy, retired when the step committed again."""


def _real_dir(path: str) -> bool:
    """A folder, not a symlink to one: ckptflow commits by renaming folders it wrote, so a link under a step's
    name (to a copy elsewhere, to another run) is never a committed checkpoint of this tier."""
    return os.path.isdir(path) and not os.path.islink(path)


def retire_records(run_url: str, step: int, *, into: str | None = None) -> str | None:
    """Move a step's stage records (``_lifecycle/step_N/``) aside, into ``into`` or a folder of their own under
    ``_damaged/``: they belong to a copy that is no longer committed, and a new save of the step must start its
    lifecycle afresh instead of finding "verified" or "quarantined" from the old one. Returns where they went."""
    records = layout.lifecycle_dir(run_url, step)
    if not os.path.isdir(records) or os.path.islink(records):
        return None
    if into is None:  # records alone (no checkpoint with them): kept apart from the set-aside checkpoints
        retired = layout.join(run_url, layout.DAMAGED_DIR, RETIRED_RECORDS)
        os.makedirs(retired, exist_ok=True)
        dest = layout.join(retired, layout.set_aside_name(step, _stamp()))
    else:
        dest = layout.join(into, layout.LIFECYCLE_DIR)
    rename_durable(records, dest)
    return dest


def _stamp() -> str:
    """When, to the microsecond, plus a random tail: two set-asides of one step never collide."""
    now = time.time()
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f"{int(now % 1 * 1e6):06d}Z-{uuid.uuid4().hex[:6]}"


def _note_bytes(step: int, note: dict[str, Any]) -> bytes:
    body = {"step": step, "set_aside_at": time.time(), **note}
    return (json.dumps(body, indent=1, sort_keys=True, default=str) + "\n").encode()


class MarkerCommit:
    """Commit by writing ``_COMMITTED`` last, on an object store (``fs``: fsspec-like)."""

    kind = "marker"

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def staging_url(self, run_url: str, step: int) -> str:
        return layout.join(run_url, layout.step_name(step))

    def marker_url(self, run_url: str, step: int) -> str:
        return layout.join(run_url, layout.step_name(step), layout.COMMIT_MARKER)

    def committed_steps(self, run_url: str) -> list[int]:
        try:
            hits = self.fs.glob(layout.join(run_url, layout.STEP_PREFIX + "*", layout.COMMIT_MARKER))
        except FileNotFoundError:
            return []
        steps = {s for h in hits if (s := layout.parse_step(h.rstrip("/").rsplit("/", 2)[-2])) is not None}
        return sorted(steps, reverse=True)

    def is_committed(self, run_url: str, step: int) -> bool:
        return bool(self.fs.exists(self.marker_url(run_url, step)))

    def commit(self, run_url: str, step: int, *, marker: bytes = b"") -> str:
        self.fs.pipe_file(self.marker_url(run_url, step), marker)
        return self.staging_url(run_url, step)

    def set_aside(self, run_url: str, step: int, note: dict[str, Any]) -> str | None:
        """An object store cannot rename a prefix: the marker is withdrawn (no longer committed) and the note
        written under ``_damaged/``; the objects stay where they are, uncommitted, until an archive of the step
        replaces them (it keeps only objects whose size and recorded digests are right) or a person removes
        them."""
        if not self.is_committed(run_url, step):
            return None
        self.withdraw(run_url, step)  # <- no longer committed
        where = layout.join(run_url, layout.DAMAGED_DIR, layout.set_aside_name(step, _stamp()) + ".json")
        self.fs.pipe_file(where, _note_bytes(step, dict(note, objects=self.staging_url(run_url, step))))
        return where

    def withdraw(self, run_url: str, step: int) -> str | None:
        try:
            self.fs.rm_file(self.marker_url(run_url, step))
        except FileNotFoundError:
            pass
        return self.staging_url(run_url, step)


RENAME = RenameCommit()
"""The rule of every local tier (the trainer's hot root among them)."""
