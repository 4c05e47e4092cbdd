"""Content checksums for checkpoint files.

One algorithm everywhere (trainer manifest, tier manifests, codec containers), so digests compare across
tiers. xxh3-128 is several times faster than sha256 or crc32, so hashing a shard costs a small fraction of
writing it. A corruption check, not a signature: manifests are authenticated separately (HMAC) with a key.
"""

from __future__ import annotations

import os
from typing import BinaryIO

import xxhash

from ckptflow.trainer.safeopen import open_regular

__all__ = [
    "ALGORITHM",
    "BLOCK_ALGORITHM",
    "BLOCK_HEX",
    "CHUNK",
    "FileDigest",
    "MAX_BLOCKS",
    "MIN_BLOCK",
    "block_digest",
    "block_size_for",
    "digest_file",
    "hash_bytes",
    "hash_file",
    "hash_stream",
    "new_hasher",
]


ALGORITHM = "xxh3_128"
CHUNK = 8 << 20  # 8 MiB: large enough to run at full speed, small enough to stream


def new_hasher() -> xxhash.xxh3_128:
    """A streaming hasher: ``h.update(bytes)`` then ``h.hexdigest()``."""
    return xxhash.xxh3_128()


def hash_bytes(data: bytes | bytearray | memoryview) -> str:
    return xxhash.xxh3_128(data).hexdigest()


def hash_stream(f: BinaryIO, chunk: int = CHUNK) -> tuple[str, int]:
    """Digest and byte count of everything left in ``f``."""
    h = new_hasher()
    n = 0
    buf = bytearray(chunk)
    view = memoryview(buf)
    readinto = getattr(f, "readinto", None)
    while True:
        if readinto is not None:
            got = readinto(view)
            if not got:
                break
            h.update(view[:got])
        else:  # fsspec/remote files may lack readinto
            data = f.read(chunk)
            if not data:
                break
            got = len(data)
            h.update(data)
        n += got
    return h.hexdigest(), n


def hash_file(path: str | os.PathLike) -> tuple[str, int]:
    """Digest and size of a local file, read in chunks (never whole in memory)."""
    with open_regular(path, buffering=0) as f:
        return hash_stream(f)


MIN_BLOCK = 1 << 20
"""Bytes per block, at least. One file's digest takes one core; the blocks' digests (in the manifest) let a
load verify a file on every core and copy each block right after it matched, while still in cache (1 MiB
fits L2)."""
MAX_BLOCKS = 1024
"""Blocks per file, at most (larger files get larger blocks), bounding the manifest's size."""


def block_size_for(nbytes: int) -> int:
    """The block size for a file of about ``nbytes`` (a power of two, ``MIN_BLOCK`` or more)."""
    b = MIN_BLOCK
    while b * MAX_BLOCKS < nbytes:
        b *= 2
    return b


BLOCK_ALGORITHM = "xxh3_64"
BLOCK_HEX = 16  # characters per block digest


def block_digest(data: bytes | bytearray | memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(data)


class FileDigest:
    """A file's digest (``ALGORITHM``) and its blocks' (``BLOCK_ALGORITHM``) in one pass over its bytes in
    order: ``update`` as they are written or read, then ``hexdigest``/``blocks``."""

    def __init__(self, block: int = MIN_BLOCK) -> None:
        self.block = block
        self.size = 0
        self._whole = new_hasher()
        self._part = xxhash.xxh3_64()
        self._fill = 0
        self._done: list[str] = []

    def update(self, data: bytes | bytearray | memoryview) -> None:
        mv = memoryview(data).cast("B")
        self._whole.update(mv)
        self.size += len(mv)
        while len(mv):
            take = min(len(mv), self.block - self._fill)
            self._part.update(mv[:take])
            self._fill += take
            mv = mv[take:]
            if self._fill == self.block:
                self._done.append(self._part.hexdigest())
                self._part.reset()
                self._fill = 0

    def hexdigest(self) -> str:
        return self._whole.hexdigest()

    def blocks(self) -> str:
        """Every block's digest, concatenated (``BLOCK_HEX`` characters each; the last block may be short)."""
        return "".join(self._done) + (self._part.hexdigest() if self._fill else "")


def digest_file(path: str | os.PathLike) -> FileDigest:
    """:class:`FileDigest` of a local file, read in chunks."""
    d = FileDigest(block_size_for(os.path.getsize(path)))
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open_regular(path, buffering=0) as f:
        while got := f.readinto(view):
            d.update(view[:got])
    return d
