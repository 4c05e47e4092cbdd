"""Copying a large run of host bytes to memory that nobody reads soon: with streaming stores.

``memmove`` writes through the cache (each destination line is read first, evicting lines the load's threads still
use); streaming (non-temporal) stores write whole lines straight to memory (glibc uses them only above a cache-sized
threshold). The copy and :func:`verify_copy` (the load's inner loop: blocks hashed, compared, their pieces copied
right after each matched) are the optional C extension ``_memcopy`` (``csrc/_memcopy.c``, vendored xxHash), run
without the GIL; without it (no C compiler at install), :func:`copy` is ``memmove`` and the loop runs in Python.
"""

from __future__ import annotations

import ctypes
from array import array
from typing import Any

_memcopy: Any = None
try:
    from importlib import import_module

    _memcopy = import_module("ckptflow.fast._memcopy")
except ImportError:  # not built: the install found no C compiler
    pass

STREAMING = bool(_memcopy is not None and _memcopy.STREAMING)
"""Whether :func:`copy` uses streaming stores here (the extension is built, the CPU is x86-64)."""

STREAM_FROM = 64 << 10
"""Copies this large stream; smaller ones (zip records, small tensors) go through ``memmove``: their destination
may be read soon, and the fence would cost more than it saves."""


def copy(dst: int, src: int, n: int) -> None:
    """Copy ``n`` bytes from address ``src`` to address ``dst`` (the ranges must not overlap), without the GIL; with
    streaming stores where :data:`STREAMING` and ``n >= STREAM_FROM``."""
    if STREAMING and n >= STREAM_FROM:
        _memcopy.copy(dst, src, n)
    else:
        ctypes.memmove(dst, src, n)


VERIFY_COPY = bool(_memcopy is not None and hasattr(_memcopy, "verify_copy"))
"""Whether :func:`verify_copy` is there (the extension is built; it is on every platform it builds on)."""


def verify_copy(base: int, start: int, end: int, bs: int, digests: array, counts: array, pieces: array) -> int:
    """Hash blocks ``[start + i*bs, min(start + (i+1)*bs, end))`` at address ``base`` (xxh3-64), compare each with
    ``digests[i]`` and copy its ``counts[i]`` pieces (consecutive ``(dst, src, n)`` triples in ``pieces``) right
    after it matched; stop at the first mismatch. Returns how many blocks matched (all: ``len(digests)``).
    ``array('Q')`` each; no GIL. Only where :data:`VERIFY_COPY`."""
    return int(_memcopy.verify_copy(base, start, end, bs, digests, counts, pieces))


STREAM_IN = bool(_memcopy is not None and hasattr(_memcopy, "stream_in"))
"""Whether :func:`stream_in` is there (the extension is built, on Linux)."""


def stream_in(fd: int, sink: int, off: int, n: int, addr: int, step: int) -> int:
    """Bring bytes ``[off, off + n)`` of file ``fd`` into the page cache (``sendfile`` to ``sink``, ``/dev/null``),
    then, if ``addr`` (the file's mapping), read a byte every ``step`` there to map their pages; one call, no GIL.
    Returns how many bytes were sent (fewer at the end of the file); OSError if none could be. Only where
    :data:`STREAM_IN`."""
    return int(_memcopy.stream_in(fd, sink, off, n, addr, step))
