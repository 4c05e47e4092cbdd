"""Durable local file-system primitives: the building blocks of an atomic commit. A rename is durable only
once the parent directory is fsynced, a file's content once the file is; each helper does what it needs.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid

__all__ = [
    "WRITE_ERRNOS",
    "append_durable",
    "fsync_dir",
    "make_sibling_dir",
    "remove_tree",
    "rename_durable",
    "replace_atomic",
    "write_durable",
]


WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})
"""Errors that say the place being written is the problem (full, over quota, read-only), whatever was read."""


def fsync_dir(path: str | os.PathLike) -> None:
    """Make entries created/renamed in ``path`` durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def write_durable(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to a new file and fsync it (the file must not be trusted yet)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` so readers see the old or the new content, never a mix (sibling written and fsynced,
    renamed over, directory fsynced). A crash leaves at worst an orphaned ``.<name>.<uuid>.part`` file."""
    path = os.fspath(path)
    parent = os.path.dirname(path) or "."
    tmp = os.path.join(parent, f".{os.path.basename(path)}.{uuid.uuid4().hex}.part")
    try:
        write_durable(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(parent)


def append_durable(path: str | os.PathLike, line: str) -> None:
    """Append one line and fsync; with O_APPEND a short line is never interleaved."""
    data = line if line.endswith("\n") else line + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def rename_durable(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename (atomic on POSIX within a file system) and fsync the parent(s)."""
    os.rename(src, dst)
    fsync_dir(os.path.dirname(os.fspath(dst)) or ".")
    src_parent = os.path.dirname(os.fspath(src)) or "."
    if os.path.abspath(src_parent) != os.path.abspath(os.path.dirname(os.fspath(dst)) or "."):
        fsync_dir(src_parent)


def make_sibling_dir(path: str | os.PathLike, tag: str = "part") -> str:
    """A new, hidden, uniquely named directory beside ``path`` (``.<name>.<tag>-<random>``) to build ``path`` in
    and rename into place. Made with the process's umask, as ``os.makedirs`` makes ``path``: ``mkdtemp``'s 0700
    would leave a restored checkpoint unreadable to the (other) user who trains from it."""
    path = os.path.abspath(os.fspath(path))
    parent, base = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    while True:
        d = os.path.join(parent, f".{base}.{tag}-{uuid.uuid4().hex[:12]}")
        try:
            os.mkdir(d, 0o777)
            return d
        except FileExistsError:
            continue


def remove_tree(path: str | os.PathLike) -> None:
    """Delete a directory tree; tolerate it vanishing concurrently."""
    shutil.rmtree(path, ignore_errors=False, onerror=_ignore_missing)


def _ignore_missing(func, p, exc_info):  # noqa: ANN001 - shutil's callback signature
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]
