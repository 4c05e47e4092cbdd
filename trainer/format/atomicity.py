"""How a checkpoint becomes trusted on one kind of storage, and stops being trusted: the one definition of
"committed" that the trainer, the tiers, promote and archive all ask.

* :class:`RenameCommit` (file systems): committed = a ``step_N`` directory, ``step_N.tmp`` renamed.
* :class:`MarkerCommit` (object stores): committed = a step with its ``_COMMITTED`` marker, written last.

Withdrawing (to ``step_N.deleting``, or the marker removed) is a delete's first act, so a crash mid-delete never
leaves a half that looks committed. The marker rule works on any fsspec-like file system object it is given and
imports none. See docs/architecture.md, "Storage tiers and commit rules".
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from ckptflow.trainer.errors import StorageError
from ckptflow.trainer.format import layout
from ckptflow.trainer.fsutil import fsync_dir, remove_tree, rename_durable

__all__ = ["CommitRule", "DELETING_SUFFIX", "MarkerCommit", "RENAME", "RenameCommit"]


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
        steps = [
            s for n in names if (s := layout.parse_step(n)) is not None and os.path.isdir(os.path.join(run_url, n))
        ]
        return sorted(steps, reverse=True)

    def is_committed(self, run_url: str, step: int) -> bool:
        return os.path.isdir(layout.join(run_url, layout.step_name(step)))

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
        rename_durable(final, doomed)
        return doomed

    @staticmethod
    def is_leftover(name: str) -> bool:
        """A staging or half-deleted step dir: never trusted, safe to remove once old."""
        if layout.parse_tmp_step(name) is not None:
            return True
        return name.endswith(DELETING_SUFFIX) and layout.parse_step(name[: -len(DELETING_SUFFIX)]) is not None


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

    def withdraw(self, run_url: str, step: int) -> str | None:
        try:
            self.fs.rm_file(self.marker_url(run_url, step))
        except FileNotFoundError:
            pass
        return self.staging_url(run_url, step)


RENAME = RenameCommit()
"""The rule of every local tier (the trainer's hot root among them)."""
