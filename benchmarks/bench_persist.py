"""Persist: what writing a checkpoint's files costs the training beside it, DCP's writer against ckptflow's.

    python -m benchmarks.bench_persist [--model small] [--reps 5] [--trainers 2]

One process holds the reference model's whole state (model + AdamW after a step, as plain CPU
tensors: what a staged copy is) and writes it as a DCP checkpoint, then fsyncs and takes each
file's xxh3 as the commit does, in the ways below, alternating within each repetition so all
see the same machine. ``--trainers`` other processes run a training-like loop meanwhile (one
thread each, one 256x256 matmul per iteration: together they fill this machine's cores, as the
2 ranks of a 2-core job do), and report how many iterations they did in every window:

* **dcp**: DCP's ``FileSystemWriter`` (``torch.save`` per tensor), then the file read back
  and hashed: what a save did before ``trainer/dcp/writer.py``;
* **ckptflow**: ``HashingWriter`` buffered (templates, CRC-32 by ISA-L, hashed as written); its
  templates are made by a first save that is not counted;
* **raw**: the same tensors' bytes written to one file and fsynced, nothing else: the floor
  of any writer that keeps the data;
* **idle**: nothing written for as long as the dcp write took: the trainers' own rate.

Per way: wall seconds, CPU seconds of the writing process (what it takes from a core), and
the iterations the trainers lost against idle, as core-seconds. Ratios are against raw.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
import warnings
from typing import Any

WAYS = ("dcp", "ckptflow", "raw")


def _trainer(stop: Any, counts: Any, slot: int) -> None:
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    b = torch.randn(256, 256)
    while not stop.is_set():
        a = torch.tanh(a @ b)
        counts[slot] += 1


def _state(model: str) -> dict[str, Any]:
    import torch

    from ckptflow.trainer.reference.build import TrainConfig, build
    from ckptflow.trainer.reference.model import ModelConfig, lm_loss

    torch.set_num_threads(1)
    b = build(TrainConfig(model=ModelConfig.preset(model).to_dict(), global_batch=2).to_dict(), parallel="none")
    b.model.train()
    cfg = b.model.cfg
    loss = lm_loss(b.model, torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1)))
    loss.backward()
    b.optimizer.step()
    return {"model": b.model.state_dict(), "optim": b.optimizer.state_dict(), "step": 1}


def _tensors(sd: Any) -> list:
    import torch

    out: list = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(sd)
    return out


def _dcp(sd: Any, path: str, fast: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from ckptflow.trainer.dcp.writer import HashingWriter
    from ckptflow.trainer.format.checksum import hash_file

    writer = HashingWriter(path, sync_files=True) if fast else FileSystemWriter(path, sync_files=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=writer, no_dist=True)
    for n in sorted(os.listdir(path)):  # the commit's digests: as written, else one read each
        if n.endswith(".distcp") and not (fast and n in writer.digests):  # type: ignore[attr-defined]
            hash_file(os.path.join(path, n))


def _raw(tensors: list, path: str) -> None:
    from ckptflow.trainer.dcp.writer import storage_bytes

    with open(path, "wb", buffering=0) as f:
        for t in tensors:  # the state's own tensors: contiguous, each its whole storage
            f.write(storage_bytes(t))
        os.fsync(f.fileno())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_persist", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--trainers", type=int, default=2, help="training-like processes beside the writer (0: none)")
    p.add_argument("--out")
    a = p.parse_args(argv)

    sd = _state(a.model)
    tensors = _tensors(sd)
    nbytes = sum(t.nbytes for t in tensors)
    work = tempfile.mkdtemp(prefix="bench-persist-", dir=os.environ.get("CKPTFLOW_BENCH_DIR"))
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    counts = ctx.Array("q", a.trainers, lock=False)
    procs = [ctx.Process(target=_trainer, args=(stop, counts, i), daemon=True) for i in range(a.trainers)]
    res: dict[str, list[dict[str, float]]] = {k: [] for k in WAYS + ("idle",)}
    try:
        _dcp(sd, os.path.join(work, "warm"), True)  # the templates, and a first write of the files
        for pr in procs:
            pr.start()
        time.sleep(2)

        def measure(way: str, fn: Any, i: int) -> float:
            c0, w0, it0 = time.process_time(), time.perf_counter(), sum(counts)
            fn(os.path.join(work, f"{way}{i}"))
            wall = time.perf_counter() - w0
            res[way].append({"wall_s": wall, "cpu_s": time.process_time() - c0, "iters": sum(counts) - it0})
            return wall

        for i in range(a.reps):
            dcp_wall = measure("dcp", lambda d: _dcp(sd, d, False), i)
            measure("ckptflow", lambda d: _dcp(sd, d, True), i)
            measure("raw", lambda d: _raw(tensors, d), i)
            measure("idle", lambda _d: time.sleep(dcp_wall), i)
            for way in WAYS:
                shutil.rmtree(os.path.join(work, f"{way}{i}"), ignore_errors=True)
                if os.path.isfile(os.path.join(work, f"{way}{i}")):
                    os.remove(os.path.join(work, f"{way}{i}"))
    finally:
        stop.set()
        for pr in procs:
            pr.join(5)
        shutil.rmtree(work, ignore_errors=True)

    idle = res["idle"]
    rate = statistics.median(r["iters"] / r["wall_s"] for r in idle) if a.trainers else 0.0  # iters/s, all trainers
    per_core = rate / a.trainers if a.trainers else 0.0
    summary: dict[str, Any] = {"model": a.model, "bytes": nbytes, "reps": a.reps, "trainers": a.trainers}
    for way in WAYS:
        rows = res[way]
        wall = statistics.median(r["wall_s"] for r in rows)
        cpu = statistics.median(r["cpu_s"] for r in rows)
        lost = statistics.median(rate * r["wall_s"] - r["iters"] for r in rows) / per_core if a.trainers else 0.0
        summary[way] = {"wall_s": wall, "MB_s": nbytes / wall / 1e6, "cpu_s": cpu, "trainer_core_s_lost": lost}
    raw = summary["raw"]
    print(f"{a.model}: {nbytes / 1e6:.0f} MB per save, {a.reps} reps, {a.trainers} trainer processes beside it")
    print(f"{'':15s} {'wall':>9s} {'MB/s':>7s} {'CPU-s':>7s} {'x raw':>6s} {'trainers lost':>14s} {'x raw':>6s}")
    for way in WAYS:
        s = summary[way]
        lost, raw_lost = s["trainer_core_s_lost"], max(raw["trainer_core_s_lost"], 1e-9)
        print(
            f"{way:15s} {s['wall_s'] * 1e3:7.0f}ms {s['MB_s']:7.0f} {s['cpu_s']:7.3f} {s['cpu_s'] / raw['cpu_s']:5.2f}x"
            f" {lost:12.3f}cs {lost / raw_lost:5.2f}x"
        )
    s_d = summary["dcp"]
    for way in ("ckptflow",):
        s_c = summary[way]
        print(
            f"{way} / dcp: wall {s_c['wall_s'] / s_d['wall_s']:.2f}x, CPU {s_c['cpu_s'] / s_d['cpu_s']:.2f}x, "
            f"trainers' loss {s_c['trainer_core_s_lost'] / max(s_d['trainer_core_s_lost'], 1e-9):.2f}x"
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"summary": summary, "raw": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
