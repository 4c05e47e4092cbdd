"""Content checksums for checkpoint files.

One algorithm everywhere (trainer manifest, tier manifests, codec containers), so a
digest computed on any tier can be compared with one computed anywhere else.
xxh3-128 runs at ~10 GB/s per core here (sha256 ~1 GB/s, crc32 ~4 GB/s): hashing a
shard costs a small fraction of writing it. It is a corruption check, not a
signature; manifests are authenticated separately (HMAC) when a key is configured.
"""

from __future__ import annotations

import os
from typing import BinaryIO

import xxhash

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
    with open(path, "rb", buffering=0) as f:
        return hash_stream(f)
