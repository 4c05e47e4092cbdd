"""Replication and the save stall over a real network: one node's link throttled against a clean
link, in one run (root: network namespaces).

    python -m benchmarks.bench_netns [--model mini] [--steps 40] [--save-every 10] [--rate 50mbit]
        [--rounds 2] [--ckpt-timeout-s 600] [--json PATH]

Two nodes, one rank each, in namespaces of their own joined by a bridge (``harness.NetNodes``),
node-local hot roots, 2 replicas (every shard also goes to the other node), FSDP: the training
collectives cross the same links as the replicas. Arms, interleaved
per round: ``clean`` (the veth links as they are) and ``throttled`` (node 1's bridge port and
link at ``--rate`` both ways, ``tc ... tbf``). Read from rank 0's summary: replicated bytes and
seconds (throughput of phase 4), the save stall (median and max: what training waits), and the
commit time (save call to the two-level commit's end, median).

What it tells: what a slow link costs the commit and the stall, and that the commit's timeout
(``--ckpt-timeout-s``) need not cover a save's replication: each wait covers one step of a chunk
that follows the link (``trainer/nodes/transport.py``). Run it with a timeout below the throttled
arm's replication time per save to see every save commit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from ckptflow.harness import NetNodes, NodeAgents


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_netns",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="mini")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--rate", default="50mbit", help="tbf rate of the throttled link")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--parallel", default="fsdp", help="the job's parallelism (fsdp, ddp, none)")
    p.add_argument(
        "--ckpt-timeout-s",
        type=float,
        default=600.0,
        help="the checkpoint group's timeout (the commit's, each wait of a transfer)",
    )
    p.add_argument("--json")
    return p.parse_args(argv)


def _summary(nodes: NodeAgents) -> dict[str, Any]:
    out = "\n".join(nodes.output(i) for i in range(nodes.n))
    line = [ln for ln in out.splitlines() if ln.startswith("ckptflow-summary ")][-1]
    return json.loads(line.split(" ", 1)[1])


def one(net: NetNodes, root: str, args: argparse.Namespace) -> dict[str, Any]:
    roots = [os.path.join(root, f"node{i}") for i in range(2)]
    job = ["--run-id", "b", "--model", args.model, "--max-steps", str(args.steps), "--save-every", str(args.save_every)]
    job += ["--parallel", args.parallel, "--ckpt-timeout-s", str(args.ckpt_timeout_s)]
    with NodeAgents(roots, job, log_dir=os.path.join(root, "logs"), net=net) as nodes:
        nodes.start()
        rcs = nodes.wait(900)
        if rcs != [0, 0]:
            raise SystemExit(f"training failed {rcs}:\n{nodes.output(0)[-3000:]}")
        s = _summary(nodes)
    shutil.rmtree(root, ignore_errors=True)
    return s


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = tempfile.mkdtemp(prefix="bench-netns-")
    rows: dict[str, list[dict[str, Any]]] = {"clean": [], "throttled": []}
    try:
        with NetNodes(2) as net:
            for r in range(args.rounds):
                for arm in ("clean", "throttled") if r % 2 == 0 else ("throttled", "clean"):
                    if arm == "throttled":
                        net.throttle(1, args.rate)
                    try:
                        rows[arm].append(one(net, os.path.join(work, f"{arm}{r}"), args))
                    finally:
                        net.unthrottle(1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res: dict[str, Any] = {
        "machine": f"{platform.node()} {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        "model": args.model,
        "rate": args.rate,
    }
    for arm, xs in rows.items():
        b = statistics.median(x["replicated_bytes"] for x in xs)
        t = statistics.median(x["replicate_s"] for x in xs)
        res[arm] = {
            "replicated_mb_per_save": b / 1e6 / xs[0]["saves"],
            "replication_mb_per_s": b / 1e6 / t if t else None,
            "replicate_s_per_save": t / xs[0]["saves"],
            "stall_median_ms": statistics.median(x["stall_median_ms"] for x in xs),
            "stall_max_ms": max(x["stall_max_ms"] for x in xs),
            "commit_median_s": statistics.median(x["commit_median_s"] for x in xs),
            "train_s": statistics.median(x["train_s"] for x in xs),
        }
    c, t = res["clean"], res["throttled"]
    print(
        f"2 nodes in namespaces, model {args.model} (--parallel {args.parallel}), {args.steps} steps, "
        f"a save every {args.save_every}, commit timeout {args.ckpt_timeout_s:g} s; {args.rounds} rounds"
    )
    for arm in ("clean", "throttled"):
        a = res[arm]
        print(
            f"  {arm:9s} replication {a['replication_mb_per_s']:8.1f} MB/s "
            f"({a['replicated_mb_per_save']:.1f} MB a save in {a['replicate_s_per_save']:.1f} s)"
            f"  stall {a['stall_median_ms']:6.1f} ms (max {a['stall_max_ms']:.1f})  commit {a['commit_median_s']:.2f} s"
            f"  training {a['train_s']:.1f} s"
        )
    print(
        f"throttled / clean: replication throughput {t['replication_mb_per_s'] / c['replication_mb_per_s']:.3f}x, "
        f"stall {t['stall_median_ms'] / c['stall_median_ms']:.2f}x, "
        f"commit {t['commit_median_s'] / c['commit_median_s']:.2f}x"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
