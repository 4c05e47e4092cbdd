"""The streaming-store copy the load uses (``ckptflow/fast/memcopy.py``, ``csrc/_memcopy.c``)."""

from __future__ import annotations

import platform

import pytest
import torch

from ckptflow.fast import memcopy


def test_the_extension_is_built_where_the_cpu_has_streaming_stores() -> None:
    """An install on x86-64 Linux (CI's) builds it: a silent fallback to memmove would cost every
    load ~1.5x in its copies and no test would notice."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("streaming stores are x86-64 only; elsewhere copy is memmove")
    assert memcopy.STREAMING, "ckptflow.fast._memcopy was not built: is a C compiler installed? (pip install -e .)"


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, memcopy.STREAM_FROM - 1, memcopy.STREAM_FROM, 1 << 20, (3 << 20) + 77])
@pytest.mark.parametrize("dst_off", [0, 1, 17, 63])
@pytest.mark.parametrize("src_off", [0, 5, 64])
def test_copy_writes_exactly_the_bytes_asked_for_at_any_alignment(n: int, dst_off: int, src_off: int) -> None:
    """Every byte of the range arrives (head before the first whole line, the lines, the tail),
    and not one byte around it is touched."""
    g = torch.Generator().manual_seed(n + 7 * dst_off + src_off)
    src = torch.randint(0, 256, (n + 128,), dtype=torch.uint8, generator=g)
    dst = torch.full((n + 128,), 0xA5, dtype=torch.uint8)
    memcopy.copy(dst.data_ptr() + dst_off, src.data_ptr() + src_off, n)
    assert torch.equal(dst[dst_off : dst_off + n], src[src_off : src_off + n])
    assert bool((dst[:dst_off] == 0xA5).all()) and bool((dst[dst_off + n :] == 0xA5).all())


def test_the_extension_refuses_what_would_crash_the_process() -> None:
    if not memcopy.STREAMING:
        pytest.skip("the extension is not built here")
    from ckptflow.fast import _memcopy

    with pytest.raises(ValueError, match="negative"):
        _memcopy.copy(1, 1, -1)
    with pytest.raises(ValueError, match="null"):
        _memcopy.copy(0, 1, 8)
    _memcopy.copy(0, 0, 0)  # nothing to copy: no address is touched


needs_verify_copy = pytest.mark.skipif(not memcopy.VERIFY_COPY, reason="the extension is not built here")


def _blocks(n: int, bs: int, seed: int = 3) -> tuple[torch.Tensor, list[int]]:
    import xxhash

    src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    view = memoryview(src.numpy())
    return src, [xxhash.xxh3_64_intdigest(view[a : a + bs]) for a in range(0, n, bs)]


@needs_verify_copy
@pytest.mark.parametrize("n", [0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1024, 4097, (1 << 20) + 3])
def test_the_extensions_digest_is_xxh3_64_as_python_xxhash_computes_it(n: int) -> None:
    """The manifest's block digests are python-xxhash's xxh3-64 (its AVX-512 build here): the
    vendored copy must agree on every length class xxh3 treats differently (0, 1-3, 4-8, 9-16,
    17-128, 129-240, longer, more than one stripe block)."""
    import xxhash

    from ckptflow.fast import _memcopy

    src, _ = _blocks(n + 1, n + 1, seed=n)
    assert _memcopy.xxh3(src.data_ptr(), n) == xxhash.xxh3_64_intdigest(memoryview(src.numpy())[:n])


@needs_verify_copy
def test_verify_copy_copies_each_block_only_once_it_matched_and_stops_at_the_first_that_does_not() -> None:
    """Five blocks (the last one short), each with two pieces; the fourth block's digest is wrong:
    blocks 0-2 arrive whole, nothing of blocks 3 and 4 (their pieces stay untouched), and the call
    says three matched."""
    from array import array

    bs, n = 4096, 4 * 4096 + 1000
    src, digests = _blocks(n, bs)
    dst = torch.full((n,), 0xA5, dtype=torch.uint8)
    counts, pieces = array("Q"), array("Q")
    for a in range(0, n, bs):
        end = min(a + bs, n)
        mid = a + (end - a) // 3
        counts.append(2)
        for lo, hi in ((a, mid), (mid, end)):
            pieces.extend((dst.data_ptr() + lo, src.data_ptr() + lo, hi - lo))
    ok = memcopy.verify_copy(src.data_ptr(), 0, n, bs, array("Q", digests), counts, pieces)
    assert ok == 5 and torch.equal(dst, src)
    dst.fill_(0xA5)
    bad = array("Q", digests)
    bad[3] ^= 1
    assert memcopy.verify_copy(src.data_ptr(), 0, n, bs, bad, counts, pieces) == 3
    assert torch.equal(dst[: 3 * bs], src[: 3 * bs]) and bool((dst[3 * bs :] == 0xA5).all())


@needs_verify_copy
def test_verify_copy_refuses_tables_that_do_not_fit_the_run() -> None:
    """Counts that claim more pieces than given, or one digest short: a ValueError before any
    byte is read or written, never a read past the tables."""
    from array import array

    src, digests = _blocks(8192, 4096)
    with pytest.raises(ValueError, match="one digest and one piece count per block"):
        memcopy.verify_copy(src.data_ptr(), 0, 8192, 4096, array("Q", digests), array("Q", [1, 1]), array("Q"))
    with pytest.raises(ValueError, match="one digest and one piece count per block"):
        memcopy.verify_copy(src.data_ptr(), 0, 8192, 4096, array("Q", digests[:1]), array("Q", [0, 0]), array("Q"))
    with pytest.raises(ValueError, match="8-byte"):
        memcopy.verify_copy(src.data_ptr(), 0, 8192, 4096, array("I", [1, 2, 3, 4]), array("Q", [0, 0]), array("Q"))
    with pytest.raises(ValueError, match="bad address"):
        memcopy.verify_copy(0, 0, 8192, 4096, array("Q", digests), array("Q", [0, 0]), array("Q"))


@pytest.mark.skipif(not memcopy.STREAM_IN, reason="the extension is not built here (or not on Linux)")
def test_stream_in_brings_a_file_into_the_cache_and_maps_its_pages(tmp_path) -> None:
    """What it sends is the file's bytes from ``off`` (fewer at its end); reading the mapping
    afterwards gives the file's bytes; a bad descriptor is an OSError, bad arguments a ValueError."""
    import mmap
    import os

    data = os.urandom(3 * (1 << 20) + 123)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    sink = os.open(os.devnull, os.O_WRONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        m = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        addr = torch.frombuffer(m, dtype=torch.uint8).data_ptr()
        assert memcopy.stream_in(fd, sink, 0, 1 << 20, addr, 64 << 10) == 1 << 20
        assert memcopy.stream_in(fd, sink, 1 << 20, 8 << 20, addr, 4096) == len(data) - (1 << 20)  # to the end
        assert memcopy.stream_in(fd, sink, len(data), 1 << 20, addr, 4096) == 0
        assert memcopy.stream_in(fd, sink, 0, 100, 0, 4096) == 100  # no mapping: only sent
        assert bytes(m) == data
        del addr
        m.close()
        with pytest.raises(OSError):
            memcopy.stream_in(-1, sink, 0, 100, 0, 4096)
        with pytest.raises(ValueError):
            memcopy.stream_in(fd, sink, -1, 100, 0, 4096)
        with pytest.raises(ValueError):
            memcopy.stream_in(fd, sink, 0, 100, 0, 0)
    finally:
        os.close(sink)
        os.close(fd)
