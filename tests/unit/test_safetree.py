"""ckptflow's own state is saved without pickle: the encoding round-trips what state dicts
hold, refuses what it cannot hold (naming where), and a damaged entry is an IntegrityError."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptflow.trainer.errors import IntegrityError
from ckptflow.trainer.safetree import PAD, UnsupportedStateError, decode, encode, encode_tensor
from ckptflow.trainer.state import capture_rng, states_equal

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=40),
)
trees = st.recursive(
    leaves,
    lambda c: st.one_of(
        st.lists(c, max_size=4),
        st.tuples(c, c),
        st.dictionaries(st.one_of(st.text(max_size=5), st.integers()), c, max_size=4),
    ),
    max_leaves=20,
)


def _same(a, b) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@settings(max_examples=150, deadline=None)
@given(trees)
def test_plain_values_round_trip_with_their_types(x):
    assert _same(decode(encode(x)), x)


def test_rng_states_tensors_and_arrays_round_trip_bitwise():
    random.random()
    state = {
        "rng": capture_rng(),
        "t": torch.randn(3, 4)[:, 1:],
        "half": torch.ones(2, dtype=torch.bfloat16),
        "scalar": torch.tensor(7),
        "empty": torch.empty(0, 3),
        "arr": np.arange(6, dtype=np.uint32).reshape(2, 3),
        "np_scalar": np.float32(1.5),
        "bool": torch.tensor([True, False]),
    }
    back = decode(encode_tensor(state).numpy().tobytes())
    assert states_equal(back, state)
    random.setstate(back["rng"]["python"])
    np.random.set_state(back["rng"]["numpy"])
    torch.set_rng_state(back["rng"]["torch"])


def test_what_cannot_be_saved_safely_is_refused_naming_where():
    with pytest.raises(UnsupportedStateError, match=r"state\.sampler\.when is a datetime\.datetime"):
        import datetime

        encode({"sampler": {"when": datetime.datetime.now()}})
    with pytest.raises(UnsupportedStateError, match="Python objects"):
        encode(np.array([object()]))


@pytest.mark.parametrize("damage", [b"", b"garbage", b"CKPTTREE1\n\xff\xff\xff\xff\xff\xff\xff\x00{"])
def test_a_damaged_entry_is_an_integrity_error(damage):
    with pytest.raises(IntegrityError):
        decode(damage, source="x")


def test_a_pickle_is_not_a_state_entry():
    import pickle

    with pytest.raises(IntegrityError, match="not a ckptflow state entry"):
        decode(pickle.dumps({"a": 1}))


def test_the_tensor_encoding_keeps_its_size_while_the_state_changes_a_little():
    # A rank's entry is one uint8 tensor in DCP's plan: a size that moves with the digits of a
    # number would change the plan at every save and defeat DCP's plan caching (saver.py).
    a = encode_tensor({"pos": 7, "loss": 0.5, "rng": list(range(600))})
    b = encode_tensor({"pos": 123456789, "loss": 0.123456789012, "rng": list(range(600))})
    assert len(encode({"pos": 7})) != len(encode({"pos": 123456789}))
    assert a.numel() == b.numel() and a.numel() % PAD == 0
    assert decode(b.numpy().tobytes())["pos"] == 123456789
    # Entries written before the padding (exactly encode's bytes) still decode.
    assert decode(encode({"pos": 7}))["pos"] == 7
