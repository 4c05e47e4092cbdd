"""ckptflow against torch.distributed.checkpoint's own async saves, in the same training loop.

    python -m benchmarks.bench_vs_dcp [--mb-per-rank 100] [--steps 100] [--save-every 10]
        [--rounds 3] [--nproc 2] [--batch 16] [--root DIR] [--json PATH]

The loop: an MLP sharded with FSDP2 (``fully_shard``) on CPU, ``--nproc`` ranks under
``torchrun`` on gloo, Adam, ``--mb-per-rank`` MB of state per rank (parameters and both
Adam moments), a save every ``--save-every`` steps. Four arms of it:

``none``        no checkpoint: the baseline;
``dcp``         ``dcp.async_save`` as documented: the default ``FileSystemWriter``, which stages
                with a blocking CPU copy inside the call, and the default thread executor;
``dcp_stager``  ``dcp.async_save(..., async_stager=DefaultStager(StagingOptions(...)))`` with
                ``use_async_staging=True``: the copy runs in a thread, and the loop waits for
                ``AsyncSaveResponse.staging_completion`` before its next ``optimizer.step()``;
``ckptflow``    ``CheckpointManager`` (default async mode, ``emit_events=False``,
                ``resume="never"``) as README's "three calls" use it.

Both DCP arms do what a correct user must: at most one save in flight (the next save
waits for the previous upload first), and DCP's background collectives on a gloo group of
their own rather than the training group. ckptflow does the same inside ``save()``.

What is measured, per arm, and why that way:

* **stall**: what the training thread pays per save: the save call (waiting for the previous
  save, building the state dict, any synchronous copy) plus every wait before the next
  ``optimizer.step()`` (the staging future; ckptflow's, inside its optimizer pre-hook, timed by
  two hooks that bracket it). Per save the slower rank (the other waits for it at the next
  collective), then the median over the saves of all rounds. A save at the last step has no
  next step in the window and is left out of the median.
* **CPU per save**: process CPU time (``getrusage(RUSAGE_SELF)``: user + system, every thread)
  of all ranks over the loop and the drain of the last save, minus the no-checkpoint arm's
  over the same steps in the same round, divided by the saves. On a host whose cores the
  ranks fill, every such second is taken from training; on a GPU node it is what the
  checkpoint takes from the data loader and the rest of the host.
* **wall overhead**: the loop's wall time (slower rank) against the no-checkpoint arm's in
  the same round, median over rounds. The drain of the last save is not in it: in a long
  job a save's background work overlaps the following steps, and that is in the window for
  all saves but the last.
* **resume**: a fresh model and optimizer, into which the last checkpoint is loaded (slower
  rank): ``get_state_dict`` + ``dcp.load`` + ``set_state_dict`` for the DCP arms,
  ``CheckpointManager.load()`` (which verifies every file's checksum as it reads) for
  ckptflow. The page cache is warm (the checkpoint was just written) in every arm alike.
  The loaded state is then compared tensor by tensor with the trained one ("exact").

Every checkpointing arm makes one untimed, drained save before its window, so one-time
costs (lazy imports, thread pools, first allocation of staging buffers) are not charged to
a window of ten saves.

How the arms are interleaved, and why: each round is one fresh ``torchrun`` job in which the
four arms run one after another, each a full loop on a freshly built model, each drained
before the next starts; the order rotates by one arm per round. On a shared, noisy host the
largest error is the load of the other jobs drifting over minutes: arms of one round run
within a couple of minutes of each other, and overhead and CPU are computed per round
against that round's own baseline, so the drift cancels; rotation keeps any arm from always
running first or last (``--rounds`` a multiple of 4 balances it fully); a fresh job per round
keeps allocator and thread state from piling up across rounds. Finer interleaving — arms
alternating save by save inside one loop — would let one arm's background write overlap the
next arm's steps, and its CPU and wall time could no longer be charged to it.

Targets: ckptflow's stall <= the best DCP mode's; its CPU per save <= the best DCP mode's;
its verified load <= ``dcp.load``'s (best of the two DCP arms). Printed as ratios
ckptflow / best DCP mode; the figures go to stdout and ``--json`` only. The exit status is
1 only if a resume did not reproduce the trained state or a job failed; a missed target is
a result, not an error.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = "benchmarks._vs_dcp_worker"
ARMS = ("none", "dcp", "dcp_stager", "ckptflow")
DCP_ARMS = ("dcp", "dcp_stager")
LABELS = {
    "none": "no checkpoint",
    "dcp": "dcp.async_save",
    "dcp_stager": "dcp.async_save + DefaultStager",
    "ckptflow": "ckptflow CheckpointManager",
}
TARGETS = {"stall": 1.0, "cpu_per_save": 1.0, "load": 1.0}
"""Largest ratio ckptflow / best DCP mode that meets each target."""
JOB_TIMEOUT_S = 3600


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_vs_dcp",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--mb-per-rank", type=float, default=100.0, help="model + Adam state per rank, MB (1e6 bytes)")
    p.add_argument("--steps", type=int, default=100, help="timed training steps per arm and round")
    p.add_argument("--save-every", type=int, default=10, help="steps between saves")
    p.add_argument("--rounds", type=int, default=3, help="jobs, each running every arm once (order rotated)")
    p.add_argument("--nproc", type=int, default=2, help="ranks per job")
    p.add_argument("--batch", type=int, default=16, help="samples per rank and step")
    p.add_argument("--root", help="checkpoints and logs go here (default: a temp dir, removed after)")
    p.add_argument("--json", help="write the figures (and every rank's raw records) here")
    a = p.parse_args(argv)
    for name in ("mb_per_rank", "steps", "save_every", "rounds", "nproc", "batch"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if a.save_every > a.steps:
        p.error("--save-every must be <= --steps (no save would fall in the window)")
    return a


# -- running the jobs -------------------------------------------------------------------------
def job_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    for k in ("PREFECT_API_URL", "CKPTFLOW_FAULT", "CKPTFLOW_MANIFEST_KEY"):
        env.pop(k, None)
    return env


def arm_order(round_no: int) -> list[str]:
    """Every arm once, rotated by one per round."""
    k = round_no % len(ARMS)
    return list(ARMS[k:] + ARMS[:k])


def run_round(a: argparse.Namespace, root: str, round_no: int) -> dict[str, Any]:
    """One ``torchrun`` job running every arm once; returns the gathered per-rank records."""
    folder = os.path.join(root, f"round{round_no}")
    os.makedirs(folder, exist_ok=True)
    out, log_path = os.path.join(folder, "records.json"), os.path.join(folder, "worker.log")
    order = arm_order(round_no)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={a.nproc}",
        "--max-restarts=0",
        "--monitor-interval=0.5",
        "-m",
        WORKER,
        *("--root", folder, "--out", out, "--arms", ",".join(order), "--round", str(round_no)),
        *("--mb-per-rank", str(a.mb_per_rank), "--steps", str(a.steps), "--save-every", str(a.save_every)),
        *("--batch", str(a.batch)),
    ]
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        r = subprocess.run(cmd, cwd=REPO, env=job_env(), stdout=log, stderr=subprocess.STDOUT, timeout=JOB_TIMEOUT_S)
    if r.returncode != 0:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"round {round_no} failed (rc={r.returncode}); log {log_path}:\n{tail}")
    with open(out, encoding="utf-8") as f:
        records = json.load(f)
    records.update(order=order, job_s=time.perf_counter() - t0, load_avg=[load_before, os.getloadavg()[0]])
    return records


# -- turning per-rank records into figures --------------------------------------------------
def med(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def per_rank(rnd: dict[str, Any], arm: str) -> list[dict[str, Any]]:
    return [r["arms"][arm] for r in rnd["ranks"]]


def save_stalls(ranks: list[dict[str, Any]]) -> list[float]:
    """Per save followed by a step in the window: the slower rank's call + wait, seconds."""
    out = []
    for saves in zip(*(r["saves"] for r in ranks), strict=True):
        if all(s["wait_s"] is not None for s in saves):
            out.append(max(s["call_s"] + s["wait_s"] for s in saves))
    return out


def round_figures(rnd: dict[str, Any], arm: str) -> dict[str, Any]:
    """One arm in one round, the ranks combined, against that round's no-checkpoint arm."""
    ranks, base = per_rank(rnd, arm), per_rank(rnd, "none")
    wall, base_wall = max(r["loop_s"] for r in ranks), max(r["loop_s"] for r in base)
    cpu, base_cpu = sum(r["cpu_s"] for r in ranks), sum(r["cpu_s"] for r in base)
    saves = len(ranks[0]["saves"])
    fig: dict[str, Any] = {"wall_s": wall, "cpu_s": cpu, "saves": saves, "stalls_s": save_stalls(ranks)}
    if arm != "none":
        fig["overhead_pct"] = (wall / base_wall - 1) * 100
        fig["cpu_per_save_s"] = (cpu - base_cpu) / saves if saves else float("nan")
        fig["load_s"] = max(r["resume"]["load_s"] for r in ranks)
        exact = [r["resume"]["exact"] for r in ranks]
        fig["exact"] = None if None in exact else all(exact)
    return fig


def summarize(rounds: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per arm: medians over rounds (stall: over the saves of all rounds)."""
    out: dict[str, dict[str, Any]] = {}
    for arm in ARMS:
        figs = [round_figures(rnd, arm) for rnd in rounds]
        s: dict[str, Any] = {
            "wall_s": med([f["wall_s"] for f in figs]),
            "saves_per_round": figs[0]["saves"],
            "rounds": figs,
        }
        if arm != "none":
            stalls = [x for f in figs for x in f["stalls_s"]]
            s["stall_ms"] = med(stalls) * 1e3
            s["stall_saves"] = len(stalls)
            s["cpu_per_save_s"] = med([f["cpu_per_save_s"] for f in figs])
            s["overhead_pct"] = med([f["overhead_pct"] for f in figs])
            s["overhead_pct_range"] = [min(f["overhead_pct"] for f in figs), max(f["overhead_pct"] for f in figs)]
            s["load_s"] = med([f["load_s"] for f in figs])
            exact = [f["exact"] for f in figs]
            s["exact"] = None if None in exact else all(exact)
        out[arm] = s
    return out


def ratios(summary: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """ckptflow / the best DCP arm, metric by metric (the best may differ per metric)."""
    keys = {"stall": "stall_ms", "cpu_per_save": "cpu_per_save_s", "load": "load_s"}
    out = {}
    for name, key in keys.items():
        best = min(DCP_ARMS, key=lambda arm: summary[arm][key])
        ratio = summary["ckptflow"][key] / summary[best][key] if summary[best][key] > 0 else float("nan")
        out[name] = {"ratio": ratio, "best_dcp": best, "target": TARGETS[name], "met": ratio <= TARGETS[name]}
    return out


# -- the report -------------------------------------------------------------------------------
def setup_line(a: argparse.Namespace, rounds: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    r0 = rounds[0]["ranks"][0]
    mb = max(r["arms"]["none"]["state_bytes"] for r in rounds[0]["ranks"]) / 1e6
    saves = len(r0["arms"]["ckptflow"]["saves"])
    return (
        f"ckptflow vs DCP async saves: {a.nproc} ranks (gloo, FSDP2 MLP {r0['depth']} x {r0['width']}, Adam, CPU, "
        f"{r0['torch_threads']} torch thread(s) per rank), {mb:.1f} MB state per rank\n"
        f"{a.steps} steps per arm and round, batch {a.batch}, a save every {a.save_every} ({saves} saves), "
        f"{a.rounds} round(s); torch {meta['torch']}, {meta['machine']}, "
        f"load average {meta['load_avg_start']:.2f} -> {meta['load_avg_end']:.2f}"
    )


def table(summary: dict[str, dict[str, Any]], steps: int) -> str:
    head = f"{'arm':<32}{'stall ms':>10}{'CPU s/save':>12}{'wall overhead':>16}{'resume s':>10}  resumed state"
    lines = [head, "-" * len(head)]
    base = summary["none"]
    lines.append(
        f"{LABELS['none']:<32}{'-':>10}{'-':>12}{'(loop ' + format(base['wall_s'], '.2f') + ' s)':>16}{'-':>10}  -"
    )
    for arm in ARMS[1:]:
        s = summary[arm]
        exact = {True: "exact", False: "MISMATCH", None: "not checked (steps not a multiple of --save-every)"}[
            s["exact"]
        ]
        lines.append(
            f"{LABELS[arm]:<32}{s['stall_ms']:>10.1f}{s['cpu_per_save_s']:>12.3f}"
            f"{format(s['overhead_pct'], '+.1f') + ' %':>16}{s['load_s']:>10.3f}  {exact}"
        )
    lines.append(f"baseline step: {base['wall_s'] / steps * 1e3:.1f} ms (median loop wall / steps)")
    return "\n".join(lines)


def ratio_lines(rat: dict[str, dict[str, Any]]) -> str:
    names = {"stall": "stall", "cpu_per_save": "CPU per save", "load": "verified load"}
    lines = ["ckptflow / best DCP mode:"]
    for key, r in rat.items():
        verdict = "met" if r["met"] else "MISSED"
        lines.append(
            f"  {names[key]:<14}{r['ratio']:>7.2f}x  (target <= {r['target']:.2f}x: {verdict}; "
            f"best DCP mode: {LABELS[r['best_dcp']]})"
        )
    return "\n".join(lines)


def notes(summary: dict[str, dict[str, Any]]) -> str:
    n = summary["ckptflow"]["stall_saves"]
    return "\n".join(
        [
            f"stall: median over {n} saves per arm (slower rank): save call + wait before the next optimizer.step",
            "CPU: all threads of all ranks over loop + drain, minus the same round's no-checkpoint arm, per save",
            "wall overhead: loop time against the same round's no-checkpoint arm, median over rounds "
            "(per-round values in --json)",
            "resume: warm page cache; DCP arms: get_state_dict + dcp.load + set_state_dict; ckptflow: verified load()",
        ]
    )


def print_report(a: argparse.Namespace, rounds: list[dict[str, Any]], result: dict[str, Any]) -> None:
    print(setup_line(a, rounds, result["meta"]))
    print()
    print(table(result["summary"], a.steps))
    print()
    print(ratio_lines(result["ratios"]))
    print()
    print(notes(result["summary"]))


# -- main -------------------------------------------------------------------------------------
def machine_meta() -> dict[str, Any]:
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "?"
    return {
        "machine": f"{os.cpu_count()} CPUs, {platform.python_implementation()} {platform.python_version()}",
        "torch": torch_version,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load_avg_start": os.getloadavg()[0],
        "argv": sys.argv[1:],
    }


def run_rounds(a: argparse.Namespace, root: str) -> list[dict[str, Any]]:
    rounds = []
    for r in range(a.rounds):
        order = ", ".join(arm_order(r))
        print(f"round {r + 1}/{a.rounds}: {order} (log {root}/round{r}/worker.log)", file=sys.stderr, flush=True)
        rounds.append(run_round(a, root, r))
    return rounds


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    own_root = a.root is None
    root = tempfile.mkdtemp(prefix="ckptflow-vs-dcp-") if own_root else os.path.abspath(a.root)
    os.makedirs(root, exist_ok=True)
    meta = machine_meta()
    t0 = time.perf_counter()
    try:
        rounds = run_rounds(a, root)
    finally:
        if own_root:
            shutil.rmtree(root, ignore_errors=True)
    meta.update(load_avg_end=os.getloadavg()[0], total_s=time.perf_counter() - t0)
    summary = summarize(rounds)
    result = {"meta": meta, "args": vars(a), "summary": summary, "ratios": ratios(summary), "raw_rounds": rounds}
    print_report(a, rounds, result)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    exact = [summary[arm]["exact"] for arm in ARMS[1:]]
    return 1 if False in exact else 0


if __name__ == "__main__":
    sys.exit(main())
