"""PyTorch Lightning through ``CkptflowCheckpointIO``: the real Lightning trains with DDP on 2
processes (gloo) under torchrun, a worker is SIGKILLed, torchrun restarts both, and
``fit(ckpt_path="last")`` resumes from the newest committed checkpoint, one taken at an epoch's last
batch: the steps the killed attempt ran after it give bitwise the same losses on every rank when run
again (weights, optimizer, scheduler, the data loader's place and — through ``RNGState`` — dropout's
random numbers). And the README's snippet, run as printed, resumes from cold once hot and warm are
gone, in the middle of an epoch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch

from ckptflow.trainer.errors import ConfigError
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
KILL_AT = [int(s) for s in os.environ["KILL_AT"].split(",")]
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
        if attempt < len(KILL_AT) and rank == 1 and trainer.global_step == KILL_AT[attempt]:
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
    max_steps=12, logger=False, enable_progress_bar=False, enable_model_summary=False,
    plugins=[CkptflowCheckpointIO(run_id="lit", root=HOT)],
    callbacks=[RNGState(), Record(),
               ModelCheckpoint(dirpath=os.path.join(OUT, "ckpt"), every_n_train_steps=4, save_last=True)],
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
    env = torchrun_env({"OUT": str(out), "HOT": str(hot), "KILL_AT": "10"})
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]

    run = hot / "lit"
    steps = committed_steps(str(run))
    assert steps == [12, 8, 4], steps
    assert [x["step"] for x in read_outbox(str(run))] == sorted(steps)
    for rank in (0, 1):
        # 8 batches an epoch: step 8 is epoch 0's last batch (a stateful loader's state then says "all
        # yielded", and Lightning would skip epoch 1); the README's test resumes in the middle of one
        a0, a1 = (_losses(out, rank, a) for a in (0, 1))
        assert (max(a0), min(a1), max(a1)) == (10, 9, 12), (a0, a1)
        assert {s: a1[s] for s in (9, 10)} == {s: a0[s] for s in (9, 10)}, (rank, a0, a1)

    # last.ckpt names the newest commit (the same file), and the committed file parses without pickle.
    newest = run / layout.step_name(max(steps))
    assert os.path.samefile(out / "ckpt" / "last.ckpt", newest / FILE)
    m = read_manifest(str(newest))
    assert m.extra["adopted"]["tool"] == "lightning" and list(m.files) == [FILE]
    assert parse_check(str(newest), m)["ok"]
    assert torch.load(out / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == max(steps)

    # A last.ckpt that trails its commit (killed between the commit and the link) still resumes from the newest
    io = CkptflowCheckpointIO(run_id="lit", root=str(hot))
    os.remove(out / "ckpt" / "last.ckpt")
    os.link(run / layout.step_name(8) / FILE, out / "ckpt" / "last.ckpt")
    assert io.load_checkpoint(out / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 12
    (out / "ckpt" / "copied").mkdir()
    shutil.copyfile(run / layout.step_name(8) / FILE, out / "ckpt" / "copied" / "last.ckpt")  # across file systems
    assert io.load_checkpoint(out / "ckpt" / "copied" / "last.ckpt", weights_only=True)["global_step"] == 12

    # A damaged newest checkpoint is set aside (no longer committed) for the newest one before it that verifies
    with open(newest / FILE, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 16)
    back = io.load_checkpoint(out / "ckpt" / "last.ckpt", weights_only=True)
    assert back["global_step"] == 8, back["global_step"]
    assert committed_steps(str(run)) == [8, 4] and io.last() == str(run / layout.step_name(8) / FILE)
    assert json.dumps(back["loops"]["fit_loop"]["epoch_progress"])  # Lightning's own state, whole

    # A fit over this history that resumed from nothing, or from an older step, is refused at its first save,
    # before anything is written; one that resumed from the newest saves
    fresh = CkptflowCheckpointIO(run_id="lit", root=str(hot))
    with pytest.raises(ConfigError, match=r"up to step 8 .* started without resuming.*ckpt_path=io\.last\(\)"):
        fresh.save_checkpoint(back, out / "ckpt" / "fresh.ckpt")
    older = CkptflowCheckpointIO(run_id="lit", root=str(hot))
    older.load_checkpoint(run / layout.step_name(4) / FILE, weights_only=True)
    with pytest.raises(ConfigError, match="resumed from step 4"):
        older.save_checkpoint(back, out / "ckpt" / "older.ckpt")
    assert committed_steps(str(run)) == [8, 4] and not os.path.exists(out / "ckpt" / "fresh.ckpt")
    io.save_checkpoint({**back, "global_step": 9}, out / "ckpt" / "on.ckpt")
    io.teardown()
    assert committed_steps(str(run)) == [9, 8, 4]


# The README's snippet, run as printed (its save interval cut to 3 steps), as one process would: `model`,
# `loader` and the Trainer's length come from this prelude, every other word from the README.
PRELUDE = r"""
import functools, os, types
import lightning
import torch
from torch import nn
from lightning.pytorch.callbacks import ModelCheckpoint

OUT = os.environ["OUT"]
L = types.SimpleNamespace(Trainer=functools.partial(
    lightning.Trainer, accelerator="cpu", devices=1, max_steps=int(os.environ["MAX_STEPS"]),
    enable_progress_bar=False, enable_model_summary=False))


class Model(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))

    def training_step(self, batch, i):
        loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
        with open(OUT, "a") as f:
            f.write(f"{self.trainer.global_step} {loss.item().hex()}\n")
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


lightning.seed_everything(0, verbose=False)
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(24, 8, generator=g), torch.randn(24, 1, generator=g))
# 6 batches an epoch: step 9 is in the middle of the second; a stateful loader resumes there
from torchdata.stateful_dataloader import StatefulDataLoader
loader = StatefulDataLoader(data, batch_size=4, shuffle=True)
model = Model()
"""


def _readme_snippet() -> str:
    text = open(os.path.join(REPO, "README.md")).read()
    block = text.split("**PyTorch Lightning**", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert "every_n_train_steps=500" in block and "ckpt_path=io.last()" in block, block
    return block.replace("every_n_train_steps=500", "every_n_train_steps=3")


def test_the_readme_snippet_resumes_from_cold_when_hot_and_warm_are_gone(tmp_path, s3_endpoint, s3_bucket):
    from ckptflow.tasks.config import load_config
    from ckptflow.tasks.storage import open_tiers
    from ckptflow.tasks.transfer import archive, promote
    from tests.helpers import write_config

    hot = tmp_path / "hot"
    cfg = write_config(tmp_path, hot, s3_endpoint, s3_bucket, hot_keep=5)
    (tmp_path / "fit.py").write_text(PRELUDE + _readme_snippet())

    def fit(script: str, out: str, max_steps: int) -> subprocess.CompletedProcess:
        env = torchrun_env({"OUT": str(tmp_path / out), "MAX_STEPS": str(max_steps), "CKPTFLOW_CONFIG": cfg})
        return subprocess.run([PY, script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    first = fit("fit.py", "first", 12)
    assert first.returncode == 0, first.stderr[-4000:]
    run = hot / "lit"
    assert committed_steps(str(run)) == [12, 9, 6, 3]
    h, warm, cold = open_tiers(load_config(cfg))
    promote(h, warm, "lit", 9)
    archive(warm, cold, "lit", 9)
    shutil.rmtree(run)  # the disk replaced: the run's hot folder and Lightning's logs are gone
    shutil.rmtree(tmp_path / "warm")
    shutil.rmtree(tmp_path / "lightning_logs")

    back = fit("fit.py", "back", 12)
    assert back.returncode == 0, back.stderr[-4000:]
    assert "lit resumes from step 9, from the cold tier" in back.stderr, back.stderr[-3000:]
    a = dict(line.split() for line in open(tmp_path / "first"))
    b = dict(line.split() for line in open(tmp_path / "back"))
    assert sorted(map(int, b)) == [9, 10, 11] and {s: a[s] for s in b} == b  # bitwise the uninterrupted run's
    assert committed_steps(str(run)) == [12, 9], "step 9 brought into hot as committed, step 12 saved anew"
