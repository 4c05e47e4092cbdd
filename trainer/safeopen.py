"""The one way ckptflow opens a file it reads from a tier or from a source it adopts.

A checkpoint folder is data from partly trusted storage, and a clumsy or hostile hand can leave anything in it:
a FIFO where ``manifest.json`` should be (a plain ``open`` waits forever for a writer), a symlink to
``/dev/zero`` (a ``read()`` that never ends), a device, a socket. So every reader here:

1. looks before it opens (``stat``): anything but a regular file is refused by name, never opened;
2. opens with ``O_NONBLOCK`` (a FIFO swapped in after the look still cannot block the open) and checks the open
   file itself (``fstat``): regular, and the same file it looked at; only then is ``O_NONBLOCK`` cleared;
3. reads small records (manifests, ``latest``, indexes, stage records, a source's JSON) with a bound: a file
   larger than its kind ever is, is refused, not read until memory runs out.

:func:`open_no_links` also refuses a symlink anywhere in the path, each component opened ``O_NOFOLLOW`` from its
parent: the adopter resolves a source's links once, then opens what it resolved without following anything
further.

Refusals raise :class:`NotRegularFileError` (an ``IntegrityError``: what a checkpoint holds is not a file a
checkpoint can hold) or :class:`TooLargeError`, each naming the path.
"""

from __future__ import annotations

import errno
import fcntl
import io
import os
import stat
from collections.abc import Callable
from typing import BinaryIO

from ckptflow.trainer.errors import IntegrityError

__all__ = [
    "NotRegularFileError",
    "TooLargeError",
    "copy_fd",
    "file_kind",
    "open_no_links",
    "open_regular",
    "open_regular_fd",
    "open_sized",
    "read_small",
]


class NotRegularFileError(IntegrityError):
    """A path a checkpoint reader expected to be a regular file is a FIFO, device, socket or directory."""


class TooLargeError(IntegrityError):
    """A small record (manifest, ``latest``, index, stage record) is larger than its kind ever is."""


def file_kind(mode: int) -> str:
    """What ``st_mode`` describes, in words an error message can use."""
    for test, word in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return word
    return "not a regular file"


def _refuse(path: str, st: os.stat_result, what: str) -> NotRegularFileError:
    return NotRegularFileError(
        f"{path}: is {file_kind(st.st_mode)}, not a regular file; {what} holds only regular files, "
        "so it was not opened (a FIFO or device here would hang or flood the reader): remove it, or "
        "restore the checkpoint from another tier",
        path=path,
    )


def open_regular_fd(path: str | os.PathLike, *, what: str = "a checkpoint") -> int:
    """A read-only descriptor of ``path``, which must be a regular file (see the module docstring). The caller
    closes it. ``FileNotFoundError`` and ``PermissionError`` pass through as they are."""
    path = os.fspath(path)
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, st, what)
    return _checked(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), path, what, looked=st)


def _checked(fd: int, path: str, what: str, *, looked: os.stat_result | None = None) -> int:
    """``fd``, opened ``O_NONBLOCK``, once it is a regular file (and the one ``looked`` at, when given), in
    blocking mode again; closed and refused otherwise."""
    try:
        got = os.fstat(fd)
        if not stat.S_ISREG(got.st_mode):
            raise _refuse(path, got, what)
        if looked is not None and (got.st_dev, got.st_ino) != (looked.st_dev, looked.st_ino):
            raise NotRegularFileError(
                f"{path}: was replaced while it was being opened; refusing a file it did not look at", path=path
            )
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_no_links(path: str) -> int:
    """A read-only descriptor of the regular file at the absolute ``path``, none of whose components may be a
    symlink: each directory is opened ``O_NOFOLLOW`` from the one before, so a link swapped in anywhere along
    the way after ``path`` was resolved is refused (``NotRegularFileError``), never followed."""
    if not os.path.isabs(path):
        raise ValueError(f"{path}: open_no_links needs an absolute path")
    parts = [p for p in path.split(os.sep) if p]
    fd = os.open(os.sep, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for comp in parts[:-1]:
            try:
                nfd = os.open(comp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise NotRegularFileError(
                        f"{path}: {comp} on the way to it is no longer a plain directory (a symlink was swapped "
                        "in?); refusing to follow it",
                        path=path,
                    ) from None
                raise
            os.close(fd)
            fd = nfd
        try:
            ffd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise NotRegularFileError(
                    f"{path}: became a symlink after it was resolved; refusing to follow it", path=path
                ) from None
            raise
    finally:
        os.close(fd)
    return _checked(ffd, path, "a checkpoint")


def open_regular(
    path: str | os.PathLike, *, buffering: int = -1, what: str = "a checkpoint"
) -> io.BufferedReader | io.FileIO:
    """:func:`open_regular_fd` as a binary file object (``buffering`` as for ``open``: 0 unbuffered)."""
    raw = io.FileIO(open_regular_fd(path, what=what), "rb", closefd=True)
    return raw if buffering == 0 else io.BufferedReader(raw, buffering if buffering > 0 else io.DEFAULT_BUFFER_SIZE)


def open_sized(path: str | os.PathLike, size: int, *, what: str = "a checkpoint") -> io.BufferedReader:
    """:func:`open_regular`, refused unless the file is exactly ``size`` bytes (what its index says): a
    truncated, swapped or swollen file (a terabyte of holes) is named at once, never streamed to its end."""
    f = open_regular(path, what=what)
    got = os.fstat(f.fileno()).st_size
    if got != size:
        f.close()
        raise IntegrityError(
            f"{os.fspath(path)}: {got} bytes, its index says {size}: truncated, replaced or damaged; not read "
            "(restore the checkpoint from another tier)",
            path=os.fspath(path),
        )
    assert isinstance(f, io.BufferedReader)
    return f


def read_small(path: str | os.PathLike, limit: int, *, what: str = "a checkpoint") -> bytes:
    """All of a small regular file, at most ``limit`` bytes; a larger one is refused, not truncated."""
    with open_regular(path, what=what) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise TooLargeError(
            f"{os.fspath(path)}: larger than {limit} bytes, which no file of its kind is; refusing to read it "
            "(damaged or not what its name says)",
            path=os.fspath(path),
        )
    return data


_COPY_CHUNK = 64 << 20


def copy_fd(src_fd: int, dst: BinaryIO, *, progress: Callable[[int], None] | None = None) -> int:
    """Copy everything from the open descriptor ``src_fd`` (from its current offset) to ``dst``, in the kernel
    where it can (``sendfile``); returns the bytes copied. Copying from the descriptor that was checked, not
    from a path opened again, is what keeps a file swapped after its check out of the copy."""
    dst.flush()
    out = dst.fileno()
    total = 0
    while True:
        try:
            n = os.sendfile(out, src_fd, None, _COPY_CHUNK)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOSYS) or total:
                raise
            return _copy_by_reads(src_fd, dst, progress)
        if n == 0:
            return total
        total += n
        if progress is not None:
            progress(n)


def _copy_by_reads(src_fd: int, dst: BinaryIO, progress: Callable[[int], None] | None) -> int:
    total = 0
    while chunk := os.read(src_fd, 8 << 20):
        dst.write(chunk)
        total += len(chunk)
        if progress is not None:
            progress(len(chunk))
    dst.flush()
    return total
