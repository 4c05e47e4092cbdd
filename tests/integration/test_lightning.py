"""PyTorch Lightning through ``CkptflowCheckpointIO``: the real Lightning trains with DDP on 2
processes (gloo) under torchrun, a worker is SIGKILLed mid-run, torchrun restarts both, and
``fit(ckpt_path="last")`` resumes from the newest committed checkpoint: the steps the first attempt
ran after that checkpoint give bitwise the same losses on every rank when run again (weights,
optimizer, scheduler, the data loader's place mid-epoch and — through ``RNGState`` — dropout's
random numbers)."""

from __future__ import annotations

import json
import os
import subprocess

import torch

from ckptflow.trainer.format import layout
from ckptflow.trainer.format.commit import committed_steps
from tests.helpers import PY, REPO, torchrun_env

SCRIPT = r"""
import datetime, os, signal, sys
import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from ckptflow.integrations.lightning import CkptflowCheckpointIO, RNGState

OUT, HOT = os.environ["OUT"], os.environ["HOT"]
KILL_AT = int(os.environ["KILL_AT"])
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))

    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 4, 0.5)]


class Record(L.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, i):
        with open(os.path.join(OUT, f"losses.r{rank}.a{attempt}"), "a") as f:
            f.write(f"{trainer.global_step} {outputs['loss'].item().hex()}\n")
        if attempt == 0 and rank == 1 and trainer.global_step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)


# torchrun keeps its store across restarts: on gloo a group built on it finds the killed attempt's
# addresses, so each attempt builds its group on a prefix of its own (Lightning then uses it).
timeout = datetime.timedelta(seconds=60)
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}/", store), rank=rank, world_size=2,
                        timeout=timeout)
L.seed_everything(0, verbose=False)
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
# A sampler that saves its epoch and place: Lightning's own (use_distributed_sampler) is rebuilt at
# epoch 0's order on a resume in the middle of an epoch.
loader = StatefulDataLoader(data, batch_size=4, sampler=StatefulDistributedSampler(data, shuffle=True, seed=0))
trainer = L.Trainer(
    accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timeout), use_distributed_sampler=False,
    max_steps=14, logger=False, enable_progress_bar=False, enable_model_summary=False,
    plugins=[CkptflowCheckpointIO(run_id="lit", root=HOT)],
    callbacks=[RNGState(), Record(),
               ModelCheckpoint(dirpath=os.path.join(OUT, "ckpt"), every_n_train_steps=3, save_last=True)],
)
trainer.fit(Model(), loader, ckpt_path="last")
sys.stdout.flush()
os._exit(0)  # no interpreter finalization racing gloo's threads
"""


def _losses(out, rank: int, attempt: int) -> dict[int, str]:
    with open(os.path.join(out, f"losses.r{rank}.a{attempt}")) as f:
        return {int(s): v for s, v in (line.split() for line in f)}


def test_a_ddp_run_killed_mid_run_resumes_from_the_last_commit_to_the_same_losses(tmp_path):
    from ckptflow.integrations.lightning import FILE, CkptflowCheckpointIO
    from ckptflow.tasks.adopt import parse_check
    from ckptflow.trainer.events import read_outbox
    from ckptflow.trainer.format.manifest import read_manifest

    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    out, hot = tmp_path / "out", tmp_path / "hot"
    out.mkdir()
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1"]
    cmd += ["--monitor-interval=0.5", str(script)]
    env = torchrun_env({"OUT": str(out), "HOT": str(hot), "KILL_AT": "11"})
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]

    run = hot / "lit"
    steps = committed_steps(str(run))
    assert {3, 6, 9, 12} <= set(steps), steps
    assert [x["step"] for x in read_outbox(str(run))] == sorted(steps)
    for rank in (0, 1):
        first, again = _losses(out, rank, 0), _losses(out, rank, 1)
        assert max(first) == 11 and min(again) == 10 and max(again) == 14, (first, again)  # resumed after step 9
        assert {s: again[s] for s in (10, 11)} == {s: first[s] for s in (10, 11)}, (rank, first, again)

    # last.ckpt names the newest commit (the same file), and the committed file parses without pickle.
    newest = run / layout.step_name(max(steps))
    assert os.path.samefile(out / "ckpt" / "last.ckpt", newest / FILE)
    m = read_manifest(str(newest))
    assert m.extra["adopted"]["tool"] == "lightning" and list(m.files) == [FILE]
    assert parse_check(str(newest), m)["ok"]
    assert torch.load(out / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == max(steps)

    # A damaged newest checkpoint is passed over for the newest one before it that verifies.
    with open(newest / FILE, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 16)
    io = CkptflowCheckpointIO(run_id="lit", root=str(hot))
    back = io.load_checkpoint(out / "ckpt" / "last.ckpt", weights_only=True)
    assert back["global_step"] == sorted(steps)[-2], back["global_step"]
    assert json.dumps(back["loops"]["fit_loop"]["epoch_progress"])  # Lightning's own state, whole
