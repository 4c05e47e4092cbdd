"""ckptflow's Lightning plugin against Lightning's own asynchronous checkpoint I/O, in one run.

    python -m benchmarks.bench_lightning [--mb 100] [--steps 100] [--save-every 10] [--batch 64]
        [--rounds 3] [--no-save-last] [--root DIR] [--json PATH]

The loop: a ``LightningModule`` MLP on CPU, one process, AdamW, ``--mb`` MB of state (parameters
and both Adam moments), ``ModelCheckpoint(every_n_train_steps=--save-every, save_last=True)`` —
the ``last.ckpt`` that ``fit(ckpt_path="last")`` resumes from. Three arms:

``none``       no checkpoint (``enable_checkpointing=False``): the baseline;
``lightning``  ``AsyncCheckpointIO(TorchCheckpointIO())``, Lightning's own: each save's tensors
               cloned on the training thread, ``torch.save`` in a thread;
``ckptflow``   ``CkptflowCheckpointIO``: the tensors copied into buffers kept from the last save,
               then ``torch.save``, fsync, digests, manifest, commit and the outbox record in a
               thread; ``last.ckpt`` a link to the committed file.

Measured per arm: **stall**, the time ``ModelCheckpoint``'s batch-end hook holds the training
thread per save (Lightning's state dict, then the plugin's call: both arms alike), median over
saves; **CPU per save**, the process's CPU time (every thread; ``fit`` returns after the last
save is drained) minus the no-checkpoint arm's in the same round, per save; **wall overhead**
against that arm. Each arm runs in a fresh process; a round runs the three, in an order rotated
by one per round, so drift of a shared host cancels in the per-round differences.

Targets: ckptflow's stall and CPU per save <= Lightning's. Printed as ratios ckptflow /
Lightning. A missed target is a result, not an error.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = ("none", "lightning", "ckptflow")
TARGETS = {"stall": 1.0, "cpu_per_save": 1.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_lightning",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--mb", type=float, default=100.0, help="model + Adam state, MB (1e6 bytes)")
    p.add_argument("--steps", type=int, default=100, help="training steps per arm and round")
    p.add_argument("--save-every", type=int, default=10, help="steps between saves")
    p.add_argument("--batch", type=int, default=64, help="samples per step")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each running every arm once (order rotated)")
    p.add_argument("--no-save-last", action="store_true", help="ModelCheckpoint without save_last")
    p.add_argument("--root", help="checkpoints go here (default: a temp dir, removed after)")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # one arm, in this process
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for name in ("mb", "steps", "save_every", "rounds", "batch"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    return a


# -- one arm, in its own process ---------------------------------------------------------------
def run_arm(a: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
    from torch import nn

    from ckptflow.integrations.lightning import CkptflowCheckpointIO

    torch.set_num_threads(1)
    width = 1024
    # 3 copies of the parameters (weights, two Adam moments), 4 bytes each
    layers = max(1, round(a.mb * 1e6 / 12 / (width * width + width)))

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

        def training_step(self, batch: Any, i: int) -> Any:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    stalls: list[float] = []

    class Timed(ModelCheckpoint):
        def on_train_batch_end(self, trainer: Any, *args: Any, **kw: Any) -> None:
            t0 = time.perf_counter()
            super().on_train_batch_end(trainer, *args, **kw)
            if trainer.global_step % a.save_every == 0:
                stalls.append(time.perf_counter() - t0)

    root = a.root
    plugins: list[Any] = []
    callbacks: list[Any] = []
    if a.arm == "lightning":
        plugins = [AsyncCheckpointIO(TorchCheckpointIO())]
    elif a.arm == "ckptflow":
        plugins = [CkptflowCheckpointIO(run_id="bench", root=os.path.join(root, "hot"))]
    if a.arm != "none":
        callbacks = [
            Timed(
                dirpath=os.path.join(root, "ckpt"),
                every_n_train_steps=a.save_every,
                save_last=not a.no_save_last,
                save_top_k=1,
            )
        ]
    data = torch.utils.data.TensorDataset(torch.randn(a.steps * a.batch, width))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=a.steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=a.arm != "none",
        plugins=plugins,
        callbacks=callbacks,
    )
    model = Model()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=a.batch))
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    state = sum(p.numel() * p.element_size() * 3 for p in model.parameters())
    return {
        "arm": a.arm,
        "wall_s": wall,
        "cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
        "stalls_s": stalls,
        "saves": len(stalls),
        "state_mb": state / 1e6,
    }


# -- the rounds --------------------------------------------------------------------------------
def one(a: argparse.Namespace, arm: str, folder: str) -> dict[str, Any]:
    os.makedirs(folder, exist_ok=True)
    out = os.path.join(folder, "result.json")
    cmd = [sys.executable, "-m", "benchmarks.bench_lightning", "--arm", arm, "--out", out, "--root", folder]
    cmd += ["--mb", str(a.mb), "--steps", str(a.steps), "--save-every", str(a.save_every), "--batch", str(a.batch)]
    cmd += ["--no-save-last"] if a.no_save_last else []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("PREFECT_API_URL", None)
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"arm {arm} failed (rc={r.returncode}):\n{r.stderr[-4000:]}")
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def med(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.arm:
        res = run_arm(a)
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(res, f)
        return 0
    root = a.root or tempfile.mkdtemp(prefix="bench_lightning_")
    rounds = []
    try:
        for n in range(a.rounds):
            k = n % len(ARMS)
            order = list(ARMS[k:] + ARMS[:k])
            res = {arm: one(a, arm, os.path.join(root, f"round{n}", arm)) for arm in order}
            for arm in order:
                shutil.rmtree(os.path.join(root, f"round{n}", arm), ignore_errors=True)
            rounds.append(res)
            print(f"round {n + 1}/{a.rounds} ({', '.join(order)}) done", file=sys.stderr)
    finally:
        if not a.root:
            shutil.rmtree(root, ignore_errors=True)
    figs: dict[str, Any] = {}
    for arm in ("lightning", "ckptflow"):
        stalls = [s for r in rounds for s in r[arm]["stalls_s"]]
        cpu = [(r[arm]["cpu_s"] - r["none"]["cpu_s"]) / r[arm]["saves"] for r in rounds]
        over = [(r[arm]["wall_s"] / r["none"]["wall_s"] - 1) * 100 for r in rounds]
        figs[arm] = {
            "stall_s": med(stalls),
            "cpu_per_save_s": med(cpu),
            "overhead_pct": med(over),
            "saves": rounds[0][arm]["saves"],
        }
    ratios = {
        "stall": figs["ckptflow"]["stall_s"] / figs["lightning"]["stall_s"],
        "cpu_per_save": figs["ckptflow"]["cpu_per_save_s"] / figs["lightning"]["cpu_per_save_s"],
    }
    mb = rounds[0]["none"]["state_mb"]
    print(
        f"Lightning MLP, {mb:.1f} MB of state, {a.steps} steps, a save every {a.save_every} "
        f"(save_last={not a.no_save_last}), {a.rounds} rounds; {platform.node()}, {os.cpu_count()} cores"
    )
    print(f"{'arm':<34}{'stall':>10}{'CPU/save':>11}{'wall overhead':>15}")
    names = {"lightning": "AsyncCheckpointIO(TorchCheckpointIO)", "ckptflow": "CkptflowCheckpointIO"}
    for arm in ("lightning", "ckptflow"):
        f = figs[arm]
        print(f"{names[arm]:<34}{f['stall_s'] * 1e3:>8.1f}ms{f['cpu_per_save_s']:>10.3f}s{f['overhead_pct']:>+14.1f}%")
    for k, v in ratios.items():
        print(
            f"ckptflow / Lightning {k}: {v:.2f}x "
            f"(target <= {TARGETS[k]:.1f}x: {'met' if v <= TARGETS[k] else 'missed'})"
        )
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"figures": figs, "ratios": ratios, "rounds": rounds, "args": vars(a)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
