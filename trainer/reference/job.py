"""The reference training job: an example user of the library, three calls and nothing else.

    torchrun --standalone --nproc-per-node=2 --max-restarts=1 -m ckptflow.trainer.train \
        --ckpt-root DIR --run-id ID --max-steps 200 --save-every 20

A small decoder-only transformer on deterministic synthetic data, AdamW, warm-up +
cosine LR, FSDP2 across ranks. Rank 0 appends ``{"step", "loss", "lr"}`` per step to
``DIR/ID/metrics.jsonl`` (plus the torchrun attempt, so restarts are visible).
Checkpointing is the three ``CheckpointManager`` calls and nothing else.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import cast

import torch.distributed as dist

from ckptflow.trainer import faults
from ckptflow.trainer.checkpointer import CheckpointManager
from ckptflow.trainer.config import CheckpointConfig, Provenance, SanitySpec
from ckptflow.trainer.distenv import init_distributed, shutdown
from ckptflow.trainer.reference import threadcpu
from ckptflow.trainer.reference.build import BUILDER, TrainConfig, build
from ckptflow.trainer.reference.data import GlobalSampler
from ckptflow.trainer.reference.metrics import metrics_path
from ckptflow.trainer.reference.model import ModelConfig, lm_loss
from ckptflow.trainer.state import reseed_rng


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m ckptflow.trainer.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--ckpt-root", required=True, help="hot-tier root folder")
    p.add_argument("--run-id", required=True)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument(
        "--save-every",
        type=_interval,
        default=100,
        help="checkpoint interval in steps, or 'auto' (picked from measured costs; needs --mtbf-hours)",
    )
    p.add_argument("--mtbf-hours", type=float, default=None, help="with --save-every auto: the job's MTBF")
    p.add_argument("--model", default="small", help="preset: tiny (0.1M), mini (2.2M), small (~14M), medium (~70M)")
    p.add_argument("--dropout", type=float, default=None, help="override the preset's dropout")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--schedule-steps", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--parallel", default="fsdp", choices=["fsdp", "ddp", "none"])
    p.add_argument("--async-mode", default="async_staging", choices=["async_staging", "sync"])
    p.add_argument("--no-save", action="store_true", help="train without checkpoints (benchmarks)")
    p.add_argument(
        "--probe",
        default="live",
        choices=["live", "next-step"],
        help="the sanity reference loss: a forward pass on the training thread at every save (live, the "
        "default), or the loss of the first step after each save, which the loop computes anyway "
        "(next-step; SanitySpec.reference)",
    )
    p.add_argument(
        "--resume",
        default="auto",
        choices=["auto", "never", "required"],
        help="auto: go on from the newest checkpoint that verifies, on hot or the tiers; never: start at step 0 "
        "(refused where the run id has checkpoints); required: fail without one",
    )
    p.add_argument(
        "--tiers",
        default="auto",
        help="where a resume looks beyond --ckpt-root: auto (the config the CLI reads), a config path, or none",
    )
    p.add_argument("--tiers-wait-s", type=float, default=60.0, help="how long a resume retries a tier it cannot list")
    p.add_argument(
        "--allow-mismatch", action="store_true", help="resume even if the config hash or data fingerprint differs"
    )
    p.add_argument("--on-save-error", default="raise", choices=["raise", "continue"])
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (demos)")
    p.add_argument(
        "--hot-scope",
        default="auto",
        choices=["auto", "node", "shared"],
        help="whether --ckpt-root is each node's own disk or shared (auto: find out)",
    )
    p.add_argument("--replicas", type=int, default=2, help="node-local roots: nodes holding each shard (1: none)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="the training collectives' timeout")
    p.add_argument(
        "--ckpt-timeout-s", type=float, default=600.0, help="the checkpoint group's: replication, the commit's votes"
    )
    return p.parse_args(argv)


def _interval(v: str) -> int | str:
    if v == "auto":
        return v
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r} is not a number of steps or 'auto'") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(rank)s %(name)s: %(message)s")
    env = init_distributed(timeout_s=args.timeout_s, ckpt_timeout_s=args.ckpt_timeout_s)
    old = logging.getLogRecordFactory()

    def factory(*a, **k):
        r = old(*a, **k)
        r.rank = env.rank
        return r

    logging.setLogRecordFactory(factory)
    mcfg = ModelConfig.preset(args.model)
    if args.dropout is not None:
        mcfg = ModelConfig.from_dict({**mcfg.to_dict(), "dropout": args.dropout})  # validates
    tcfg = TrainConfig(
        model=mcfg.to_dict(),
        global_batch=args.global_batch,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        schedule_steps=args.schedule_steps,
        seed=args.seed,
        parallel=args.parallel,
    )
    b = build(tcfg.to_dict())
    sampler = GlobalSampler(tcfg.data(), global_batch=tcfg.global_batch, rank=env.rank, world_size=env.world_size)
    reseed_rng(tcfg.seed * 1000 + env.rank)  # fresh start: distinct dropout streams per rank
    ckpt = CheckpointManager(
        CheckpointConfig(
            root=args.ckpt_root,
            run_id=args.run_id,
            interval=args.save_every,
            mtbf_hours=args.mtbf_hours,
            async_mode=args.async_mode,
            enabled=not args.no_save,
            allow_mismatch=args.allow_mismatch,
            resume=args.resume,
            tiers=args.tiers,
            tiers_wait_s=args.tiers_wait_s,
            on_save_error=args.on_save_error,
            hot_scope=args.hot_scope,
            replicas=args.replicas,
        ),
        model=b.model,
        optimizer=b.optimizer,
        scheduler=b.scheduler,
        sampler=sampler,
        provenance=Provenance(config=tcfg.to_dict(), data_fingerprint=tcfg.data().fingerprint()),
        sanity=SanitySpec(
            builder=BUILDER,
            config=tcfg.to_dict(),
            probe_tokens=b.probe.tolist(),
            probe_fn=b.probe_loss,
            reference="next_step" if args.probe == "next-step" else "probe",
        ),
        env=env,
    )
    t_load = time.perf_counter()
    start = ckpt.load()
    load_s = time.perf_counter() - t_load
    if env.rank == 0:
        os.makedirs(ckpt.run_path, exist_ok=True)
    mf = open(metrics_path(ckpt.run_path), "a", buffering=1) if env.rank == 0 else None
    cpu_at_start = threadcpu.snapshot()
    t0 = time.perf_counter()
    for step in range(start + 1, args.max_steps + 1):
        tokens = sampler.next_batch()
        lr = cast(float, b.scheduler.get_last_lr()[0])  # a float: build() gives the optimizer a float lr
        loss = lm_loss(b.model, tokens)
        ckpt.observe_loss(step, loss)  # the sanity reference of the save before this step (next-step)
        loss.backward()
        b.optimizer.step()  # waits for checkpoint staging first (pre-hook)
        b.scheduler.step()
        b.optimizer.zero_grad(set_to_none=True)
        lv = loss.detach().clone()
        if env.world_size > 1:
            dist.all_reduce(lv, op=dist.ReduceOp.AVG)
        if mf is not None:
            mf.write(
                json.dumps(
                    {
                        "step": step,
                        "loss": float(lv),
                        "lr": lr,
                        "attempt": env.attempt,
                        "t": round(time.perf_counter() - t0, 4),
                        "wall": time.time(),
                    }
                )
                + "\n"
            )
        faults.maybe_crash("step", step)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        ckpt.save(step, {"loss": float(lv), "lr": lr}, force=(step == args.max_steps))
    train_s = time.perf_counter() - t0
    t_close = time.perf_counter()
    ckpt.close()
    close_s = time.perf_counter() - t_close
    # CPU of this rank's process, the part not on the training thread (gloo's workers are most of
    # it, saves or not), and the part of the threads started since the loop began: the saves'
    # background work (staging, DCP's planning and writer, the commit), which the benchmark reads.
    cpu_s, cpu_main_s = time.process_time(), time.thread_time()
    cpu_new_threads_s = threadcpu.started_since(cpu_at_start)
    if mf is not None:
        mf.close()
    if env.rank == 0:
        blocked = sorted(t.blocked_s for t in ckpt.save_timings) or [0.0]
        # One machine-readable line: tests and benchmarks read it, people can too.
        print(
            "ckptflow-summary "
            + json.dumps(
                {
                    "saves": len(ckpt.save_timings),
                    "interval": ckpt.interval,
                    "interval_changes": len(ckpt.interval_decisions),
                    "stall_median_ms": blocked[len(blocked) // 2] * 1e3,
                    "stall_max_ms": blocked[-1] * 1e3,
                    "train_s": train_s,
                    "close_s": close_s,
                    "cpu_s": cpu_s,
                    "cpu_off_main_thread_s": cpu_s - cpu_main_s,
                    "cpu_new_threads_s": cpu_new_threads_s,
                    "steps": args.max_steps - start,
                    "resumed_from": start,
                    "load_s": load_s,
                    "replicated_bytes": sum(t.extra.get("replicated_bytes", 0) for t in ckpt.save_timings),
                    "replicate_s": sum(t.extra.get("replicate_s", 0.0) for t in ckpt.save_timings),
                    "persist_median_s": sorted(t.persisted_s for t in ckpt.save_timings or [])[
                        len(ckpt.save_timings) // 2
                    ]
                    if ckpt.save_timings
                    else 0.0,
                    "commit_median_s": sorted(t.committed_s for t in ckpt.save_timings or [])[
                        len(ckpt.save_timings) // 2
                    ]
                    if ckpt.save_timings
                    else 0.0,
                }
            ),
            file=sys.stderr,
        )
    shutdown(env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
