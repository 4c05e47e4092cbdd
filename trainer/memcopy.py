"""Copying a large run of host bytes to memory that nobody reads soon: with streaming stores.

A load copies every verified byte into the model's tensors once, and nothing reads them again
until training starts. An ordinary copy (glibc's ``memmove``, and so ``ctypes.memmove``) writes
through the cache: each destination line is first read from memory (a read-for-ownership), then
written back, and it evicts lines the load's threads still use (the block being hashed). Streaming
(non-temporal) stores write whole lines straight to memory: a third less memory traffic, and the
cache keeps what the load reads next. glibc switches to them only for copies larger than a
threshold tied to the cache size; on this project's hosts it never did, even at 512 MiB.

Measured here (AMD EPYC, 2 cores; docs/benchmarks.md, "Streaming stores"): one thread copies at
13-14 GB/s with ``memmove`` and 19-20 GB/s with streaming stores; hash then copy of 1 MiB blocks
of an 835 MB file on 2 threads, the load's own pattern, 58 -> 47 ms.

The copy is the C extension ``_memcopy`` (``csrc/_memcopy.c`` with the vendored xxHash in
``third_party/xxhash``, built at install; optional). Where it is missing — built without a C
compiler, another CPU — or ``CKPTFLOW_NO_ACCEL=1`` turns it off, :func:`copy` is ``memmove``.
Both run without the GIL.

:func:`verify_copy` is the load's inner loop in the same extension: a run of blocks hashed, each
compared with its digest and its pieces copied right after it matched, in one call without the
GIL (``VerifiedReader._verify_run``; without the extension that loop runs in Python, a block at a
time).
"""

from __future__ import annotations

import ctypes
import os
from array import array
from typing import Any

_memcopy: Any = None
if os.environ.get("CKPTFLOW_NO_ACCEL", "") in ("", "0"):
    try:
        from importlib import import_module

        _memcopy = import_module("ckptflow.trainer._memcopy")
    except ImportError:  # not built: the install found no C compiler
        pass

STREAMING = bool(_memcopy is not None and _memcopy.STREAMING)
"""Whether :func:`copy` uses streaming stores here (the extension is built, the CPU is x86-64)."""

STREAM_FROM = 64 << 10
"""Copies this large stream; smaller ones (zip records, small tensors) go through ``memmove``,
whose destination may well be read soon and for which the fence would cost more than it saves."""


def copy(dst: int, src: int, n: int) -> None:
    """Copy ``n`` bytes from address ``src`` to address ``dst`` (the ranges must not overlap),
    without the GIL; with streaming stores where :data:`STREAMING` and ``n >= STREAM_FROM``."""
    if STREAMING and n >= STREAM_FROM:
        _memcopy.copy(dst, src, n)
    else:
        ctypes.memmove(dst, src, n)


VERIFY_COPY = bool(_memcopy is not None and hasattr(_memcopy, "verify_copy"))
"""Whether :func:`verify_copy` is there (the extension is built; it is on every platform it builds on)."""


def verify_copy(base: int, start: int, end: int, bs: int, digests: array, counts: array, pieces: array) -> int:
    """Hash blocks ``[start + i*bs, min(start + (i+1)*bs, end))`` of the memory at address ``base``
    (xxh3-64), compare each with ``digests[i]`` and copy its ``counts[i]`` pieces — consecutive
    ``(dst, src, n)`` triples in ``pieces`` — right after it matched; stop at the first block that
    does not match. Returns how many blocks matched (all: ``len(digests)``). ``array('Q')`` each;
    no GIL. Only where :data:`VERIFY_COPY`."""
    return int(_memcopy.verify_copy(base, start, end, bs, digests, counts, pieces))


STREAM_IN = bool(_memcopy is not None and hasattr(_memcopy, "stream_in"))
"""Whether :func:`stream_in` is there (the extension is built, on Linux)."""


def stream_in(fd: int, sink: int, off: int, n: int, addr: int, step: int) -> int:
    """Bring bytes ``[off, off + n)`` of file ``fd`` into the page cache (``sendfile`` to ``sink``,
    ``/dev/null``), then, if ``addr`` (the file's mapping), read one byte every ``step`` bytes of
    them there so their pages are mapped into the process; in one call without the GIL. Returns
    how many bytes were sent (fewer at the end of the file); OSError if none could be. Only where
    :data:`STREAM_IN`."""
    return int(_memcopy.stream_in(fd, sink, off, n, addr, step))
