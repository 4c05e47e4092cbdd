"""Per-rank worker of ``benchmarks.bench_trainer`` (launched by torchrun; not a CLI for people).

    python -m torch.distributed.run --standalone --nproc-per-node=2 \
        -m benchmarks._trainer_worker --workdir DIR --out results.json [--model small]

Every rank builds the reference model (``trainer.reference.build``, FSDP2, AdamW),
trains a few steps so the optimizer state exists, then measures in this one process,
in this order (each phase ends with a barrier, so the ranks run every phase together):

1. state bytes (model + optimizer, this rank's shard) and the memcpy floor: a copy
   of the same tensors into preallocated buffers, median of several;
2. the training-thread cost of ``CheckpointManager.save`` per async mode, with real
   training steps between saves, modes round-robin (see ``bench_modes``);
3. ``torch.save`` of the full, gathered state on rank 0;
4. persist with nothing else running, against ``dd ... conv=fsync`` of the same bytes
   and a raw write of the same tensors;
5. load (``trainer.loader.load_verified``) and verification against a raw read of the
   same files, cold (page cache dropped with ``POSIX_FADV_DONTNEED``) and warm.

Rank 0 gathers every rank's numbers and writes them as JSON to ``--out``; the driver
turns them into the table. Numbers are per rank; the driver combines them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
)
from torch.distributed.tensor import DTensor

from ckptflow.trainer.checkpointer import CheckpointManager
from ckptflow.trainer.config import CheckpointConfig, Provenance, SanitySpec
from ckptflow.trainer.distenv import DistEnv, exit_process, init_distributed, shutdown
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.manifest import read_manifest
from ckptflow.trainer.loader import load_verified
from ckptflow.trainer.reference.build import BUILDER, Built, TrainConfig, build
from ckptflow.trainer.reference.data import GlobalSampler
from ckptflow.trainer.reference.model import ModelConfig, lm_loss
from ckptflow.trainer.state import TrainState, build_save_state, rank_state, reseed_rng, shared_state
from ckptflow.trainer.verify import share_of_files, verify_checkpoint

MODES_ORDER = ("async_staging", "sync")
READ_CHUNK = 8 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks._trainer_worker")
    p.add_argument("--workdir", required=True, help="checkpoints and dd files go here (same disk as a hot tier)")
    p.add_argument("--out", required=True, help="rank 0 writes the gathered results here (JSON)")
    p.add_argument("--model", default="small")
    p.add_argument("--global-batch", type=int, default=2)
    p.add_argument("--saves", type=int, default=8, help="saves per async mode (the first is reported apart)")
    p.add_argument("--steps-between", type=int, default=3, help="training steps between two saves")
    p.add_argument("--modes", default=",".join(MODES_ORDER))
    p.add_argument("--reps", type=int, default=5, help="repetitions of memcpy / dd / idle persist")
    return p.parse_args(argv)


def local(t: Any) -> torch.Tensor | None:
    if isinstance(t, DTensor):
        return t.to_local()
    return t if isinstance(t, torch.Tensor) else None


def state_tensors(b: Built) -> list[torch.Tensor]:
    """This rank's model + optimizer tensors: exactly what a save stages and writes."""
    model_sd, optim_sd = get_state_dict(b.model, b.optimizer)
    out: list[torch.Tensor] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif (t := local(x)) is not None:
            out.append(t)

    walk(model_sd)
    walk(optim_sd)
    return out


class StepRunner:
    """The reference job's step, split so a benchmark can time the parts."""

    def __init__(self, b: Built, sampler: GlobalSampler, env: DistEnv) -> None:
        self.b, self.sampler, self.env = b, sampler, env
        self.step_no = 0

    def forward_backward(self) -> torch.Tensor:
        loss = lm_loss(self.b.model, self.sampler.next_batch())
        loss.backward()
        return loss

    def finish(self, loss: torch.Tensor) -> float:
        self.b.optimizer.step()  # the manager's pre-hook waits for staging here
        self.b.scheduler.step()
        self.b.optimizer.zero_grad(set_to_none=True)
        lv = loss.detach().clone()
        if self.env.world_size > 1:
            dist.all_reduce(lv, op=dist.ReduceOp.AVG)
        self.step_no += 1
        return float(lv)

    def step(self) -> tuple[float, float]:
        """One full step; returns (start, end) perf_counter times."""
        t0 = time.perf_counter()
        self.finish(self.forward_backward())
        return t0, time.perf_counter()


def barrier() -> None:
    dist.barrier()


# -- 1. state bytes and the memcpy floor ------------------------------------------------
def bench_memcpy(b: Built, reps: int) -> dict[str, Any]:
    src = state_tensors(b)
    nbytes = sum(t.numel() * t.element_size() for t in src)
    bufs = [torch.empty_like(t) for t in src]
    for d, s in zip(bufs, src, strict=False):  # first touch: fault the pages in before timing
        d.copy_(s)
    copy_s, clone_s = [], []
    for _ in range(reps):
        barrier()  # both ranks copy at once, as both stage at once in a save
        t0 = time.perf_counter()
        for d, s in zip(bufs, src, strict=False):
            d.copy_(s)
        copy_s.append(time.perf_counter() - t0)
        barrier()
        t0 = time.perf_counter()
        fresh = [s.clone() for s in src]  # what staging costs without reused buffers
        clone_s.append(time.perf_counter() - t0)
        del fresh
    return {"state_bytes": nbytes, "tensors": len(src), "memcpy_s": copy_s, "clone_s": clone_s}


def bench_save_parts(b: Built, runner: StepRunner, env: DistEnv, reps: int = 3) -> dict[str, Any]:
    """What ``CheckpointManager._save`` does on the training thread before the saver runs."""
    probe_s, probe1_s, state_s = [], [], []
    one = b.probe[:1]
    for _ in range(reps):
        barrier()
        t0 = time.perf_counter()
        b.probe_loss()  # SanitySpec.probe_fn of the reference job: one forward pass
        probe_s.append(time.perf_counter() - t0)
        barrier()
        t0 = time.perf_counter()
        b.model.eval()  # the same probe on one sample instead of four (a cheaper probe)
        with torch.no_grad():
            lm_loss(b.model, one)
        b.model.train()
        probe1_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        build_save_state(
            model=b.model,
            optimizer=b.optimizer,
            rank=env.rank,
            train=shared_state(runner.step_no, scheduler=b.scheduler),
            per_rank=rank_state(sampler=runner.sampler),
        )
        state_s.append(time.perf_counter() - t0)
    return {"probe_s": probe_s, "probe_1_sample_s": probe1_s, "build_state_s": state_s, "probe_samples": len(b.probe)}


# -- 2. the save stall per async mode -----------------------------------------------------
def make_manager(
    b: Built, runner: StepRunner, env: DistEnv, tcfg: TrainConfig, root: str, mode: str, run_id: str
) -> CheckpointManager:
    return CheckpointManager(
        CheckpointConfig(
            root=root, run_id=run_id, interval=1 << 30, async_mode=mode, resume="never", emit_events=False
        ),
        model=b.model,
        optimizer=b.optimizer,
        scheduler=b.scheduler,
        sampler=runner.sampler,
        provenance=Provenance(config=tcfg.to_dict(), data_fingerprint=tcfg.data().fingerprint(), code_version="bench"),
        # As in trainer.train: the manager runs the probe forward pass at every save (the default).
        sanity=SanitySpec(builder=BUILDER, config=tcfg.to_dict(), probe_tokens=b.probe.tolist(), probe_fn=b.probe_loss),
        env=env,
    )


def wait_for_staging(ckpt: CheckpointManager) -> None:
    # The same call the manager's optimizer pre-hook makes; made explicitly so the
    # wait is timed on its own (the hook then finds nothing pending).
    saver = getattr(ckpt, "_saver", None)
    if saver is not None:
        saver.wait_for_staging()


def rank_files(ckpt_dir: str, rank: int) -> list[str]:
    """The DCP data files this rank wrote (FileSystemWriter names them ``__<rank>_<n>``).

    Listed from the directory, not the manifest, so a manifest that misses files
    cannot hide bytes from the throughput figures.
    """
    return sorted(n for n in os.listdir(ckpt_dir) if n.startswith(f"__{rank}_"))


def rank_file_bytes(ckpt_dir: str, rank: int) -> int:
    return sum(os.path.getsize(os.path.join(ckpt_dir, n)) for n in rank_files(ckpt_dir, rank))


def bench_modes(
    modes: list[str],
    b: Built,
    runner: StepRunner,
    env: DistEnv,
    tcfg: TrainConfig,
    root: str,
    saves: int,
    steps_between: int,
) -> dict[str, Any]:
    """``saves`` rounds; in each, one save per mode, ``steps_between`` real training steps apart.

    Round-robin rather than mode after mode, so a change in the machine's load (it is
    shared) hits every mode alike. Before each save, every manager's previous save is
    waited for (timed apart, ``prev_wait_s``): each figure is one save's own cost, not
    a queue behind a slow disk or another mode's persist. Per save: the ``save()`` call
    on the training thread, the saver's part of it (``blocked_s``), the wait for
    staging inside the next ``optimizer.step``, and the background phases from
    ``SaveTiming``. Every step's start and end are kept (``steps``) so the driver can
    tell how much the background work slowed the steps it overlapped.
    """
    barrier()
    mgrs = {m: make_manager(b, runner, env, tcfg, root, m, f"bench-{m}") for m in modes}
    steps: list[tuple[float, float]] = []
    per_save: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    try:
        for _ in range(saves):
            for mode, ckpt in mgrs.items():
                for _ in range(steps_between - 1):
                    steps.append(runner.step())
                t0 = time.perf_counter()
                for c in mgrs.values():
                    c.wait()
                prev_wait = time.perf_counter() - t0
                t_save = time.perf_counter()
                ckpt.save(runner.step_no, {"loss": 0.0}, force=True)
                save_call = time.perf_counter() - t_save
                # The next step, split around the staging wait the optimizer pre-hook makes.
                t_step = time.perf_counter()
                loss = runner.forward_backward()
                t1 = time.perf_counter()
                wait_for_staging(ckpt)
                t2 = time.perf_counter()
                runner.finish(loss)
                t_end = time.perf_counter()
                steps.append((t_step, t_end))
                per_save[mode].append(
                    {
                        "save_at": t_save,
                        "save_call_s": save_call,
                        "prev_wait_s": prev_wait,
                        "staging_wait_s": t2 - t1,
                        "fwd_bwd_s": t1 - t_step,
                        "step_after_s": t_end - t_step,
                    }
                )
        for c in mgrs.values():
            c.wait()
    finally:
        for c in mgrs.values():
            c.close()
    out: dict[str, Any] = {}
    for mode, ckpt in mgrs.items():
        for rec, t in zip(per_save[mode], ckpt.save_timings, strict=False):
            rec.update(
                blocked_s=t.blocked_s,
                staged_s=t.staged_s,
                persisted_s=t.persisted_s,
                committed_s=t.committed_s,
                ckpt_bytes=t.bytes,
                step=t.step,
            )
        last = os.path.join(ckpt.run_path, layout.step_name(per_save[mode][-1]["step"]))
        out[mode] = {
            "saves": per_save[mode],
            "rank_file_bytes": rank_file_bytes(last, env.rank),
            "files_on_disk": sorted(os.listdir(last)),
            "manifest_files": sorted(read_manifest(last).files),
        }
    return {"modes": out, "steps": steps}


# -- 3. torch.save of the gathered state ---------------------------------------------------
def bench_torch_save(b: Built, env: DistEnv, path: str) -> dict[str, Any]:
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    barrier()
    t0 = time.perf_counter()
    msd = get_model_state_dict(b.model, options=opts)
    osd = get_optimizer_state_dict(b.model, b.optimizer, options=opts)
    gather_s = time.perf_counter() - t0
    write_s, nbytes = 0.0, 0
    if env.rank == 0:
        t1 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save({"model": msd, "optim": osd}, f)
            f.flush()
            os.fsync(f.fileno())
        write_s = time.perf_counter() - t1
        nbytes = os.path.getsize(path)
    barrier()  # the other ranks stall until rank 0 is done (their next collective)
    total_s = time.perf_counter() - t0
    del msd, osd
    if env.rank == 0:
        os.remove(path)
    return {"gather_s": gather_s, "write_s": write_s, "total_s": total_s, "file_bytes": nbytes}


# -- 4. persist with nothing else running, and dd ------------------------------------------
def run_dd(path: str, nbytes: int) -> float:
    """Seconds for ``dd`` to write and fsync exactly ``nbytes`` in 8 MiB blocks."""
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=8M", f"count={nbytes}", "iflag=count_bytes", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    dt = time.perf_counter() - t0
    os.remove(path)
    return dt


def write_tensors(path: str, tensors: list[torch.Tensor]) -> float:
    """Seconds to write these tensors' bytes to one file and fsync: no serialization at all."""
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for t in tensors:
            f.write(memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy()))
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    os.remove(path)
    return dt


def bench_idle_persist_and_dd(
    b: Built,
    runner: StepRunner,
    env: DistEnv,
    tcfg: TrainConfig,
    root: str,
    rank_bytes: int,
    total_bytes: int,
    reps: int,
) -> dict[str, Any]:
    """Alternate an idle save (async_staging, then wait at once) with ``dd`` runs, ``reps`` times.

    A third baseline, the same tensors' bytes written from Python and fsynced,
    separates DCP's per-tensor serialization from the disk.

    Interleaving puts the baseline and the measurement in the same minute of the
    same disk's (virtualised, cached-by-the-host) behaviour.
    """
    dd_dir = os.path.join(root, "_dd")
    os.makedirs(dd_dir, exist_ok=True)
    barrier()
    ckpt = make_manager(b, runner, env, tcfg, root, "async_staging", "bench-idle")
    saves, dd_conc, dd_single, tensor_write = [], [], [], []
    src = state_tensors(b)
    last = None
    try:
        for i in range(reps):
            runner.step()  # new values: nothing is written from an unchanged buffer
            barrier()
            ckpt.save(runner.step_no, {"loss": 0.0}, force=True)
            ckpt.wait()
            t = ckpt.save_timings[-1]
            saves.append(
                {
                    "staged_s": t.staged_s,
                    "persisted_s": t.persisted_s,
                    "committed_s": t.committed_s,
                    "blocked_s": t.blocked_s,
                }
            )
            last = os.path.join(ckpt.run_path, layout.step_name(t.step))
            barrier()  # both ranks write their own share at once, like a save
            dd_conc.append(run_dd(os.path.join(dd_dir, f"conc{env.rank}.{i}"), rank_bytes))
            barrier()
            if env.rank == 0:  # one writer, all the bytes
                dd_single.append(run_dd(os.path.join(dd_dir, f"single.{i}"), total_bytes))
            barrier()
            tensor_write.append(write_tensors(os.path.join(dd_dir, f"tensors{env.rank}.{i}"), src))
            barrier()
    finally:
        ckpt.close()
    return {
        "saves": saves,
        "dd_concurrent_s": dd_conc,
        "dd_single_s": dd_single,
        "tensor_write_s": tensor_write,
        "rank_file_bytes": rank_file_bytes(last, env.rank),
        "dd_rank_bytes": rank_bytes,
        "dd_total_bytes": total_bytes,
        "last_ckpt": last,
    }


# -- 5. load --------------------------------------------------------------------------------
def drop_cache(paths: list[str]) -> None:
    """Evict these (fsynced, hence clean) files from the page cache; no root needed."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(paths: list[str]) -> int | None:
    """Bytes of these files in the page cache (``fincore``), None if it cannot tell."""
    try:
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES", *paths],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    try:
        return sum(int(x) for x in out.stdout.split())
    except ValueError:
        return None


def raw_read(paths: list[str]) -> int:
    buf = bytearray(READ_CHUNK)
    view = memoryview(buf)
    n = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while got := f.readinto(view):
                n += got
    return n


def bench_load(b: Built, runner: StepRunner, env: DistEnv, ckpt_dir: str, reps: int) -> dict[str, Any]:
    """Raw read, DCP load and verification of one committed checkpoint, cold and warm.

    "Cold" means this checkpoint's files were evicted from this machine's page cache
    just before (``fincore`` confirms it: ``resident_*`` bytes); a cache below this
    VM (the host's) cannot be dropped from here and may still serve some reads.
    """
    m = read_manifest(ckpt_dir)
    every = [os.path.join(ckpt_dir, n) for n in sorted(os.listdir(ckpt_dir))]
    mine = [os.path.join(ckpt_dir, n) for n in rank_files(ckpt_dir, env.rank)]
    share = share_of_files(m, env.rank, env.world_size)
    out: dict[str, Any] = {
        "rank_bytes": sum(os.path.getsize(p) for p in mine),
        "files": len(every),
        "verify_bytes": sum(m.files[n].size for n in share),
    }

    def cold(key: str) -> None:
        barrier()
        if env.rank == 0:
            drop_cache(every)
        barrier()
        out.setdefault(f"resident_before_{key}", []).append(resident_bytes(every))

    def timed(key: str, fn) -> None:  # noqa: ANN001
        barrier()
        t0 = time.perf_counter()
        fn()
        out.setdefault(key, []).append(time.perf_counter() - t0)
        barrier()

    def load() -> None:
        state = TrainState(b.model, b.optimizer, b.scheduler, sampler=runner.sampler)
        load_verified(ckpt_dir, m, env=env, state=state)

    def verify() -> None:
        verify_checkpoint(ckpt_dir, only=share).raise_if_bad()

    for _ in range(reps):
        cold("raw_cold")
        timed("raw_cold_s", lambda: raw_read(mine))
        out.setdefault("resident_before_raw_warm", []).append(resident_bytes(every))
        timed("raw_warm_s", lambda: raw_read(mine))
        cold("load_cold")
        timed("load_cold_s", load)
        cold("verify_cold")
        timed("verify_cold_s", verify)  # all ranks together read every file once
        out.setdefault("resident_before_load_warm", []).append(resident_bytes(every))
        timed("load_warm_s", load)
    return out


# -- main -------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = init_distributed()
    tcfg = TrainConfig(model=ModelConfig.preset(args.model).to_dict(), global_batch=args.global_batch)
    b = build(tcfg.to_dict())
    sampler = GlobalSampler(tcfg.data(), global_batch=tcfg.global_batch, rank=env.rank, world_size=env.world_size)
    reseed_rng(tcfg.seed * 1000 + env.rank)
    runner = StepRunner(b, sampler, env)
    root = os.path.join(args.workdir, "ckpt")
    res: dict[str, Any] = {
        "rank": env.rank,
        "world_size": env.world_size,
        "model": args.model,
        "global_batch": args.global_batch,
        "torch_threads": torch.get_num_threads(),
    }
    t_all = time.perf_counter()
    warm = [runner.step() for _ in range(3)]  # optimizer state exists after the first
    res["warmup_step_s"] = [e - s for s, e in warm]
    res["memcpy"] = bench_memcpy(b, args.reps)
    res["save_parts"] = bench_save_parts(b, runner, env)
    res.update(
        bench_modes(
            [m for m in MODES_ORDER if m in args.modes.split(",")],
            b,
            runner,
            env,
            tcfg,
            root,
            args.saves,
            args.steps_between,
        )
    )
    res["torch_save"] = bench_torch_save(b, env, os.path.join(args.workdir, "full_state.pt"))
    rank_bytes = res["memcpy"]["state_bytes"]
    tot = torch.tensor([rank_bytes], dtype=torch.int64)
    dist.all_reduce(tot)
    res["total_state_bytes"] = int(tot.item())
    res["idle"] = bench_idle_persist_and_dd(b, runner, env, tcfg, root, rank_bytes, int(tot.item()), args.reps)
    res["load"] = bench_load(b, runner, env, res["idle"]["last_ckpt"], max(1, args.reps // 2))
    res["worker_s"] = time.perf_counter() - t_all
    gathered: list | None = [None] * env.world_size if env.rank == 0 else None
    dist.gather_object(res, gathered, dst=0)
    if env.rank == 0:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"ranks": gathered}, f)
        shutil.rmtree(root, ignore_errors=True)
    shutdown(env)
    return 0


if __name__ == "__main__":
    exit_process(main())
