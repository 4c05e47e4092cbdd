"""A verified load into tensors on a GPU (``ckptflow/fast/devicecopy.py``), and the same load into host memory.

The CUDA cases run where there is a GPU (CI has none: they were run on an H200, docs/benchmarks.md);
the host cases run everywhere and check the same things. The checkpoint is plain ``dcp.save`` output
with a manifest of its digests (``benchmarks.bench_device_load.plain_checkpoint``).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from benchmarks.bench_device_load import load, plain_checkpoint, tensors
from ckptflow.fast import memcopy

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):  # noqa: ANN201
    """~24 MB in one file of 1 MiB blocks: tensors across block boundaries, several runs of blocks."""
    state = tensors(24)
    path = str(tmp_path_factory.mktemp("device-load") / "ckpt")
    return path, state, plain_checkpoint(path, state)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("native", [True, False], ids=["one-call", "python-loop"])
def test_a_load_into_device_tensors_is_bitwise_and_a_bad_block_reaches_no_destination(
    saved, tmp_path, monkeypatch, device, native
):
    """Every tensor arrives bitwise. A flipped byte fails the load naming its file and block, none of
    that block's bytes reach the model, and nothing is still being copied once the load returned."""
    path, state, manifest = saved
    if not native:
        monkeypatch.setattr(memcopy, "VERIFY_COPY", False)
    elif not memcopy.VERIFY_COPY:
        pytest.skip("no C extension")
    target = {k: torch.zeros_like(v, device=device) for k, v in state.items()}
    load(path, manifest, target)
    assert [k for k, v in state.items() if not torch.equal(target[k].cpu(), v)] == []

    # The largest tensor's bytes, one flipped in the middle, in a copy of the checkpoint.
    big = max(state, key=lambda k: state[k].nbytes)
    raw = state[big].reshape(-1).view(torch.uint8).numpy().tobytes()
    bad = str(tmp_path / "bad")
    shutil.copytree(path, bad)
    (name,) = [n for n in os.listdir(bad) if n.endswith(".distcp")]
    with open(os.path.join(bad, name), "r+b") as f:
        at = f.read().find(raw[:64])
        assert at > 0
        f.seek(at + len(raw) // 2)
        f.write(bytes([raw[len(raw) // 2] ^ 0xFF]))
    bs = manifest.files[name].block_size
    k = (at + len(raw) // 2) // bs
    for v in target.values():
        v.zero_()
    with pytest.raises(RuntimeError, match=rf"{name}: checksum .* \(block {k}\)"):
        load(bad, manifest, target)
    got = target[big].reshape(-1).view(torch.uint8).cpu()
    lo, hi = max(0, k * bs - at), min(len(raw), (k + 1) * bs - at)
    assert not got[lo:hi].any()  # none of the bad block's bytes
    if device != "cpu":
        torch.cuda.synchronize()
    assert torch.equal(target[big].reshape(-1).view(torch.uint8).cpu(), got)  # nothing landed after the load

    load(path, manifest, target)  # the intact checkpoint overwrites what the failed load copied
    assert [k for k, v in state.items() if not torch.equal(target[k].cpu(), v)] == []
