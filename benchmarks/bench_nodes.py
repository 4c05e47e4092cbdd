"""Node-local hot roots on two simulated nodes: what replicas cost and what they buy.

    python -m benchmarks.bench_nodes [--model mini] [--steps 60] [--every 10] [--repeats 2]

Two torchrun agents on this machine (c10d rendezvous, one rank each), each with its own
hot folder as its local disk — the set-up of ``tests/integration/test_nodes.py``. Measured in one run,
alternating so both see the same machine state:

* **save stall** with ``--replicas 2`` vs ``--replicas 1`` (the training thread's blocked time
  per save, median and max, from the job's own timings): replication runs in the commit
  thread, so the target is "the same within noise";
* **replication throughput**: bytes a rank received from its peer per second of the
  replication phase, against a plain ``copyfile`` + ``fsync`` of the same files from one
  node's folder into the other's, timed here (the floor for moving those bytes on one machine);
* **resume time** of the whole job (``load()``, as the job reports it): every node from its
  own disk; node 1 replaced (empty disk: it fetches its part from node 0's replica); and
  from cold (the same checkpoint archived to a local S3 server, moto: ``fetch`` into node 1's
  empty folder, then the own-disk load) — targets: replica within 1.5x of own disk, and
  >= 5x faster than cold.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

from ckptflow.harness import LOCAL_AWS, MotoServer, NodeAgents

RUN = "bench"


def job(roots: list[str], log_dir: str, *, model: str, steps: int, every: int, replicas: int) -> list[dict]:
    args = [
        "--run-id",
        RUN,
        "--model",
        model,
        "--max-steps",
        str(steps),
        "--save-every",
        str(every),
        "--replicas",
        str(replicas),
    ]
    with NodeAgents(roots, args, log_dir=log_dir) as nodes:
        nodes.start()
        rcs = nodes.wait(1800)
        out = [nodes.output(i) for i in range(nodes.n)]
    if rcs != [0, 0]:
        raise SystemExit(f"the job failed ({rcs}):\n" + "\n".join(o[-2000:] for o in out))
    return [
        json.loads(line.split(" ", 1)[1])
        for o in out
        for line in o.splitlines()
        if line.startswith("ckptflow-summary ")
    ]


def raw_copy_mb_s(src_dir: str, dst_dir: str) -> float:
    names = [n for n in os.listdir(src_dir) if n.endswith(".distcp")]
    os.makedirs(dst_dir, exist_ok=True)
    t0 = time.perf_counter()
    n = 0
    for name in names:
        dst = os.path.join(dst_dir, name)
        shutil.copyfile(os.path.join(src_dir, name), dst)
        with open(dst, "rb+") as f:
            os.fsync(f.fileno())
        n += os.path.getsize(dst)
    return n / (time.perf_counter() - t0) / 1e6


def transport_worker(path: str, mb: int) -> None:
    """Two ranks swap a file over the checkpoint transport with nothing else running (its ceiling)."""
    from datetime import timedelta

    import torch.distributed as dist

    from ckptflow.trainer.format.checksum import hash_file
    from ckptflow.trainer.nodes import transport

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    r = dist.get_rank()
    src, dst = os.path.join(path, f"src{r}"), os.path.join(path, f"dst{r}")
    os.makedirs(src, exist_ok=True)
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "f"), "wb") as f:
        f.write(os.urandom(mb << 20))
    digs: list = [None, None]
    dist.all_gather_object(digs, hash_file(os.path.join(src, "f")))
    plan = [
        transport.Transfer("f", 0, 1, digs[0][1], digs[0][0]),
        transport.Transfer("f", 1, 0, digs[1][1], digs[1][0]),
    ]
    dist.barrier()
    t0 = time.perf_counter()
    probs, got = transport.run(plan, rank=r, group=None, source=lambda n: os.path.join(src, n), dest_dir=lambda n: dst)
    dt = time.perf_counter() - t0
    if r == 0:
        with open(os.path.join(path, "result.json"), "w") as f:
            json.dump({"mb_s": got / dt / 1e6, "problems": probs}, f)
    dist.destroy_process_group()


def idle_transport_mb_s(work: str, mb: int) -> float:
    import subprocess

    from ckptflow.harness import child_env, torchrun

    path = os.path.join(work, "transport")
    cmd = torchrun("benchmarks.bench_nodes", ["--transport-worker", path, "--mb", str(mb)], nproc=2)
    subprocess.run(cmd, check=True, capture_output=True, env=child_env(), timeout=600)
    with open(os.path.join(path, "result.json")) as f:
        return float(json.load(f)["mb_s"])


def fresh(work: str, tag: str) -> tuple[list[str], str]:
    base = os.path.join(work, tag)
    shutil.rmtree(base, ignore_errors=True)
    return [os.path.join(base, "node0"), os.path.join(base, "node1")], os.path.join(base, "logs")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mini")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--transport-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mb", type=int, default=128, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.transport_worker:
        transport_worker(a.transport_worker, a.mb)
        return 0
    work = tempfile.mkdtemp(prefix="ckptflow-bench-nodes-")
    res: dict = {
        "model": a.model,
        "steps": a.steps,
        "every": a.every,
        "stall": {1: [], 2: []},
        "stall_max": {1: [], 2: []},
        "replicate_mb_s": [],
        "raw_copy_mb_s": [],
        "resume": {},
    }
    try:
        for i in range(a.repeats):
            for replicas in (2, 1) if i % 2 == 0 else (1, 2):
                roots, logs = fresh(work, f"r{replicas}-{i}")
                s = job(roots, logs, model=a.model, steps=a.steps, every=a.every, replicas=replicas)[0]
                res["stall"][replicas].append(s["stall_median_ms"])
                res["stall_max"][replicas].append(s["stall_max_ms"])
                if replicas == 2:
                    res["replicate_mb_s"].append(s["replicated_bytes"] / max(s["replicate_s"], 1e-9) / 1e6)
                    step = os.path.join(roots[0], RUN, f"step_{a.steps:09d}")
                    res["raw_copy_mb_s"].append(raw_copy_mb_s(step, os.path.join(work, f"copy-{i}")))
                    res.setdefault("idle_transport_mb_s", []).append(idle_transport_mb_s(work, 128))
        # resume: the last replicas=2 run's folders
        roots, logs = fresh(work, "resume")
        job(roots, logs, model=a.model, steps=a.steps, every=a.every, replicas=2)
        own = [
            job(roots, logs, model=a.model, steps=a.steps, every=a.every, replicas=2)[0]["load_s"]
            for _ in range(a.repeats)
        ]
        replica = []
        for _ in range(a.repeats):
            shutil.rmtree(roots[1])
            os.makedirs(roots[1])
            replica.append(job(roots, logs, model=a.model, steps=a.steps, every=a.every, replicas=2)[0]["load_s"])
        res["resume"] = {"own_disk_s": own, "peer_replica_s": replica, "cold_s": cold(roots, work, a, own)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(res)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def cold(roots: list[str], work: str, a: argparse.Namespace, own: list[float]) -> list[float]:
    """The same checkpoint from an S3 server: fetch (download + verify) into node 1's empty
    folder, plus the own-disk load — what a restore before the job would cost."""
    os.environ.update(LOCAL_AWS)
    from ckptflow.tasks.config import RetentionConfig, TierConfig
    from ckptflow.tasks.storage import Tier
    from ckptflow.tasks.transfer import archive, fetch

    out = []
    with MotoServer() as s3:
        s3.make_bucket("bench")
        hot = Tier(TierConfig(name="hot", url=roots[0]))
        coldt = Tier(
            TierConfig(name="cold", url="s3://bench/c", endpoint_url=s3.url, retention=RetentionConfig(keep_all=True))
        )
        archive(hot, coldt, RUN, a.steps)
        for i in range(a.repeats):
            dst = os.path.join(work, f"cold-{i}", f"step_{a.steps:09d}")
            t0 = time.perf_counter()
            r = fetch(coldt, RUN, a.steps, dst)
            out.append(time.perf_counter() - t0 + statistics.median(own))
            print(
                f"cold fetch: {r.bytes_stored / 1e6:.0f} MB in {r.seconds:.2f} s ({r.download_mb_s():.0f} MB/s "
                "from the local S3 server)"
            )
    return out


def report(res: dict) -> None:
    med = statistics.median
    print(f"model {res['model']}, {res['steps']} steps, a save every {res['every']}, 2 nodes x 1 rank")
    for k in (2, 1):
        print(
            f"save stall, replicas={k}: median {med(res['stall'][k]):.1f} ms (runs {res['stall'][k]}), "
            f"max {max(res['stall_max'][k]):.1f} ms"
        )
    print(f"stall ratio replicas 2 / 1: {med(res['stall'][2]) / max(med(res['stall'][1]), 1e-9):.2f}x")
    rep, raw = med(res["replicate_mb_s"]), med(res["raw_copy_mb_s"])
    idle = med(res["idle_transport_mb_s"])
    print(
        f"replication during training {rep:.0f} MB/s per rank vs raw copyfile+fsync {raw:.0f} MB/s: "
        f"{rep / raw:.2f}x; the transport alone (idle, 2 ranks swapping 128 MiB) {idle:.0f} MB/s per "
        f"direction: {idle / raw:.2f}x"
    )
    r = res["resume"]
    own, peer, cold = med(r["own_disk_s"]), med(r["peer_replica_s"]), med(r["cold_s"])
    print(
        f"resume: own disk {own:.2f} s, peer replica {peer:.2f} s ({peer / own:.2f}x own), cold {cold:.2f} s "
        f"(replica {cold / peer:.1f}x faster)"
    )


if __name__ == "__main__":
    raise SystemExit(main())
