"""A write-only file that bypasses the page cache (``O_DIRECT``), for the checkpoint's data files.

Why: a buffered write copies every byte into the page cache, and each page it needs must first
be allocated. Measured on this project's VMs (docs/benchmarks.md, "Direct writes"): writing
83 MB into new pages cost 340-380 ms of CPU (the hypervisor backs each guest page on first
touch, and the guest hands freed pages back), against 23-33 ms into pages already backed. On a
host where training fills every core, that CPU comes out of training. A direct write hands the
device an aligned buffer instead: the bytes are copied once into a reused buffer (the hashing
stream's copy, below), no page-cache page is allocated, and no dirty page is left for writeback
to stall on later. On bare metal the gain is smaller (the kernel's copy and page management),
and the checkpoint no longer crowds the training data out of the page cache.

The cost: a read soon after the save (a same-node restart, the lifecycle's verify) comes from
the device, not the page cache. Off by default: on recycled pages buffered writes were as cheap in CPU
and faster in wall time; ``CheckpointConfig(direct_io=True)`` turns it on.

How: bytes are gathered into a page-aligned buffer (an anonymous ``mmap``, reused for the whole
file) and written in whole buffers; the tail is padded to the alignment, written, and the file is
truncated back to its real size. File systems that refuse ``O_DIRECT`` at open (tmpfs, some FUSE
and network file systems) get a buffered file; one that accepts the flag but refuses an aligned
write (``EINVAL``: a device with a larger logical block) has the flag cleared on the open file
(``F_SETFL``) and carries on buffered, so a save never fails for want of direct I/O.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
from typing import Any

import numpy as np

ALIGN = 4096
"""Offsets, lengths and buffer addresses of direct writes are multiples of this: it covers
devices with 512-byte and 4 KiB logical blocks."""

BUFFER = 4 << 20
"""Bytes gathered per write: large enough that the syscalls cost nothing next to the copy."""

MEMMOVE_FROM = 64 << 10
"""Writes this large are copied into the buffer without the GIL (smaller: zip records)."""

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_REFUSED = {errno.EINVAL, getattr(errno, "EOPNOTSUPP", errno.EINVAL), getattr(errno, "ENOTSUP", errno.EINVAL)}
"""What a file system answers an ``O_DIRECT`` open it does not support with."""


def supported() -> bool:
    """Whether this platform has ``O_DIRECT`` at all (Linux, some BSDs; not macOS)."""
    return bool(_O_DIRECT)


class DirectFile:
    """A new file at ``path``, written front to back with ``write``; ``finish`` writes the tail.

    ``direct`` tells whether the bytes bypassed the page cache (False after a fallback).
    Not thread-safe: one writer thread per file, as DCP's writer has.
    """

    def __init__(self, path: str | os.PathLike, *, buffer_bytes: int = BUFFER) -> None:
        if buffer_bytes <= 0 or buffer_bytes % ALIGN:
            raise ValueError(f"buffer_bytes={buffer_bytes} must be a positive multiple of {ALIGN}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self.direct = supported()
        try:
            self.fd = os.open(path, flags | _O_DIRECT, 0o644)
        except OSError as e:
            if e.errno not in _REFUSED or not self.direct:
                raise
            self.direct = False  # this file system does not do direct I/O
            self.fd = os.open(path, flags, 0o644)
        self.path = os.fspath(path)
        self._buf = mmap.mmap(-1, buffer_bytes)  # page-aligned, as O_DIRECT wants
        self._view = memoryview(self._buf)
        self._addr = _address(self._view)
        self._fill = 0
        self.size = 0
        self._finished = False

    # -- the stream interface HashingStream uses ---------------------------------------
    def write(self, data: Any) -> int:
        if self._finished:
            raise ValueError(f"{self.path}: write after finish()")
        mv = memoryview(data).cast("B")
        n = len(mv)
        cap = len(self._view)
        # A tensor's bytes are copied by memmove, which runs without the GIL: a slice assignment
        # holds it (7 ms of each save here), and the training thread waits for the GIL meanwhile.
        src = _address(mv) if n >= MEMMOVE_FROM else None
        off = 0
        while off < n:
            take = min(n - off, cap - self._fill)
            if src is None:
                self._view[self._fill : self._fill + take] = mv[off : off + take]
            else:
                ctypes.memmove(self._addr + self._fill, src + off, take)
            self._fill += take
            off += take
            if self._fill == cap:
                self._write_out(cap)
                self._fill = 0
        self.size += n
        return n

    def flush(self) -> None:
        """Nothing: bytes reach the file in whole buffers, the last one at ``finish``."""

    def fileno(self) -> int:
        return self.fd

    def finish(self) -> None:
        """Write what is gathered (padded to ``ALIGN``) and cut the file to its real size."""
        if self._finished:
            return
        if self._fill:
            padded = -(-self._fill // ALIGN) * ALIGN
            self._view[self._fill : padded] = bytes(padded - self._fill)
            self._write_out(padded)
            self._fill = 0
        os.ftruncate(self.fd, self.size)
        self._finished = True

    def close(self) -> None:
        try:
            os.close(self.fd)
        finally:
            self._view.release()
            self._buf.close()

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------
    def _write_out(self, n: int) -> None:
        done = 0
        while done < n:
            try:
                done += os.write(self.fd, self._view[done:n])
            except OSError as e:
                if e.errno != errno.EINVAL or not self.direct:
                    raise
                self._fall_back()  # aligned, yet refused: the device wants larger blocks

    def _fall_back(self) -> None:
        """Clear ``O_DIRECT`` on the open file; what was written stays where it is."""
        fl = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fl & ~_O_DIRECT)
        self.direct = False


def _address(mv: memoryview) -> int:
    """Where ``mv``'s first byte lies (kept valid by whoever holds ``mv``)."""
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data)
