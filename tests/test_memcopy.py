"""The streaming-store copy the load uses (``trainer/memcopy.py``, ``trainer/_memcopy.c``)."""

from __future__ import annotations

import platform

import pytest
import torch

from ckptflow.trainer import memcopy


def test_the_extension_is_built_where_the_cpu_has_streaming_stores() -> None:
    """An install on x86-64 Linux (CI's) builds it: a silent fallback to memmove would cost every
    load ~1.5x in its copies and no test would notice."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("streaming stores are x86-64 only; elsewhere copy is memmove")
    assert memcopy.STREAMING, "ckptflow.trainer._memcopy was not built: is a C compiler installed? (pip install -e .)"


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
    from ckptflow.trainer import _memcopy

    with pytest.raises(ValueError, match="negative"):
        _memcopy.copy(1, 1, -1)
    with pytest.raises(ValueError, match="null"):
        _memcopy.copy(0, 1, 8)
    _memcopy.copy(0, 0, 0)  # nothing to copy: no address is touched
