"""The lifecycle on many nodes: commit -> warm latency, and promote throughput per node.

    python -m benchmarks.bench_node_lifecycle [--model small] [--steps 20] [--every 10]

A Prefect server, the deployments in a process work pool, a general worker and one worker per
node (each on its queue ``node-<id>``, with its node's config), as in ``ckptflow demo --nodes 2``.
The same reference job saves the same bytes two ways, one after the other:

* **1 node x 2 ranks**, one hot root: the usual lifecycle (verify, compress + promote on warm);
* **2 nodes x 1 rank**, node-local hot roots: each node stages its part on warm, the lifecycle
  joins them.

Measured: commit -> warm-committed latency per checkpoint (the outbox's ``committed_at`` to the
``promoted`` record; the sanity step is off in both, so both measure the data path), and each
node's promote throughput (its part's bytes / seconds) against a plain ``copyfile`` + ``fsync`` of
the same files into the same warm folder (target >= 0.8x). Warm stores ``none`` (plain copies).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from ckptflow.harness import NodeAgents, PrefectServer, Supervisor, child_env, torchrun

# One run id per phase: the commit event's id is derived from (run, step), and Prefect drops
# an event whose id it has seen (re-sent events must not run a lifecycle twice).
RUN1, RUN2 = "bench-one", "bench-nodes"
POOL = "ckptflow-pool"


def config(path: str, hot: str, warm: str) -> str:
    with open(path, "w") as f:
        f.write(
            f'[hot]\nurl = "{hot}"\n[hot.retention]\nkeep_all = true\n[warm]\nurl = "{warm}"\n'
            "[warm.retention]\nkeep_all = true\n[lifecycle]\nsanity_step = false\nnode_part_timeout_s = 300\n"
        )
    return path


def wait_promoted(records: str, steps: list[int], timeout: float) -> dict[int, float]:
    deadline = time.monotonic() + timeout
    out: dict[int, float] = {}
    while time.monotonic() < deadline and len(out) < len(steps):
        for s in steps:
            p = os.path.join(records, "_lifecycle", f"step_{s:09d}", "promoted.json")
            if s not in out and os.path.exists(p):
                with open(p) as f:
                    out[s] = float(json.load(f)["recorded_at"])
        time.sleep(0.5)
    return out


def committed_at(roots: list[str], run: str) -> dict[int, float]:
    from ckptflow.trainer.events import read_outbox

    return {int(x["step"]): float(x["committed_at"]) for r in roots for x in read_outbox(os.path.join(r, run))}


def plain_copy_mb_s(src_dirs: list[str], dst: str) -> float:
    os.makedirs(dst, exist_ok=True)
    n, t0 = 0, time.perf_counter()
    for d in src_dirs:
        for name in os.listdir(d):
            if not name.endswith(".distcp"):
                continue
            out = os.path.join(dst, f"{os.path.basename(os.path.dirname(os.path.dirname(d)))}-{name}")
            shutil.copyfile(os.path.join(d, name), out)
            with open(out, "rb+") as f:
                os.fsync(f.fileno())
            n += os.path.getsize(out)
    return n / (time.perf_counter() - t0) / 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=10)
    a = p.parse_args(argv)
    one_mode(a)
    return 0


def one_mode(a: argparse.Namespace) -> None:
    wd = tempfile.mkdtemp(prefix="ckptflow-bench-nodelc-")
    res: dict = {"model": a.model}
    try:
        with PrefectServer(os.path.join(wd, "prefect"), os.path.join(wd, "prefect.log")) as srv, Supervisor() as sup:
            os.environ["PREFECT_API_URL"] = srv.url
            env = dict(child_env({"PREFECT_API_URL": srv.url, "PREFECT_WORKER_QUERY_SECONDS": "1"}))
            from ckptflow.flows.serve import deploy

            warm1, warm2 = os.path.join(wd, "warm1"), os.path.join(wd, "warm2")
            gen1 = config(os.path.join(wd, "g1.toml"), os.path.join(wd, "one"), warm1)
            from prefect.settings import PREFECT_API_URL, temporary_settings

            with temporary_settings({PREFECT_API_URL: srv.url}):  # Prefect caches settings per process
                deploy(POOL, None)

            def worker(cfg: str, *flags: str) -> subprocess.Popen:
                return sup.start(
                    f"w{len(sup.procs)}",
                    [sys.executable, "-m", "ckptflow.cli.main", "worker", "--pool", POOL, "--config", cfg, *flags],
                    env=dict(env, CKPTFLOW_CONFIG=cfg),
                    log=open(os.path.join(wd, f"worker{len(sup.procs)}.log"), "ab"),
                )

            # 1 node x 2 ranks, one hot root
            g = worker(gen1, "--general")
            args = [
                "--ckpt-root",
                os.path.join(wd, "one"),
                "--run-id",
                RUN1,
                "--model",
                a.model,
                "--max-steps",
                str(a.steps),
                "--save-every",
                str(a.every),
            ]
            subprocess.run(
                torchrun("ckptflow.trainer.train", args, nproc=2),
                check=True,
                capture_output=True,
                env=dict(env, CKPTFLOW_CONFIG=gen1),
                timeout=1800,
            )
            c = committed_at([os.path.join(wd, "one")], RUN1)
            steps = sorted(c)
            done = wait_promoted(os.path.join(wd, "one", RUN1), steps, 900)
            res["one_node_latency_s"] = [done[s] - c[s] for s in steps if s in done]
            sup.stop(g)
            # 2 nodes x 1 rank, node-local hot roots
            roots = [os.path.join(wd, f"node{i}") for i in range(2)]
            gen2 = config(os.path.join(wd, "g2.toml"), os.path.join(wd, "general-hot"), warm2)
            worker(gen2, "--general")
            for i, r in enumerate(roots):
                worker(config(os.path.join(wd, f"n{i}.toml"), r, warm2))
            time.sleep(10)  # the workers register their queues
            args[3] = RUN2
            with NodeAgents(roots, args[2:], env=env, log_dir=os.path.join(wd, "logs")) as nodes:
                nodes.start()
                if nodes.wait(1800) != [0, 0]:
                    raise SystemExit("the 2-node job failed; see " + os.path.join(wd, "logs"))
            c = committed_at(roots, RUN2)
            done = wait_promoted(os.path.join(warm2, RUN2), sorted(c), 900)
            res["two_node_latency_s"] = [done[s] - c[s] for s in sorted(c) if s in done]
            parts = []
            for s in sorted(c):
                pdir = os.path.join(warm2, RUN2, "_lifecycle", f"step_{s:09d}", "parts")
                for n in os.listdir(pdir):
                    if n != "manifest.json":
                        with open(os.path.join(pdir, n)) as f:
                            r = json.load(f)
                        if r["bytes_raw"]:
                            parts.append(r["bytes_raw"] / r["seconds"] / 1e6)
            res["part_mb_s"] = parts
            last = max(c)
            res["plain_copy_mb_s"] = plain_copy_mb_s(
                [os.path.join(r, RUN2, f"step_{last:09d}") for r in roots], os.path.join(warm2, "plain")
            )
    finally:
        shutil.rmtree(wd, ignore_errors=True)
    med = statistics.median
    one, two = med(res["one_node_latency_s"]), med(res["two_node_latency_s"])
    print(
        f"model {a.model}; commit -> warm committed: "
        f"1 node x 2 ranks {one:.1f} s, 2 nodes x 1 rank {two:.1f} s "
        f"({two / one:.2f}x)"
    )
    pm, cp = med(res["part_mb_s"]), res["plain_copy_mb_s"]
    print(f"promote per node (its part) {pm:.0f} MB/s vs copyfile+fsync {cp:.0f} MB/s: {pm / cp:.2f}x (target >= 0.8x)")
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
