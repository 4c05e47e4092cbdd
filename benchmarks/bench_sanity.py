"""The restore sanity step's peak memory and time against the checkpoint's size: a whole load against bounded.

    python -m benchmarks.bench_sanity [--models medium,large] [--reps 2] [--probe live|next-step] [--saved-ranks 1]

For each preset, a checkpoint the reference job saved at world size 1 (two steps: the model, AdamW's two moments
and the rest); then the sanity step as the verify stage runs it, a fresh process
(``python -m ckptflow.tasks.sanity DIR --stats``), alternating, ``--reps`` times each:

* **whole** (``--whole``): the model and optimizer built, every tensor loaded, then the probe;
* **bounded** (the default at world size 1, ``tasks/bounded.py``): the model on the meta device, each module's
  tensors read just before it runs, then every parameter and optimizer tensor streamed for the statistics.

Peak memory is the process's high-water resident set (``ru_maxrss`` of the waited child: the sanity step is one
process); time is the process's wall time, imports included. Both must give the same probe-loss bits.

Then the largest preset under a memory cgroup of a quarter of its state (cgroup v1, as root): bounded passes with
the same bits; the whole load is killed by the kernel (what the verify stage now records as "could not check").
With ``--saved-ranks 2``, a restore drill of it (fetch into scratch, verify, the sanity step at world size 1) under
a cgroup of 1 GiB, less than half the checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

from ckptflow.harness import child_env, reference_job

CGROUP_V1 = "/sys/fs/cgroup/memory"

MEASURE = """
import json, resource, subprocess, sys, time
t = time.perf_counter()
r = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(json.dumps({"rc": r.returncode, "peak_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
                  "seconds": time.perf_counter() - t, "stdout": r.stdout, "stderr": r.stderr[-2000:]}))
"""


def make_checkpoint(root: str, model: str, probe: str, ranks: int) -> tuple[str, int]:
    # next-step: the reference of step 2 is the loss of step 3, replayed by the sanity step with autograd on
    steps = 3 if probe == "next-step" else 2
    extra = ["--probe", probe]
    cmd = reference_job(root, model, max_steps=steps, save_every=2, nproc=ranks, model=model, extra=extra)
    r = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"the reference job failed:\n{r.stderr[-3000:]}")
    step = os.path.join(root, model, "step_000000002")
    size = sum(os.path.getsize(os.path.join(step, n)) for n in os.listdir(step))
    return step, size


def sanity(step: str, *, whole: bool, cgroup: str | None = None) -> dict:
    cmd = [sys.executable, "-m", "ckptflow.tasks.sanity", step, "--stats", *(["--whole"] if whole else [])]
    wrapped = [sys.executable, "-c", MEASURE, *cmd]
    if cgroup is not None:  # the measuring process and the check under the limit (the former: a few MB)
        wrapped = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *wrapped]
    r = subprocess.run(wrapped, env=child_env(), capture_output=True, text=True, timeout=3600)
    got = json.loads(r.stdout)
    res = json.loads(got["stdout"]) if got["rc"] in (0, 1) and got["stdout"].strip() else {}
    return {
        "rc": got["rc"],
        "peak_mb": got["peak_kb"] / 1024,
        "seconds": got["seconds"],
        "ok": res.get("ok"),
        "loss": res.get("probe_loss_restored"),
        "match": res.get("probe_match"),
        "memory": res.get("memory"),
        "note": res.get("bounded_note"),
    }


DRILL = """
import json, sys
from ckptflow.tasks.config import TierConfig
from ckptflow.tasks.drill import drill_one
from ckptflow.tasks.storage import Tier
r = drill_one(Tier(TierConfig(name="hot", url=sys.argv[1])), sys.argv[2], 2, scratch_root=sys.argv[3])
print(json.dumps({"ok": r.ok, "failure": r.failure, "world_size": r.world_size, "saved": r.saved_world_size,
                  "match": r.probe_match, "recovery_s": r.recovery_seconds}))
"""


def drill(root: str, model: str, cgroup: str) -> dict:
    """A restore drill of the step (fetch into scratch, verify, the sanity step at another world size), the
    drilling process and all it starts under the cgroup."""
    with tempfile.TemporaryDirectory(prefix="ckptflow-bench-drill-") as scratch:
        cmd = [sys.executable, "-c", DRILL, root, model, scratch]
        cmd = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *cmd]
        r = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=3600)
    return json.loads(r.stdout) if r.returncode == 0 else {"ok": False, "failure": f"rc {r.returncode}"}


@contextlib.contextmanager
def memory_cgroup(limit_mb: int) -> Iterator[str]:
    cg = os.path.join(CGROUP_V1, f"ckptflow-bench-{os.getpid()}")
    os.mkdir(cg)
    try:
        with open(os.path.join(cg, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit_mb << 20))
        yield cg
    finally:
        for _ in range(100):
            try:
                os.rmdir(cg)
                break
            except OSError:
                time.sleep(0.1)


def under_limit(step: str, limit_mb: int, *, whole: bool) -> dict:
    with memory_cgroup(limit_mb) as cg:
        return sanity(step, whole=whole, cgroup=cg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="medium,large")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--root", default=None, help="where the checkpoints go (default: a temporary folder)")
    p.add_argument(
        "--probe", default="live", choices=["live", "next-step"], help="the reference the checkpoints record"
    )
    p.add_argument(
        "--saved-ranks",
        type=int,
        default=1,
        help="save with this many ranks (FSDP2); above 1 the sanity step restores at another world size, as a "
        "restore drill does",
    )
    a = p.parse_args()
    root = a.root or tempfile.mkdtemp(prefix="ckptflow-bench-sanity-")
    rows = []
    largest: tuple[str, int, float] | None = None
    for model in a.models.split(","):
        t0 = time.perf_counter()
        step, size = make_checkpoint(root, model, a.probe, a.saved_ranks)
        print(f"{model}: checkpoint of {size / 2**20:.0f} MiB made in {time.perf_counter() - t0:.0f} s", flush=True)
        runs: dict[str, list[dict]] = {"whole": [], "bounded": []}
        for _ in range(a.reps):
            for how in ("whole", "bounded"):
                runs[how].append(sanity(step, whole=how == "whole"))
                print(f"  {how}: {runs[how][-1]}", flush=True)
        w, b = runs["whole"], runs["bounded"]
        same = {r["loss"] for r in w + b} and len({r["loss"] for r in w + b}) == 1
        row = {
            "model": model,
            "state_mib": size / 2**20,
            "whole_peak_mib": statistics.median(r["peak_mb"] for r in w),
            "bounded_peak_mib": statistics.median(r["peak_mb"] for r in b),
            "whole_s": statistics.median(r["seconds"] for r in w),
            "bounded_s": statistics.median(r["seconds"] for r in b),
            "all_ok": all(r["ok"] and r["match"] == "bitwise" for r in w + b),
            "bounded_ran_bounded": all(r["memory"] == "bounded" for r in b),
            "same_bits": bool(same),
        }
        rows.append(row)
        if largest is None or size > largest[1]:
            largest = (step, size, b[0]["loss"])
    print()
    print(
        "| preset | state | whole: peak | bounded: peak | bounded peak / state (target <= 0.25x, large) "
        "| whole: time | bounded: time | bounded / whole time (target <= 1.5x) | probe bits |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        bits = "bitwise, the same in both" if r["all_ok"] and r["same_bits"] and r["bounded_ran_bounded"] else "DIFFER"
        print(
            f"| {r['model']} | {r['state_mib']:.0f} MiB | {r['whole_peak_mib']:.0f} MiB "
            f"| {r['bounded_peak_mib']:.0f} MiB | **{r['bounded_peak_mib'] / r['state_mib']:.2f}x** "
            f"| {r['whole_s']:.1f} s | {r['bounded_s']:.1f} s | **{r['bounded_s'] / r['whole_s']:.2f}x** | {bits} |"
        )
    if largest is not None and os.access(CGROUP_V1, os.W_OK):
        step, size, loss = largest
        limit = size // 4 >> 20
        print(f"\nunder a memory cgroup of {limit} MiB (a quarter of the {size / 2**20:.0f} MiB state):")
        for how in ("bounded", "whole"):
            r = under_limit(step, limit, whole=how == "whole")
            what = (
                f"passed, probe {r['match']}, the same bits: {r['loss'] == loss}"
                if r["rc"] == 0
                else f"killed (rc {r['rc']})"
            )
            print(f"  {how}: {what}; peak {r['peak_mb']:.0f} MiB, {r['seconds']:.1f} s")
        if a.saved_ranks > 1:  # the drill restores it at another world size: 1, bounded
            with memory_cgroup(1024) as cg:
                d = drill(root, os.path.basename(os.path.dirname(step)), cg)
            print(f"a restore drill of it under a memory cgroup of 1024 MiB (its process and the sanity step): {d}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
