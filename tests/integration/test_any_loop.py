"""Exact resume for a loop nobody on the project wrote (``tests/loops/user_loop.py``).

A CNN with BatchNorm and Dropout, AdamW + OneCycleLR, fp16 autocast + GradScaler, gradient
accumulation, torchdata's StatefulDataLoader over a DistributedSampler as ``sampler=``. A
worker is SIGKILLed during staging and, after the restart, during persist; torchrun restarts
the job each time, it resumes,
and after the last step every rank's *whole* state — parameters, buffers, optimizer,
scheduler, scaler, data loader — is bitwise the uninterrupted run's. Not only the loss curve:
train-mode BatchNorm normalises with batch statistics, so a wrong running mean never shows
in the loss.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from ckptflow.trainer.format import layout
from ckptflow.trainer.state import states_equal
from tests.helpers import PY, run_torchrun, torchrun_env

LOOP = "tests.loops.user_loop"
NPROC = {"none": 1, "ddp": 2, "fsdp": 2}


def _run(
    tmp, parallel: str, *, fault: str | None = None, restarts: int = 0, nproc: int | None = None, steps: int = 12
) -> subprocess.CompletedProcess:
    env = {"CKPTFLOW_FAULT": fault} if fault else None
    return run_torchrun(
        ["--parallel", parallel, "--root", str(tmp / "root"), "--out", str(tmp / "out"), "--steps", str(steps)],
        nproc=nproc or NPROC[parallel],
        max_restarts=restarts,
        env=env,
        module=LOOP,
    )


def _final(tmp, rank: int) -> dict:
    return torch.load(os.path.join(tmp, "out", f"final_rank{rank}.pt"), weights_only=False)


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    out = {}
    for par in NPROC:
        tmp = tmp_path_factory.mktemp(f"base-{par}")
        r = _run(tmp, par)
        assert r.returncode == 0, r.stderr[-3000:]
        out[par] = tmp
    return out


@pytest.mark.parametrize("parallel", list(NPROC))
def test_killed_mid_save_resumes_to_the_same_whole_state(baselines, tmp_path, parallel):
    """One job, two kills: during the staging of step 8's save, then (after the restart) while DCP
    persists the shards of step 8's save again; each time the job resumes from step 4."""
    victim = 1 if NPROC[parallel] > 1 else 0
    fault = f"staging@8:rank{victim}:attempt0,write@8:rank{victim}:attempt1"
    r = _run(tmp_path, parallel, fault=fault, restarts=2)
    assert r.returncode == 0, r.stderr[-3000:]
    for attempt in (1, 2):  # the faults killed a worker twice; the job resumed each time
        assert f"rank={victim} attempt={attempt} start=4" in r.stderr, r.stderr[-3000:]
    for rank in range(NPROC[parallel]):
        got, want = _final(tmp_path, rank), _final(baselines[parallel], rank)
        for part in ("model", "optim", "sched", "scaler", "loader", "epoch"):
            assert states_equal(got[part], want[part]), f"rank {rank}: {part} differs after the resume"


def test_replicated_state_is_saved_from_rank_0_and_plain_dcp_reads_it(baselines, tmp_path):
    """DDP: the checkpoint's model (BatchNorm statistics included) is rank 0's live model at that
    step, bit for bit — read by vanilla PyTorch, with ckptflow not importable at all.

    (Fails with DCP's default planner: it writes each replicated entry from the least-loaded
    rank, so bn1's statistics came from rank 1 and bn2's from rank 0.)
    """
    ckpt = os.path.join(baselines["ddp"], "root", "user", layout.step_name(12))
    out = tmp_path / "plain.pt"
    code = (
        "import sys; sys.modules['ckptflow'] = None\n"  # any import of ckptflow now fails
        "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
        f"dcp_to_torch_save({ckpt!r}, {str(out)!r})\n"
    )
    r = subprocess.run(
        [PY, "-c", code], cwd=str(tmp_path), env=torchrun_env(), capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    plain = torch.load(out, weights_only=False)
    live = torch.load(os.path.join(baselines["ddp"], "out", "live_step12.pt"), weights_only=False)
    assert sorted(plain["model"]) == sorted(live)
    assert any("running_mean" in k for k in live)
    for k, v in live.items():
        assert torch.equal(plain["model"][k], v), k


def test_per_rank_state_at_another_world_size_is_shared_if_equal_else_a_clear_error(baselines, tmp_path):
    """At world size 1 after 2: the data loaders' states were equal on both ranks (a
    DistributedSampler derives its indices from rank and epoch), so the one rank takes it; the
    loop's ``extra`` differed (each rank's last sample), and one rank cannot take either as its
    own — without a ``reshard_state`` hook the resume says so and names the option."""
    import shutil

    shutil.copytree(os.path.join(baselines["ddp"], "root"), tmp_path / "root")
    r = _run(tmp_path, "ddp", nproc=1)
    assert r.returncode != 0
    assert "extra state was saved per rank at world size 2" in r.stderr and "reshard_state" in r.stderr, r.stderr[
        -3000:
    ]
    assert "sampler state" not in r.stderr


def test_the_checkpoint_keeps_each_ranks_own_state(baselines):
    """Under DDP each rank's loader position and buffers are kept apart (and differ)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = os.path.join(baselines["ddp"], "root", "user", layout.step_name(12))
    out = os.path.join(baselines["ddp"], "as_torch.pt")
    dcp_to_torch_save(ckpt, out)
    sd = torch.load(out, weights_only=False)
    from ckptflow.trainer.safetree import decode

    r0, r1 = (decode(sd["ranks"][f"rank{r}"].numpy().tobytes()) for r in (0, 1))
    assert not states_equal(r0["extra"], r1["extra"]) and not states_equal(r0["rng"], r1["rng"])
    assert set(r0["buffers"]) == {k for k in sd["model"] if "running" in k or "num_batches" in k}
    assert states_equal(r0["buffers"], {k: sd["model"][k] for k in r0["buffers"]})  # model = rank 0's
