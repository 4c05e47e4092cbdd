"""Per-rank worker of ``benchmarks.bench_resume_tiers`` (launched by torchrun; not a CLI for people).

One arm per job, into a fresh model and optimizer (``_vs_dcp_worker``'s FSDP2 MLP with Adam):

* ``save``: one training step, then the manager's save of step 1 (what the arms restore);
* ``ckptflow``: ``CheckpointManager.load()`` with the tiers of ``--config``, the hot run folder gone:
  the way back (list the tiers, bring the step into the hot root verified, load it verified);
* ``hot``: the same ``load()`` with the tiers off, after ``ckptflow restore`` put the step back by hand;
* ``fsspec``: DCP's own ``dcp.load`` through its ``FsspecReader``, straight from the cold tier's objects
  (codec none), no checks beyond DCP's;
* ``floor``: the bytes this rank's load reads (its own shard file and ``.metadata`` at the saved world
  size, every file at another), fetched with plain ranged GETs into memory, no checks, nothing loaded.

Each rank times its arm; rank 0 writes ``{"s": slowest rank, "bytes": fetched by all ranks}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks._vs_dcp_worker import build_trainee, forward_backward, optimizer_step, provenance, same_state
from ckptflow import CheckpointConfig, CheckpointManager
from ckptflow.trainer.distenv import exit_process, gather, init_distributed, shutdown

RUN = "rt"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks._resume_tiers_worker")
    p.add_argument("--arm", required=True, choices=["save", "ckptflow", "hot", "fsspec", "floor"])
    p.add_argument("--hot", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--width", type=int, required=True)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--prefix", required=True, help="s3://bucket/prefix of the cold step folder")
    p.add_argument("--saved-world", type=int, default=2)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def _manager(a: argparse.Namespace, t, env, tiers: str) -> CheckpointManager:
    cfg = CheckpointConfig(root=a.hot, run_id=RUN, interval=1, emit_events=False, tiers=tiers)
    return CheckpointManager(cfg, model=t.model, optimizer=t.optimizer, provenance=provenance(a.width, 8), env=env)


def _floor(a: argparse.Namespace, rank: int, world: int) -> int:
    import boto3
    from botocore.config import Config

    bucket, _, prefix = a.prefix.removeprefix("s3://").partition("/")
    s3 = boto3.client("s3", endpoint_url=a.endpoint, config=Config(max_pool_connections=16))
    names = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")["Contents"]]
    mine = [k for k in names if k.endswith(".metadata") or k.endswith(".distcp")]
    if world == a.saved_world:
        mine = [k for k in mine if k.endswith(".metadata") or os.path.basename(k).startswith(f"__{rank}_")]
    part = 8 << 20
    jobs = []
    for k in mine:
        size = s3.head_object(Bucket=bucket, Key=k)["ContentLength"]
        jobs += [(k, off, min(size, off + part) - 1) for off in range(0, max(size, 1), part)]

    def one(job: tuple[str, int, int]) -> int:
        k, lo, hi = job
        return len(s3.get_object(Bucket=bucket, Key=k, Range=f"bytes={lo}-{hi}")["Body"].read())

    with ThreadPoolExecutor(16) as ex:
        return sum(ex.map(one, jobs))


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    env = init_distributed()
    t = build_trainee(a.width, 8, env.rank)
    fetched = 0
    if a.arm == "save":
        forward_backward(t)
        optimizer_step(t)
        m = _manager(a, t, env, "none")
        m.save(1, force=True)
        m.close()
        seconds = 0.0
    elif a.arm in ("ckptflow", "hot"):
        m = _manager(a, t, env, a.config if a.arm == "ckptflow" else "none")
        t0 = time.perf_counter()
        step = m.load()
        seconds = time.perf_counter() - t0
        assert step == 1, f"resumed at {step}"
        b = m.last_load.brought if m.last_load else None
        fetched = b.bytes_fetched if b is not None and env.rank == 0 else 0
        m.close()
    elif a.arm == "fsspec":
        import torch.distributed.checkpoint as dcp

        # what a DCP user reads S3 with today; torch exports it only from this module
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        t0 = time.perf_counter()
        model_sd, optim_sd = get_state_dict(t.model, t.optimizer)
        sd = {"model": model_sd, "optim": optim_sd}
        reader = FsspecReader(a.prefix, client_kwargs={"endpoint_url": a.endpoint})
        dcp.load(sd, storage_reader=reader, process_group=env.ckpt_group)
        set_state_dict(t.model, t.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        seconds = time.perf_counter() - t0
    else:
        t0 = time.perf_counter()
        fetched = _floor(a, env.rank, env.world_size)
        seconds = time.perf_counter() - t0
    every = gather((seconds, fetched), env.ckpt_group)
    if a.arm in ("ckptflow", "hot", "fsspec"):  # every arm restored the same state
        ref = build_trainee(a.width, 8, env.rank)
        forward_backward(ref)
        optimizer_step(ref)
        ok = same_state(t, ref) if env.world_size == a.saved_world else True
        assert all(gather(ok, env.ckpt_group)), f"{a.arm}: the restored state differs from the saved one"
    if env.rank == 0:
        with open(a.out, "w") as f:
            json.dump({"s": max(s for s, _ in every), "bytes": sum(b for _, b in every)}, f)
    shutdown(env)
    return 0


if __name__ == "__main__":
    exit_process(main())
