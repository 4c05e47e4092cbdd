"""Data files written past the page cache (``trainer/dcp/_directio.py``).

Every length around the alignment and the buffer comes out byte for byte, at its real size; a
file system that refuses O_DIRECT at open (tmpfs) and a device that refuses an aligned direct
write both end in the same bytes, buffered; nothing is written after ``finish``.
"""

from __future__ import annotations

import errno
import os

import pytest

from ckptflow.trainer.dcp import _directio as directio
from ckptflow.trainer.dcp._directio import ALIGN, MEMMOVE_FROM, DirectFile

BUF = 4 * ALIGN  # a small buffer, so the tests cross its end often


def directio_works(folder) -> bool:
    """Whether ``folder``'s file system opens files with O_DIRECT (ext4, xfs: yes; tmpfs: no)."""
    if not directio.supported():
        return False
    probe = os.path.join(folder, ".directio-probe")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
        return True
    except OSError:
        return False
    finally:
        if os.path.exists(probe):
            os.unlink(probe)


def _write(path, pieces: list[bytes]) -> DirectFile:
    with DirectFile(path, buffer_bytes=BUF) as f:
        for p in pieces:
            assert f.write(memoryview(p)) == len(p)
        f.finish()
        os.fsync(f.fileno())
    return f


# The last two: writes of MEMMOVE_FROM or more (copied by memmove), across many buffer ends.
@pytest.mark.parametrize(
    "n",
    [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, BUF - 1, BUF, BUF + 1, 3 * BUF + 17, 3 * MEMMOVE_FROM, 7 * MEMMOVE_FROM + 5],
)
def test_every_length_comes_out_exact(tmp_path, n):
    data = os.urandom(n)
    cuts = sorted({0, n, n // 3, n // 2, max(0, n - 5)})
    pieces = [data[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]  # uneven writes
    f = _write(tmp_path / "f", pieces)
    assert (tmp_path / "f").read_bytes() == data
    assert f.size == n
    assert f.direct == directio_works(tmp_path)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no tmpfs at /dev/shm")
def test_a_file_system_without_o_direct_gets_a_buffered_file(tmp_path):
    d = os.path.join("/dev/shm", f"ckptflow-directio-{os.getpid()}")
    os.makedirs(d, exist_ok=True)
    try:
        data = os.urandom(BUF + 123)
        f = _write(os.path.join(d, "f"), [data])
        with open(os.path.join(d, "f"), "rb") as g:
            assert g.read() == data
        if not directio_works(d):
            assert not f.direct
    finally:
        for name in os.listdir(d):
            os.unlink(os.path.join(d, name))
        os.rmdir(d)


def test_an_aligned_write_the_device_refuses_goes_on_buffered(tmp_path, monkeypatch):
    if not directio_works(tmp_path):
        pytest.skip("this file system does not take O_DIRECT")
    real = os.write
    refused = []

    def picky(fd, b):  # a device whose logical block is larger than ALIGN refuses with EINVAL
        import fcntl

        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and not refused:
            refused.append(len(b))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, b)

    monkeypatch.setattr(directio.os, "write", picky)
    data = os.urandom(2 * BUF + 99)
    f = _write(tmp_path / "f", [data[:100], data[100:]])
    assert refused and not f.direct
    assert (tmp_path / "f").read_bytes() == data


def test_nothing_is_written_after_finish(tmp_path):
    with DirectFile(tmp_path / "f", buffer_bytes=BUF) as f:
        f.write(b"abc")
        f.finish()
        with pytest.raises(ValueError, match="after finish"):
            f.write(b"d")
    assert (tmp_path / "f").read_bytes() == b"abc"
    with pytest.raises(ValueError, match="multiple of"):
        DirectFile(tmp_path / "g", buffer_bytes=ALIGN + 1)
