"""The way back, timed: a job whose hot run folder is gone resumes from warm or from cold (local S3).

    python -m benchmarks.bench_resume_tiers [--mb-per-rank 50] [--rounds 3] [--out results.json]

A 2-rank FSDP2 MLP with Adam (``_vs_dcp_worker``'s) saves step 1; the step is promoted to a warm folder tier
and archived to a cold S3 tier (moto over HTTP on 127.0.0.1), both codec "none" so DCP's own reader can read
the objects. Then, at the saved world size (2) and at another (1), rounds of one torchrun job per arm, in
turn, the hot run folder wiped before each; each arm's time is its slowest rank's, from the call to a state
in memory:

* **ckptflow**: ``CheckpointManager.load()`` with the tiers of the config (the way back, every byte checked);
* **restore + load**: ``ckptflow restore RUN --step 1 --to <hot>/<run>/step_...`` (a process, as a user runs
  it), then ``load()`` from hot;
* **dcp FsspecReader** (cold only): ``dcp.load`` straight from the S3 objects, what a DCP user can do today;
* **floor** (cold only): the bytes each rank's load reads, plain ranged GETs into memory, no checks.

Prints the medians and the ratios to the last two (targets from cold: <= 1.0x DCP's reader, <= 1.3x the
floor), and the bytes fetched against the bytes the ranks read (target <= 1.1x).
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

from benchmarks._vs_dcp_worker import width_for
from ckptflow.harness import LOCAL_AWS, MotoServer, torchrun

RUN = "rt"
CLI = [sys.executable, "-m", "ckptflow.cli.main"]
STEP_DIR = "step_000000001"


def _config(path: str, hot: str, *, warm: str | None = None, cold: tuple[str, str] | None = None) -> str:
    text = f'[hot]\nurl = "{hot}"\n'
    if warm:
        text += f'[warm]\nurl = "{warm}"\ncodec = "none"\n'
    if cold:
        text += f'[cold]\nurl = "{cold[0]}"\ncodec = "none"\nendpoint_url = "{cold[1]}"\n'
    with open(path, "w") as f:
        f.write(text)
    return path


def _job(arm: str, world: int, common: list[str], out: str, env: dict[str, str]) -> dict:
    cmd = torchrun("benchmarks._resume_tiers_worker", [*common, "--arm", arm, "--out", out], nproc=world)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"arm {arm} at world size {world} failed:\n{r.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb-per-rank", type=float, default=50.0, help="model + Adam state per rank at 2 ranks")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    os.environ.update(LOCAL_AWS)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("CKPTFLOW_CONFIG", None)
    work = tempfile.mkdtemp(prefix="ckptflow-bench-resume-")
    moto = MotoServer()
    try:
        import boto3

        from ckptflow.tasks.config import load_config
        from ckptflow.tasks.storage import open_tiers
        from ckptflow.tasks.transfer import archive, promote

        boto3.client("s3", endpoint_url=moto.url).create_bucket(Bucket="bench")
        hot = os.path.join(work, "hot")
        run = os.path.join(hot, RUN)
        cold = ("s3://bench/cold", moto.url)
        both = _config(os.path.join(work, "both.toml"), hot, warm=os.path.join(work, "warm"), cold=cold)
        cfgs = {
            "warm": _config(os.path.join(work, "warm.toml"), hot, warm=os.path.join(work, "warm")),
            "cold": _config(os.path.join(work, "cold.toml"), hot, cold=cold),
        }
        width = width_for(a.mb_per_rank, 2)
        prefix = f"s3://bench/cold/{RUN}/{STEP_DIR}"
        common = ["--hot", hot, "--width", str(width), "--endpoint", moto.url, "--prefix", prefix]
        _job("save", 2, [*common, "--config", both], os.path.join(work, "save.json"), env)
        h, warm, cold_tier = open_tiers(load_config(both))
        promote(h, warm, RUN, 1)
        archive(warm, cold_tier, RUN, 1)
        size = sum(os.path.getsize(os.path.join(run, STEP_DIR, n)) for n in os.listdir(os.path.join(run, STEP_DIR)))
        results: dict[str, dict] = {}
        for world in (2, 1):
            for src, cfg in cfgs.items():
                arms = ["ckptflow", "restore+load"] + (["fsspec", "floor"] if src == "cold" else [])
                times: dict[str, list[float]] = {x: [] for x in arms}
                fetched: dict[str, int] = {}
                for rnd in range(a.rounds):
                    for arm in arms:
                        shutil.rmtree(run, ignore_errors=True)
                        out = os.path.join(work, f"{src}-{world}-{arm}-{rnd}.json")
                        args = [*common, "--config", cfg]
                        if arm == "restore+load":
                            t0 = time.perf_counter()
                            subprocess.run(
                                [
                                    sys.executable,
                                    "-m",
                                    "ckptflow.cli.main",
                                    "restore",
                                    RUN,
                                    "--step",
                                    "1",
                                    "--to",
                                    os.path.join(run, STEP_DIR),
                                ],
                                env=dict(env, CKPTFLOW_CONFIG=cfg),
                                check=True,
                                capture_output=True,
                            )
                            cli = time.perf_counter() - t0
                            got = _job("hot", world, args, out, env)
                            got["s"] += cli
                        else:
                            got = _job(arm, world, args, out, env)
                        times[arm].append(got["s"])
                        fetched[arm] = got["bytes"]
                med = {x: statistics.median(v) for x, v in times.items()}
                row = {"world": world, "source": src, "seconds": med, "checkpoint_bytes": size}
                if src == "cold":
                    row["vs_fsspec"] = med["ckptflow"] / med["fsspec"]
                    row["vs_floor"] = med["ckptflow"] / med["floor"]
                    row["bytes_fetched_vs_read"] = fetched["ckptflow"] / max(1, fetched["floor"])
                results[f"{src}@{world}"] = row
        print(f"checkpoint {size / 1e6:.1f} MB (saved by 2 ranks); medians of {a.rounds} rounds")
        print(
            f"{'from':<5} {'ranks':>5} {'ckptflow s':>10} {'restore+load s':>14} {'dcp fsspec s':>12} "
            f"{'floor s':>8} {'vs fsspec':>9} {'vs floor':>8} {'fetched/read':>12}"
        )
        for r in results.values():
            s = r["seconds"]
            extra = (
                f"{s['fsspec']:>12.2f} {s['floor']:>8.2f} {r['vs_fsspec']:>8.2f}x {r['vs_floor']:>7.2f}x "
                f"{r['bytes_fetched_vs_read']:>11.2f}x"
                if r["source"] == "cold"
                else f"{'-':>12} {'-':>8} {'-':>9} {'-':>8} {'-':>12}"
            )
            print(f"{r['source']:<5} {r['world']:>5} {s['ckptflow']:>10.2f} {s['restore+load']:>14.2f} {extra}")
        if a.out:
            with open(a.out, "w") as f:
                json.dump(results, f, indent=1)
        return 0
    finally:
        moto.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
