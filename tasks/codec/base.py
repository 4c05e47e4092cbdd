"""What every codec is: a streaming transform between two byte streams, with digests.

The lifecycle's compress stage and the restore path see only this interface. A codec
reads ``src`` front to back and writes ``dst`` front to back, never seeking either,
so both may be fsspec/S3 streams; its memory is bounded by its chunk size times its
thread count, never by the size of a shard.

Both directions return :class:`CodecStats`: the xxh3-128 digest of the raw bytes and
of the stored bytes (what the tier index records), so a caller never re-reads a file
to learn its checksum.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, Protocol, runtime_checkable

from ckptflow.trainer.errors import ConfigError
from ckptflow.trainer.format.checksum import new_hasher

if TYPE_CHECKING:
    from ckptflow.tasks.codec.dtypemap import DtypeMap


@dataclass(frozen=True, slots=True)
class CodecStats:
    raw_bytes: int
    """Bytes of the uncompressed content."""
    stored_bytes: int
    """Bytes of the compressed (stored) stream."""
    raw_checksum: str
    """xxh3-128 hex digest of the whole uncompressed content."""
    stored_checksum: str
    """xxh3-128 hex digest of the whole stored stream."""
    seconds: float
    """Wall time of the call."""

    @property
    def ratio(self) -> float:
        """raw / stored (1.0 for empty content)."""
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def mb_per_s(self) -> float:
        """Raw MB (10^6 bytes) per second, the speed people compare with disks and links."""
        return self.raw_bytes / max(self.seconds, 1e-9) / 1e6


class Reader(Protocol):
    """What :func:`read_full` needs of a stream: ``read(n)``."""

    def read(self, n: int, /) -> bytes: ...


class Writer(Protocol):
    """What a decoder needs of its destination: ``write`` (``flush`` is used when present)."""

    def write(self, b: bytes | bytearray | memoryview, /) -> object: ...


@runtime_checkable
class Codec(Protocol):
    name: str
    """Recorded in tier indexes; :func:`get_codec` maps it back to the codec."""
    suffix: str
    """Appended to a stored object's name (``.zst``, ``.ckz``; ``""`` for none)."""

    def compress(
        self,
        src: BinaryIO,
        dst: BinaryIO,
        *,
        level: int | None = None,
        threads: int | None = None,
        dtype_map: DtypeMap | None = None,
        name: str | None = None,
    ) -> CodecStats: ...

    def decompress(
        self, src: BinaryIO, dst: Writer, *, threads: int | None = None, name: str | None = None
    ) -> CodecStats: ...


# ---- stream helpers shared by the codecs ------------------------------------------


def default_threads(threads: int | None) -> int:
    if threads is None:
        return max(1, os.cpu_count() or 1)
    if not isinstance(threads, int) or threads < 1:
        raise ConfigError(f"codec threads={threads!r} must be a positive integer")
    return threads


def read_full(f: Reader, n: int) -> bytes:
    """Up to ``n`` bytes; fewer only at end of stream (network streams return short reads)."""
    parts = []
    while n > 0:
        b = f.read(n)
        if not b:
            break
        parts.append(b)
        n -= len(b)
    return parts[0] if len(parts) == 1 else b"".join(parts)


class HashingReader:
    """Wraps a readable stream: counts and hashes everything read through it."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._h = new_hasher()
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        b = self._f.read(n)
        if b:
            self._h.update(b)
            self.count += len(b)
        return b

    def hexdigest(self) -> str:
        return self._h.hexdigest()


class HashingWriter:
    """Wraps a writable stream: counts and hashes everything written through it."""

    def __init__(self, f: Writer) -> None:
        self._f = f
        self._h = new_hasher()
        self.count = 0

    def write(self, b: bytes | bytearray | memoryview) -> int:
        self._f.write(b)
        self._h.update(b)
        n = len(b) if not isinstance(b, memoryview) else b.nbytes
        self.count += n
        return n

    def flush(self) -> None:
        flush = getattr(self._f, "flush", None)
        if flush is not None:
            flush()

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def where(name: str | None) -> str:
    """The prefix that names the file in an error message, when the caller gave one."""
    return f"{name}: " if name else ""
