"""The bytegroup codec: bit-exact round trips, and damage is always reported, never decoded.

Invariants under test:
* decompress(compress(x, any dtype map)) == x for any bytes and any map — a map is
  only a hint, even a wrong one (misaligned, overlapping the end of the file);
* a truncated or corrupted container raises ``ContainerError`` naming the chunk,
  and what was written before the error is a prefix of the original bytes.
"""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptflow.tasks.codec import ContainerError, DtypeMap, Range, get_codec
from ckptflow.tasks.codec.bytegroup import BytegroupCodec
from ckptflow.trainer.errors import CodecError
from ckptflow.trainer.format.checksum import hash_bytes

CHUNK = 4096  # the smallest chunk: small inputs still span many chunks
DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "complex64": 8, "int32": 4, "int8": 1, "bool": 1}


def roundtrip(raw: bytes, dmap: DtypeMap | None, threads: int = 2, level=None) -> bytes:
    codec = BytegroupCodec(chunk_size=CHUNK)
    z = io.BytesIO()
    st1 = codec.compress(io.BytesIO(raw), z, dtype_map=dmap, threads=threads, level=level)
    out = io.BytesIO()
    st2 = codec.decompress(io.BytesIO(z.getvalue()), out, threads=threads)
    assert st1.raw_bytes == st2.raw_bytes == len(raw)
    assert st1.raw_checksum == st2.raw_checksum == hash_bytes(raw)
    assert st1.stored_checksum == st2.stored_checksum == hash_bytes(z.getvalue())
    assert st1.stored_bytes == len(z.getvalue())
    return out.getvalue()


@st.composite
def shard_files(draw):
    """Plain bytes interleaved with tensors of any dtype and bit pattern, plus their map."""
    buf, ranges = bytearray(), []
    for _ in range(draw(st.integers(0, 6))):
        buf += draw(st.binary(max_size=300))
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        n = draw(st.integers(0, 3000)) * DTYPES[dtype]
        # raw bits: every NaN payload, infinity, subnormal and signed zero is reachable
        data = draw(
            st.one_of(
                st.binary(min_size=n, max_size=n), st.sampled_from([b"\x00", b"\xff", b"\x80"]).map(lambda b: b * n)
            )
        )
        ranges.append(Range(len(buf), n, dtype))
        buf += data
    buf += draw(st.binary(max_size=100))
    return bytes(buf), ranges


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(f=shard_files(), skew=st.integers(-3, 3), threads=st.sampled_from([1, 3]))
def test_round_trip_bit_exact_with_right_or_wrong_maps(f, skew, threads):
    raw, ranges = f
    assert roundtrip(raw, DtypeMap.from_ranges(ranges), threads) == raw
    # a skewed map (misaligned, running past the end of the file) still round-trips
    bad = [Range(max(0, r.offset + skew), r.length + 5, r.dtype) for r in ranges]
    bad_sorted, end = [], 0
    for r in sorted(bad, key=lambda r: r.offset):
        if r.offset >= end:
            bad_sorted.append(r)
            end = r.offset + r.length
    assert roundtrip(raw, DtypeMap.from_ranges(bad_sorted), threads) == raw


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_special_float_values(dtype):
    finfo = torch.finfo(dtype)
    t = torch.tensor(
        [
            float("nan"),
            float("inf"),
            -float("inf"),
            0.0,
            -0.0,
            finfo.tiny,
            finfo.tiny / 4,
            -finfo.tiny / 2,
            finfo.max,
            finfo.min,
            1.0,
            -1.5,
        ]
        * 50,
        dtype=dtype,
    )
    raw = bytearray(t.view(torch.uint8).numpy().tobytes())
    raw[0 : t.element_size()] = b"\x01" + b"\xff" * (t.element_size() - 1)  # NaN with a payload
    dmap = DtypeMap((Range(0, len(raw), str(dtype)),))
    for level in (None, 9):
        assert roundtrip(bytes(raw), dmap, level=level) == bytes(raw)


def test_empty_input_and_no_map():
    assert roundtrip(b"", None) == b""
    assert roundtrip(b"", DtypeMap((Range(0, 100, "float32"),))) == b""
    raw = bytes(range(256)) * 100
    assert roundtrip(raw, None) == raw


def test_grouping_beats_plain_on_float_weights():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 1024, generator=g) * 0.02).to(torch.bfloat16)
    raw = w.view(torch.uint8).numpy().tobytes()
    codec = get_codec("bytegroup")
    with_map, without = io.BytesIO(), io.BytesIO()
    codec.compress(io.BytesIO(raw), with_map, dtype_map=DtypeMap((Range(0, len(raw), "bfloat16"),)))
    codec.compress(io.BytesIO(raw), without)
    assert len(raw) / len(with_map.getvalue()) > 1.3
    assert len(with_map.getvalue()) < 0.9 * len(without.getvalue())


# ---- damage ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def container():
    rng = np.random.default_rng(1)
    floats = (rng.standard_normal(6000) * 0.02).astype(np.float32).tobytes()
    raw = b"header" * 100 + floats + bytes(5000) + floats[:4000]
    dmap = DtypeMap((Range(600, len(floats), "float32"),))
    z = io.BytesIO()
    BytegroupCodec(chunk_size=CHUNK).compress(io.BytesIO(raw), z, dtype_map=dmap)
    return raw, z.getvalue()


def _decode(data: bytes):
    out = io.BytesIO()
    try:
        get_codec("bytegroup").decompress(io.BytesIO(data), out, name="shard.ckz")
        return None, out.getvalue()
    except CodecError as e:
        return e, out.getvalue()


def test_truncation_anywhere_is_an_error_naming_the_chunk(container):
    raw, z = container
    cuts = sorted(set(range(0, len(z), 37)) | {len(z) - 1, len(z) - 48, len(z) - 49, 8, 16})
    for cut in cuts:
        err, out = _decode(z[:cut])
        assert isinstance(err, ContainerError), f"cut at {cut} decoded without error"
        assert raw.startswith(out), f"cut at {cut} produced wrong bytes"
        assert "shard.ckz" in str(err)
        if cut >= z.index(b"CKZC"):  # past the file header, errors name a chunk
            assert err.chunk is not None and f"chunk {err.chunk}" in str(err)


def test_bit_flips_are_detected_never_decoded(container):
    raw, z = container
    rnd = random.Random(7)
    positions = set(range(0, 120)) | set(range(len(z) - 60, len(z)))
    positions |= {rnd.randrange(len(z)) for _ in range(250)}
    for pos in sorted(positions):
        bad = bytearray(z)
        bad[pos] ^= 1 << rnd.randrange(8)
        err, out = _decode(bytes(bad))
        assert isinstance(err, ContainerError), f"flip at {pos} went undetected"
        assert raw.startswith(out), f"flip at {pos} produced wrong bytes"


def test_trailing_garbage_and_foreign_input(container):
    raw, z = container
    err, _ = _decode(z + b"x")
    assert isinstance(err, ContainerError) and "after the end record" in str(err)
    zst = io.BytesIO()
    get_codec("zstd").compress(io.BytesIO(raw), zst)
    err, out = _decode(zst.getvalue())
    assert "plain zstd" in str(err) and out == b""
    err, _ = _decode(b"")
    assert isinstance(err, ContainerError)


def test_bad_parameters():
    from ckptflow.trainer.errors import ConfigError

    with pytest.raises(ConfigError):
        BytegroupCodec(chunk_size=10)
    with pytest.raises(ConfigError):
        get_codec("bytegroup").compress(io.BytesIO(b"x"), io.BytesIO(), level=99)
    with pytest.raises(ConfigError):
        get_codec("bytegroup").compress(io.BytesIO(b"x"), io.BytesIO(), threads=0)
    with pytest.raises(ConfigError):
        get_codec("lzma")
