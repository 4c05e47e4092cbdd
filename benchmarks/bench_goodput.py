"""Goodput, checked against reality: a real run with failures vs ``ckptflow goodput``'s replay.

    python -m benchmarks.bench_goodput [--mtbf-s 45] [--steps 4000] [--interval 25] [--seed 1]

The reference job (tiny model, 2 ranks, gloo, ``--step-sleep`` standing in for GPU compute) runs
under torchrun with restarts while a worker is SIGKILLed at exponential times (MTBF in seconds).
Its effective training time is measured from its own files and compared with the replay of the
same kill times for the costs measured from the same run (``ckptflow.realrun``). Target: within
2 percentage points. Then, for the costs this machine measured, what ``ckptflow goodput`` predicts
at MTBF 3 h with the advised interval (target >= 98 %).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile

from ckptflow.realrun import check, run_with_failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mtbf-s", type=float, default=45.0)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--interval", type=int, default=25)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--model", default="tiny")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", action="store_true", help="keep the work dir")
    a = p.parse_args(argv)
    wd = tempfile.mkdtemp(prefix="ckptflow-bench-goodput-")
    try:
        run = run_with_failures(
            wd,
            mtbf_s=a.mtbf_s,
            max_steps=a.steps,
            interval=a.interval,
            seed=a.seed,
            model=a.model,
            step_sleep=a.step_sleep,
        )
        c = check(run, wd)
        costs = c.costs
        print(
            f"real run: {a.steps} steps every {a.interval}, {c.kills} SIGKILLs (MTBF {a.mtbf_s:g} s), "
            f"{run.attempts} attempts, {run.wall_s:.1f} s from the first step to the final commit"
        )
        print(
            f"measured: step {costs['step_s'] * 1e3:.1f} ms, stall {costs['save_s'] * 1e3:.1f} ms, "
            f"persist {costs['persist_s'] * 1e3:.0f} ms, restart {costs['restore_s']:.2f} s"
        )
        for n in c.notes:
            print(f"  {n}")
        print(
            f"effective training time: real {100 * c.real:.2f} %, replay {100 * c.predicted:.2f} %, "
            f"difference {c.diff_points:+.2f} points (target within 2)"
        )
        print("replay parts: " + ", ".join(f"{k} {100 * v:.2f} %" for k, v in c.predicted_parts.items()))
        at3h = subprocess.run(
            [
                sys.executable,
                "-m",
                "ckptflow.cli.main",
                "goodput",
                "--step-seconds",
                str(costs["step_s"]),
                "--save-seconds",
                str(costs["save_s"]),
                "--persist-seconds",
                str(costs["persist_s"]),
                "--restore-seconds",
                str(costs["restore_s"]),
                "--mtbf-hours",
                "3",
                "--trials",
                "10",
                "--json",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        d = json.loads(at3h.stdout)
        print(
            f"these costs at MTBF 3 h, advised interval {d['interval_steps']} steps: effective "
            f"{100 * d['effective']:.2f} % (95 % CI {100 * d['effective_low']:.2f}-{100 * d['effective_high']:.2f}); "
            f"{d['verdict']}"
        )
        print(
            json.dumps({"check": c.to_json(), "mtbf_3h": {k: d[k] for k in ("effective", "interval_steps", "parts")}})
        )
        return 0
    finally:
        if not a.keep:
            shutil.rmtree(wd, ignore_errors=True)
        else:
            print("kept", wd)


if __name__ == "__main__":
    raise SystemExit(main())
