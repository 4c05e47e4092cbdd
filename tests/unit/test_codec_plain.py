"""Plain codecs: ``zstd`` writes standard frames and catches cut or damaged ones; ``none`` copies."""

from __future__ import annotations

import io
import os

import pytest
import zstandard

from ckptflow.tasks.codec import available_codecs, get_codec
from ckptflow.trainer.errors import CodecError
from ckptflow.trainer.format.checksum import hash_bytes

RAW = os.urandom(200_000) + bytes(3_000_000) + b"tail" * 1000


def test_registry():
    assert set(available_codecs()) == {"none", "zstd", "bytegroup"}
    for name in available_codecs():
        c = get_codec(name)
        assert c.name == name
    assert get_codec("zstd").suffix == ".zst" and get_codec("none").suffix == ""


@pytest.mark.parametrize("name", ["none", "zstd"])
@pytest.mark.parametrize("raw", [b"", b"a", RAW])
def test_round_trip_and_digests(name, raw):
    c = get_codec(name)
    z = io.BytesIO()
    s1 = c.compress(io.BytesIO(raw), z, threads=2)
    out = io.BytesIO()
    s2 = c.decompress(io.BytesIO(z.getvalue()), out)
    assert out.getvalue() == raw
    assert s1.raw_checksum == s2.raw_checksum == hash_bytes(raw)
    assert s1.stored_checksum == s2.stored_checksum == hash_bytes(z.getvalue())
    assert (s1.raw_bytes, s1.stored_bytes) == (len(raw), len(z.getvalue()))


def test_zstd_is_standard_both_ways():
    z = io.BytesIO()
    get_codec("zstd").compress(io.BytesIO(RAW), z, level=1)
    assert zstandard.ZstdDecompressor().decompressobj().decompress(z.getvalue()) == RAW
    # frames written elsewhere (two of them, plus a skippable one) decode too
    other = zstandard.ZstdCompressor(level=5).compress(RAW[:1000])
    skippable = b"\x50\x2a\x4d\x18" + (3).to_bytes(4, "little") + b"abc"
    out = io.BytesIO()
    get_codec("zstd").decompress(io.BytesIO(other + skippable + z.getvalue()), out)
    assert out.getvalue() == RAW[:1000] + RAW


def test_zstd_cut_stream_is_an_error_not_a_short_file():
    z = io.BytesIO()
    get_codec("zstd").compress(io.BytesIO(RAW), z)
    data = z.getvalue()
    for cut in (1, 5, 6, len(data) // 2, len(data) - 4, len(data) - 1):
        with pytest.raises(CodecError, match="truncated|corrupt"):
            get_codec("zstd").decompress(io.BytesIO(data[:cut]), io.BytesIO(), name="x.zst")


def test_zstd_corruption_is_an_error():
    z = io.BytesIO()
    get_codec("zstd").compress(io.BytesIO(RAW), z)
    bad = bytearray(z.getvalue())
    bad[len(bad) // 3] ^= 0x10
    with pytest.raises(CodecError, match="x.zst"):
        get_codec("zstd").decompress(io.BytesIO(bytes(bad)), io.BytesIO(), name="x.zst")
    with pytest.raises(CodecError, match="not a zstd stream"):
        get_codec("zstd").decompress(io.BytesIO(b"CKZ-not-zstd"), io.BytesIO(), name="x.zst")
