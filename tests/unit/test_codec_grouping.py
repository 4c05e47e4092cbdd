"""Byte grouping is a bit permutation: split then merge returns every bit pattern."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptflow.tasks.codec.grouping import PLAIN, kind_for_dtype, merge, split


@settings(max_examples=60, deadline=None)
@given(k=st.sampled_from([2, 4, 8]), data=st.data())
def test_split_merge_round_trip_any_bits(k, data):
    n = data.draw(st.integers(0, 64))
    raw = data.draw(st.binary(min_size=n * k, max_size=n * k))
    arr = np.frombuffer(raw, np.uint8)
    streams = split(arr, k)
    assert len(streams) == k and all(s.size == n for s in streams)
    assert merge(streams, k).tobytes() == raw


def test_exponent_stream_is_the_exponent():
    """After the 1-bit rotation, stream 0 of float32/bfloat16 is exactly the 8 exponent bits."""
    x = np.array([1.0, -1.0, 2.0, -0.0, np.inf, 1e-40], np.float32)
    exp = ((x.view(np.uint32) >> 23) & 0xFF).astype(np.uint8)
    assert (split(x.view(np.uint8), 4)[0] == exp).all()
    import torch

    b = torch.tensor([1.0, -3.0, 0.5], dtype=torch.bfloat16).view(torch.int16).numpy()
    assert (split(b.view(np.uint8), 2)[0] == ((b.view(np.uint16) >> 7) & 0xFF)).all()


def test_special_values_survive():
    vals = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 5e-324, -5e-324, 1.7e308], np.float64)
    raw = vals.view(np.uint8).copy()
    raw[:8] = np.frombuffer(np.uint64(0x7FF4000000000ABC).tobytes(), np.uint8)  # NaN payload
    assert merge(split(raw, 8), 8).tobytes() == raw.tobytes()


@pytest.mark.parametrize(
    "dtype,kind",
    [
        ("torch.bfloat16", 2),
        ("float16", 2),
        ("torch.float32", 4),
        ("float64", 8),
        ("complex64", 4),
        ("torch.int64", PLAIN),
        ("bool", PLAIN),
        ("float8_e4m3fn", PLAIN),
        ("uint8", PLAIN),
    ],
)
def test_kind_for_dtype(dtype, kind):
    assert kind_for_dtype(dtype) == kind


def test_split_refuses_partial_elements():
    with pytest.raises(ValueError):
        split(np.zeros(5, np.uint8), 2)
    with pytest.raises(ValueError):
        merge([np.zeros(2, np.uint8), np.zeros(3, np.uint8)], 2)
