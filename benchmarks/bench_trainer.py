"""Trainer benchmark: what a checkpoint costs the training loop, and how fast it persists and loads.

    python -m benchmarks.bench_trainer [--model small|medium] [--quick] [--out results.json]

Prints ratios measured in the same run against baselines on the same machine; it is
not a timed test. Two parts, each real ``torchrun`` jobs (2 ranks, gloo, FSDP2):

1. ``benchmarks._trainer_worker``: in one process per rank — state bytes; the memcpy
   floor (the same tensors copied into preallocated buffers); the training-thread
   stall of ``CheckpointManager.save`` in every async mode, median over saves with
   real steps between them; ``torch.save`` of the gathered state on rank 0; persist
   throughput against ``dd conv=fsync`` of the same bytes on the same disk; load and
   verification throughput against a raw read of the same files, cold and warm.
2. End to end: the reference job (``trainer.train``) with a save every
   ``--e2e-every`` steps against the same job with ``--no-save``, same steps. The
   background persist competes with training for the same cores, so this is the
   number users feel. Also measured inside the saving run: the step-time excess in
   the steps after each save over the run's own median step, with the same steps of
   the no-save run as the noise control.

Targets: stall <= 1.0x memcpy floor; persist >= 0.8x dd; load >= 0.8x raw
read; end-to-end overhead <= 0.5 % of training time. Results: docs/benchmarks.md.
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
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NPROC = 2
MODES = ("async_staging", "sync")
TARGETS = {"stall_x_memcpy": 1.0, "persist_x_dd": 0.8, "load_x_raw": 0.8, "e2e_overhead": 0.005}
COMPARABLE = 0.03
"""Largest relative difference of the two runs' median step for a cross-run verdict."""
AFTER_SAVE_STEPS = 5
"""Steps after a save whose excess time is charged to it (its persist ends well within)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_trainer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="small", help="preset for the in-process measurements (small, medium)")
    p.add_argument("--quick", action="store_true", help="fewer saves and a shorter end-to-end run (~4 min)")
    p.add_argument("--out", help="write all results (raw per-rank numbers and the summary) as JSON here")
    p.add_argument(
        "--workdir",
        help="checkpoints and dd files go here; pick the disk a hot tier uses "
        "(default: a new folder under the system temp dir)",
    )
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    p.add_argument(
        "--global-batch",
        type=int,
        default=2,
        help="global batch of every job (2 keeps the run short on 2 cores; a shorter step "
        "makes the checkpoint overhead a larger share, so the figures are conservative)",
    )
    p.add_argument("--e2e-model", default="small", help="preset of the end-to-end jobs")
    p.add_argument("--e2e-steps", type=int, help="measured steps per end-to-end job (default 300; quick 100)")
    p.add_argument("--e2e-every", type=int, help="save interval of the end-to-end job (default 100; quick 50)")
    p.add_argument("--e2e-warmup", type=int, default=10, help="first steps left out of the end-to-end window")
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--e2e-only", action="store_true", help="only the end-to-end jobs (no worker measurements)")
    p.add_argument(
        "--e2e-probes",
        default="live,next-step",
        help="sanity references of the saving end-to-end jobs besides the default live probe: next-step (one more job)",
    )
    return p.parse_args(argv)


# -- running the jobs -------------------------------------------------------------------------
def job_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    for k in ("PREFECT_API_URL", "CKPTFLOW_FAULT", "CKPTFLOW_MANIFEST_KEY"):
        env.pop(k, None)
    return env


def torchrun(module: str, args: list[str], log_path: str, timeout: float) -> float:
    """Run ``module`` under torchrun (2 ranks); returns wall seconds, raises with the log tail."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={NPROC}",
        "--max-restarts=0",
        "--monitor-interval=0.5",
        "-m",
        module,
        *args,
    ]
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        r = subprocess.run(cmd, cwd=REPO, env=job_env(), stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    if r.returncode != 0:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"{module} failed (rc={r.returncode}); log {log_path}:\n{tail}")
    return time.perf_counter() - t0


def run_worker(a: argparse.Namespace, workdir: str) -> dict[str, Any]:
    out = os.path.join(workdir, "worker.json")
    saves, between, reps = (6, 2, 3) if a.quick else (8, 3, 5)
    torchrun(
        "benchmarks._trainer_worker",
        [
            "--workdir",
            workdir,
            "--out",
            out,
            "--model",
            a.model,
            "--global-batch",
            str(a.global_batch),
            "--saves",
            str(saves),
            "--steps-between",
            str(between),
            "--reps",
            str(reps),
        ],
        os.path.join(workdir, "worker.log"),
        timeout=3600,
    )
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def run_e2e(a: argparse.Namespace, workdir: str) -> dict[str, Any]:
    steps = a.e2e_steps or (100 if a.quick else 300)
    every = a.e2e_every or (50 if a.quick else 100)
    w0 = a.e2e_warmup
    max_steps = w0 + steps
    common = [
        "--ckpt-root",
        os.path.join(workdir, "e2e"),
        "--max-steps",
        str(max_steps),
        "--model",
        a.e2e_model,
        "--global-batch",
        str(a.global_batch),
    ]
    runs: dict[str, Any] = {}
    probes = a.e2e_probes.split(",")
    jobs = [
        ("no_save", ["--run-id", "nosave", "--no-save"]),
        ("save", ["--run-id", "save", "--save-every", str(every)]),
    ]
    if "next-step" in probes:
        # The same saves with the loss of the step after each save as the sanity reference
        # (SanitySpec.reference="next_step"): no probe forward pass at all.
        jobs.append(("save_next_step", ["--run-id", "savens", "--save-every", str(every), "--probe", "next-step"]))
    for name, extra in jobs:
        load_before = os.getloadavg()[0]
        wall = torchrun(
            "ckptflow.trainer.train", common + extra, os.path.join(workdir, f"e2e-{name}.log"), timeout=3600
        )
        rid = extra[1]
        with open(os.path.join(workdir, "e2e", rid, "metrics.jsonl"), encoding="utf-8") as f:
            t = {r["step"]: r["t"] for r in map(json.loads, f)}
        runs[name] = {
            "t": t,
            "wall_s": wall,
            "load_avg": [load_before, os.getloadavg()[0]],
            "summary": job_summary(os.path.join(workdir, f"e2e-{name}.log")),
        }
    return {"steps": steps, "every": every, "warmup": w0, "max_steps": max_steps, "model": a.e2e_model, "runs": runs}


def job_summary(log_path: str) -> dict[str, Any]:
    """The reference job's ``ckptflow-summary`` line (rank 0) from its log."""
    with open(log_path, encoding="utf-8", errors="replace") as f:
        lines = [x for x in f if x.startswith("ckptflow-summary ")]
    if not lines:
        raise RuntimeError(f"{log_path}: no ckptflow-summary line")
    return json.loads(lines[-1].split(" ", 1)[1])


def background_cpu(e: dict[str, Any], run: str) -> dict[str, float] | None:
    """CPU seconds per save of the threads rank 0 started after its loop began (staging, DCP's
    planning and writer, the commit: ``trainer/reference/threadcpu.py``), over ``run``'s saves; the
    no-save run's figure is the control (~0). On a host whose cores the ranks fill (2 ranks, 2 cores
    here) every such second is taken from training, so ``per_save_s / interval`` is what a save
    costs end to end there; with idle cores (a GPU node) it costs nothing."""
    base, r = e["runs"]["no_save"].get("summary"), e["runs"][run].get("summary")
    if not base or not r or "cpu_new_threads_s" not in r or not r.get("saves"):
        return None
    return {
        "per_save_s": r["cpu_new_threads_s"] / r["saves"],
        "saves": r["saves"],
        "control_s": base["cpu_new_threads_s"],
        "off_main_thread_delta_s": r["cpu_off_main_thread_s"] - base["cpu_off_main_thread_s"],
    }


# -- turning per-rank numbers into figures -------------------------------------------------------
def med(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return float(statistics.median(xs)) if xs else float("nan")


def summarize_worker(w: dict[str, Any]) -> dict[str, Any]:
    ranks = w["ranks"]
    r0 = ranks[0]
    s: dict[str, Any] = {
        "model": r0["model"],
        "global_batch": r0["global_batch"],
        "ranks": len(ranks),
        "torch_threads_per_rank": r0["torch_threads"],
    }
    rank_bytes = [r["memcpy"]["state_bytes"] for r in ranks]
    s["state_bytes_rank_max"] = max(rank_bytes)
    s["state_bytes_total"] = r0["total_state_bytes"]
    # Both ranks copy at once; the slower one is what the training loop waits for.
    s["memcpy_floor_s"] = max(med(r["memcpy"]["memcpy_s"]) for r in ranks)
    s["fresh_alloc_copy_s"] = max(med(r["memcpy"]["clone_s"]) for r in ranks)
    s["memcpy_GBps_per_rank"] = s["state_bytes_rank_max"] / s["memcpy_floor_s"] / 1e9
    s["probe_forward_s"] = max(med(r["save_parts"]["probe_s"]) for r in ranks)
    s["probe_samples"] = r0["save_parts"]["probe_samples"]
    s["probe_forward_1_sample_s"] = max(med(r["save_parts"]["probe_1_sample_s"]) for r in ranks)
    s["build_save_state_s"] = max(med(r["save_parts"]["build_state_s"]) for r in ranks)
    s["step_s_warm"] = max(med(r["warmup_step_s"][1:]) for r in ranks)

    modes: dict[str, Any] = {}
    for mode in MODES:
        if mode not in r0["modes"]:
            continue
        per = [r["modes"][mode] for r in ranks]
        n = len(per[0]["saves"])

        def per_save(f) -> list[float]:  # noqa: ANN001 - slowest rank, save by save
            return [max(f(p["saves"][i]) for p in per) for i in range(n)]

        stall = per_save(lambda x: x["blocked_s"] + x["staging_wait_s"])
        call = per_save(lambda x: x["save_call_s"] + x["staging_wait_s"])
        # sync: dcp.save (plan + write) runs inside save(), so that is its persist time.
        persist = per_save(lambda x: x["persisted_s"] - (0.0 if mode == "sync" else x["staged_s"]))
        total_bytes = sum(p["rank_file_bytes"] for p in per)
        excess = [statistics.mean(v) for v in zip(*(contention(r, mode) for r in ranks), strict=False)]
        m = {
            "saves_in_median": n - 1,
            "blocked_s": med(per_save(lambda x: x["blocked_s"])[1:]),
            "staging_wait_s": med(per_save(lambda x: x["staging_wait_s"])[1:]),
            "stall_s": med(stall[1:]),
            "stall_first_s": stall[0],
            "save_call_s": med(call[1:]),
            "stall_x_memcpy": med(stall[1:]) / s["memcpy_floor_s"],
            "staged_s": med(per_save(lambda x: x["staged_s"])[1:]),
            "persist_s": med(persist[1:]),
            "commit_s": med(per_save(lambda x: x["committed_s"] - x["persisted_s"])[1:]),
            "committed_s": med(per_save(lambda x: x["committed_s"])[1:]),
            "prev_wait_s": med(per_save(lambda x: x["prev_wait_s"])[1:]),
            "persist_MBps": total_bytes / med(persist[1:]) / 1e6,
            "step_excess_s": med(excess[1:]),
            "files_on_disk": per[0]["files_on_disk"],
            "manifest_files": per[0]["manifest_files"],
            "manifest_complete": set(per[0]["files_on_disk"]) - {"manifest.json"} <= set(per[0]["manifest_files"]),
            "rank_file_bytes": [p["rank_file_bytes"] for p in per],
        }
        modes[mode] = m
    s["modes"] = modes

    ts = [r["torch_save"] for r in ranks]
    s["torch_save"] = {
        "gather_s": max(t["gather_s"] for t in ts),
        "write_s": max(t["write_s"] for t in ts),
        "stall_s": max(t["total_s"] for t in ts),
        "file_bytes": max(t["file_bytes"] for t in ts),
    }
    s["torch_save"]["stall_x_memcpy"] = s["torch_save"]["stall_s"] / s["memcpy_floor_s"]

    idle = [r["idle"] for r in ranks]
    reps = len(idle[0]["saves"])
    file_bytes = sum(i["rank_file_bytes"] for i in idle)
    idle_persist = [max(i["saves"][k]["persisted_s"] - i["saves"][k]["staged_s"] for i in idle) for k in range(reps)]
    dd_conc = [max(i["dd_concurrent_s"][k] for i in idle) for k in range(reps)]
    dd_bytes = sum(i["dd_rank_bytes"] for i in idle)
    s["persist"] = {
        "bytes": file_bytes,
        "idle_persist_s": med(idle_persist),
        "idle_persist_MBps": file_bytes / med(idle_persist) / 1e6,
        "dd_concurrent_MBps": dd_bytes / med(dd_conc) / 1e6,
        "dd_single_MBps": idle[0]["dd_total_bytes"] / med(idle[0]["dd_single_s"]) / 1e6,
        "tensor_write_MBps": dd_bytes / med([max(i["tensor_write_s"][k] for i in idle) for k in range(reps)]) / 1e6,
        "dd_concurrent_all_MBps": [dd_bytes / x / 1e6 for x in dd_conc],
        "idle_persist_all_MBps": [file_bytes / x / 1e6 for x in idle_persist],
    }
    p = s["persist"]
    p["idle_x_dd"] = p["idle_persist_MBps"] / p["dd_concurrent_MBps"]
    if "async_staging" in modes:
        p["background_MBps"] = modes["async_staging"]["persist_MBps"]
        p["background_x_dd"] = p["background_MBps"] / p["dd_concurrent_MBps"]

    ld = [r["load"] for r in ranks]
    lbytes = sum(x["rank_bytes"] for x in ld)
    vbytes = sum(x["verify_bytes"] for x in ld)

    def rate(key: str, nbytes: int) -> float:
        k = len(ld[0][key])
        return nbytes / med([max(x[key][j] for x in ld) for j in range(k)]) / 1e6

    k = len(ld[0]["verify_cold_s"])
    resume = med([max(x["verify_cold_s"][j] + x["load_warm_s"][j] for x in ld) for j in range(k)])
    s["load"] = {
        "bytes": lbytes,
        "raw_cold_MBps": rate("raw_cold_s", lbytes),
        "raw_warm_MBps": rate("raw_warm_s", lbytes),
        "load_cold_MBps": rate("load_cold_s", lbytes),
        "load_warm_MBps": rate("load_warm_s", lbytes),
        "verify_cold_MBps": rate("verify_cold_s", vbytes),
        "resume_cold_MBps": lbytes / resume / 1e6,
        "resident_before_cold_reads": sorted(
            {
                b
                for x in ld
                for key in ("resident_before_raw_cold", "resident_before_load_cold", "resident_before_verify_cold")
                for b in x[key]
            },
            key=lambda v: -1 if v is None else v,
        ),
    }
    L = s["load"]
    L["load_cold_x_raw_cold"] = L["load_cold_MBps"] / L["raw_cold_MBps"]
    L["load_warm_x_raw_warm"] = L["load_warm_MBps"] / L["raw_warm_MBps"]
    L["resume_x_raw_cold"] = L["resume_cold_MBps"] / L["raw_cold_MBps"]
    L["verify_x_raw_cold"] = L["verify_cold_MBps"] / L["raw_cold_MBps"]
    s["worker_s"] = max(r["worker_s"] for r in ranks)
    return s


def contention(rank: dict[str, Any], mode: str) -> list[float]:
    """Per save of ``mode``: extra step time while its background work ran, over clean steps.

    A step is "during" a save if it overlaps [save call, commit]; clean steps overlap
    no save of any mode. The staging wait inside the step after the save is already
    part of the stall and is taken out.
    """

    def window(x: dict[str, Any]) -> tuple[float, float]:
        # SaveTiming counts from inside submit(), after the probe and the state dict.
        return x["save_at"], x["save_at"] + (x["save_call_s"] - x["blocked_s"]) + x["committed_s"]

    steps = rank["steps"]
    every = [window(x) for m in rank["modes"].values() for x in m["saves"]]
    base = med([e - b for b, e in steps if not any(b < we and e > ws for ws, we in every)])
    out = []
    for x in rank["modes"][mode]["saves"]:
        ws, we = window(x)
        out.append(sum(e - b - base for b, e in steps if b < we and e > ws) - x["staging_wait_s"])
    return out


def summarize_e2e(e: dict[str, Any]) -> dict[str, Any]:
    w0, w1, every = e["warmup"], e["max_steps"], e["every"]
    out: dict[str, Any] = {k: e[k] for k in ("steps", "every", "warmup", "model")}
    durs: dict[str, dict[int, float]] = {}
    for name, r in e["runs"].items():
        t = {int(k): v for k, v in r["t"].items()}
        elapsed = t[w1] - t[w0]
        out[f"{name}_elapsed_s"] = elapsed
        out[f"{name}_steps_per_s"] = (w1 - w0) / elapsed
        out[f"{name}_load_avg"] = r["load_avg"]
        durs[name] = {s: t[s] - t[s - 1] for s in range(w0 + 1, w1 + 1)}
        out[f"{name}_median_step_s"] = med(list(durs[name].values()))
    out["overhead_cross_run"] = out["save_elapsed_s"] / out["no_save_elapsed_s"] - 1
    # Saves move a handful of steps, not the median: a different median step means the
    # machine (shared) was busier in one run than the other.
    out["comparable"] = abs(out["save_median_step_s"] / out["no_save_median_step_s"] - 1) <= COMPARABLE
    save_steps = [s for s in range(w0 + 1, w1 + 1) if s % every == 0 and s + AFTER_SAVE_STEPS <= w1]
    # The save after step s runs after step s's time stamp: its cost lands in s+1...
    hit = {j for s in save_steps for j in range(s + 1, s + 1 + AFTER_SAVE_STEPS)}

    def excess(name: str) -> list[float]:
        d = durs[name]
        base = med([v for s, v in d.items() if s not in hit])
        return [sum(d[j] - base for j in range(s + 1, s + 1 + AFTER_SAVE_STEPS)) for s in save_steps]

    ex, ctrl = excess("save"), excess("no_save")
    others = [("save_next_step", "next_step")]
    for run, key in others:
        if run in durs:
            other = excess(run)
            out[f"excess_per_save_{key}_s"] = other
            other_interval = every * med([v for s, v in durs[run].items() if s not in hit])
            out[f"overhead_within_run_{key}"] = med(other) / other_interval if other else float("nan")
    for run in e["runs"]:
        if run != "no_save" and (bg := background_cpu(e, run)) is not None:
            bg["share"] = bg["per_save_s"] / (every * med([v for s, v in durs[run].items() if s not in hit]))
            out[f"background_cpu_{run}"] = bg
    out["saves_in_window"] = len(save_steps)
    out["excess_per_save_s"] = ex
    out["control_excess_s"] = ctrl
    out["interval_s"] = interval = every * med([v for s, v in durs["save"].items() if s not in hit])
    # Median over saves: one burst of someone else's work should not decide it.
    out["overhead_within_run"] = med(ex) / interval if ex else float("nan")
    out["overhead_within_run_mean"] = statistics.mean(ex) / interval if ex else float("nan")
    out["overhead_control"] = med(ctrl) / interval if ctrl else float("nan")
    return out


def predicted_overhead(s: dict[str, Any], e: dict[str, Any], mode: str = "async_staging") -> dict[str, float]:
    """The e2e overhead the worker's parts add up to: save() call + staging wait + step excess."""
    m = s["modes"][mode]
    per_save = m["save_call_s"] + m["staging_wait_s"] + m["step_excess_s"]
    return {
        "per_save_s": per_save,
        "overhead": per_save / e["interval_s"],
        "manager_share": (m["save_call_s"] - m["blocked_s"]) / e["interval_s"],
    }


# -- output -----------------------------------------------------------------------------------
def fmt_s(x: float) -> str:
    if x != x:
        return "n/a"
    return f"{x * 1e3:.1f} ms" if abs(x) < 1 else f"{x:.2f} s"


def mark(ok: bool) -> str:
    return "meets" if ok else "MISSES"


def print_report(s: dict[str, Any], e: dict[str, Any] | None, meta: dict[str, Any]) -> None:
    p = print
    p(f"\nckptflow trainer benchmark — {meta['machine']}")
    p(
        f"model {s['model']}, {s['ranks']} ranks (gloo, FSDP2), global batch {s['global_batch']}, "
        f"{s['torch_threads_per_rank']} torch thread(s)/rank, disk {meta['workdir_dev']}"
    )
    p(
        f"state: {s['state_bytes_total'] / 1e6:.1f} MB total, {s['state_bytes_rank_max'] / 1e6:.1f} MB on the "
        f"largest rank; training step {fmt_s(s['step_s_warm'])}"
    )
    p(
        f"memcpy floor (into preallocated buffers, ranks at once): {fmt_s(s['memcpy_floor_s'])} "
        f"({s['memcpy_GBps_per_rank']:.2f} GB/s per rank); fresh-allocation copy {fmt_s(s['fresh_alloc_copy_s'])}"
    )
    p(
        f"manager work before the saver, per save: probe forward ({s['probe_samples']} samples) "
        f"{fmt_s(s['probe_forward_s'])} (on 1 sample: {fmt_s(s['probe_forward_1_sample_s'])}), "
        f"build_save_state {fmt_s(s['build_save_state_s'])}"
    )
    p("\nStall per save on the training thread (median over saves 2..N, slowest rank)")
    hdr = (
        "mode",
        "saver stall",
        "x memcpy",
        "of which staging wait",
        "save() call",
        "1st save",
        "step excess",
        "persist",
        "commit",
        "persist MB/s",
        "manifest",
    )
    rows = []
    for mode, m in s["modes"].items():
        rows.append(
            (
                mode,
                fmt_s(m["stall_s"]),
                f"{m['stall_x_memcpy']:.2f}x",
                fmt_s(m["staging_wait_s"]),
                fmt_s(m["save_call_s"]),
                fmt_s(m["stall_first_s"]),
                fmt_s(m["step_excess_s"]),
                fmt_s(m["persist_s"]),
                fmt_s(m["commit_s"]),
                f"{m['persist_MBps']:.0f}",
                "complete" if m["manifest_complete"] else "MISSING FILES",
            )
        )
    ts = s["torch_save"]
    rows.append(
        (
            "torch.save gathered",
            fmt_s(ts["stall_s"]),
            f"{ts['stall_x_memcpy']:.2f}x",
            "-",
            f"gather {fmt_s(ts['gather_s'])}",
            "-",
            "-",
            f"write {fmt_s(ts['write_s'])}",
            "-",
            "-",
            "-",
        )
    )
    widths = [max(len(str(r[i])) for r in [hdr, *rows]) for i in range(len(hdr))]
    for r in [hdr, *rows]:
        p("  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)))
    p(
        "  saver stall = blocked in save() + staging wait in the next optimizer.step; save() call adds the "
        "manager's probe forward and state dict; step excess = extra time of the steps that overlapped the "
        "background persist and commit"
    )
    ps, L = s["persist"], s["load"]
    a = s["modes"].get("async_staging")
    p("\nThroughput (aggregate over ranks)                   MB/s    ratio   target")
    if a is not None:
        p(
            f"  stall, async_staging vs memcpy floor           {'':>7}  {a['stall_x_memcpy']:6.3f}x  <= 1.0x "
            f"{mark(a['stall_x_memcpy'] <= TARGETS['stall_x_memcpy'])}"
        )
    p(f"  dd conv=fsync, one writer per rank             {ps['dd_concurrent_MBps']:7.0f}")
    p(f"  dd conv=fsync, one writer, all bytes           {ps['dd_single_MBps']:7.0f}")
    p(
        f"  same tensors written raw from Python + fsync   {ps['tensor_write_MBps']:7.0f}  "
        f"{ps['tensor_write_MBps'] / ps['dd_concurrent_MBps']:6.2f}x"
    )
    if "background_MBps" in ps:
        p(
            f"  persist in the background (training runs)      {ps['background_MBps']:7.0f}  "
            f"{ps['background_x_dd']:6.2f}x  >= 0.8x {mark(ps['background_x_dd'] >= TARGETS['persist_x_dd'])}"
        )
    p(
        f"  persist, nothing else running                  {ps['idle_persist_MBps']:7.0f}  {ps['idle_x_dd']:6.2f}x  "
        f">= 0.8x {mark(ps['idle_x_dd'] >= TARGETS['persist_x_dd'])}"
    )
    p(f"  raw read, cold / warm                          {L['raw_cold_MBps']:7.0f} / {L['raw_warm_MBps']:.0f}")
    p(
        f"  load_verified, cold (vs raw cold)              {L['load_cold_MBps']:7.0f}  "
        f"{L['load_cold_x_raw_cold']:6.2f}x  >= 0.8x {mark(L['load_cold_x_raw_cold'] >= TARGETS['load_x_raw'])}"
    )
    p(
        f"  load_verified, warm (vs raw warm)              {L['load_warm_MBps']:7.0f}  "
        f"{L['load_warm_x_raw_warm']:6.2f}x  >= 0.8x {mark(L['load_warm_x_raw_warm'] >= TARGETS['load_x_raw'])}"
    )
    p(f"  verify, cold (vs raw cold)                     {L['verify_cold_MBps']:7.0f}  {L['verify_x_raw_cold']:6.2f}x")
    p(f"  resume = verify cold + load warm (vs raw cold) {L['resume_cold_MBps']:7.0f}  {L['resume_x_raw_cold']:6.2f}x")
    p(
        f"  page cache before the cold reads: {L['resident_before_cold_reads']} bytes resident (fincore; "
        "a host-side cache below the VM is not visible)"
    )
    if e is not None:
        print_e2e(e)


def print_e2e(e: dict[str, Any]) -> None:
    p = print
    p(
        f"\nEnd to end: trainer.train --model {e['model']}, {e['steps']} steps after {e['warmup']} warm-up, "
        f"save every {e['every']} vs --no-save"
    )
    p(
        f"  steps/s: no save {e['no_save_steps_per_s']:.3f}, with saves {e['save_steps_per_s']:.3f} "
        f"({e['saves_in_window']} saves in the window)"
    )
    p(
        f"  median step: no save {fmt_s(e['no_save_median_step_s'])}, with saves "
        f"{fmt_s(e['save_median_step_s'])} (differ => the machine changed between the runs); load average "
        f"{e['no_save_load_avg'][0]:.1f}->{e['no_save_load_avg'][1]:.1f} and "
        f"{e['save_load_avg'][0]:.1f}->{e['save_load_avg'][1]:.1f}"
    )
    verdict = (
        "NOT COMPARABLE: the median steps differ"
        if not e["comparable"]
        else mark(e["overhead_cross_run"] <= TARGETS["e2e_overhead"])
    )
    p(
        f"  overhead, cross-run:      {e['overhead_cross_run'] * 100:+6.2f} %  (target <= 0.5 %: {verdict}; "
        "includes the run-to-run noise)"
    )
    p(
        f"  overhead, within the run: {e['overhead_within_run'] * 100:+6.2f} %  of a {e['every']}-step interval "
        f"({fmt_s(e['interval_s'])}; target: {mark(e['overhead_within_run'] <= TARGETS['e2e_overhead'])}); "
        f"excess per save {', '.join(fmt_s(x) for x in e['excess_per_save_s'])}"
    )
    p(f"  noise control:            {e['overhead_control'] * 100:+6.2f} %  (same steps of the no-save run)")
    for key, what in [("next_step", "next-step loss as reference")]:
        if f"overhead_within_run_{key}" in e:
            p(
                f"  {what} instead: {e[f'overhead_within_run_{key}'] * 100:+6.2f} % within the run; excess "
                f"per save {', '.join(fmt_s(x) for x in e[f'excess_per_save_{key}_s'])}"
            )
    for key in sorted(k for k in e if k.startswith("background_cpu_")):
        bg = e[key]
        p(
            f"  CPU of rank 0's save threads, {key[len('background_cpu_') :]}: {fmt_s(bg['per_save_s'])} per save "
            f"({bg['saves']} saves; no-save control {fmt_s(bg['control_s'])} in all) = {bg['share'] * 100:.2f} % "
            "of a rank's interval (what a save costs where the ranks fill every core)"
        )
    if "predicted" in e:
        pr = e["predicted"]
        p(
            f"  from the worker's parts:  {pr['overhead'] * 100:+6.2f} %  (async_staging: save() call + staging "
            f"wait + step excess = {fmt_s(pr['per_save_s'])} per save; of it the probe forward and "
            f"state dict {pr['manager_share'] * 100:.2f} %)"
        )


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    workdir = a.workdir or tempfile.mkdtemp(prefix="ckptflow-bench-trainer-")
    os.makedirs(workdir, exist_ok=True)
    meta = {
        "machine": f"{os.cpu_count()} CPUs, {platform.python_implementation()} {platform.python_version()}",
        "workdir": workdir,
        "argv": sys.argv[1:],
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load_avg_start": os.getloadavg(),
    }
    try:
        df = subprocess.run(["df", "--output=source", workdir], capture_output=True, text=True).stdout.split()
        meta["workdir_dev"] = df[-1] if df else "?"
    except OSError:
        meta["workdir_dev"] = "?"
    try:
        import torch

        meta["torch"] = torch.__version__
    except ImportError:
        pass
    t0 = time.perf_counter()
    try:
        worker = summary = e2e_raw = e2e = None
        if not a.e2e_only:
            print(f"worker: model {a.model}, 2 ranks ... (log {workdir}/worker.log)", file=sys.stderr, flush=True)
            worker = run_worker(a, workdir)
            summary = summarize_worker(worker)
        if not a.skip_e2e:
            print("end to end: two trainer.train jobs ...", file=sys.stderr, flush=True)
            e2e_raw = run_e2e(a, workdir)
            e2e = summarize_e2e(e2e_raw)
            if summary is not None and "async_staging" in summary["modes"]:
                e2e["predicted"] = predicted_overhead(summary, e2e)
        meta["load_avg_end"] = os.getloadavg()
        meta["total_s"] = time.perf_counter() - t0
        if summary is not None:
            print_report(summary, e2e, meta)
        elif e2e is not None:
            print_e2e(e2e)
        print(
            f"\n(total {meta['total_s']:.0f} s; load average {meta['load_avg_start'][0]:.2f} at start, "
            f"{meta['load_avg_end'][0]:.2f} at end)"
        )
        if a.out:
            with open(a.out, "w", encoding="utf-8") as f:
                json.dump(
                    {"meta": meta, "summary": summary, "e2e": e2e, "raw": {"worker": worker, "e2e": e2e_raw}},
                    f,
                    indent=1,
                    default=str,
                )
            print(f"results: {a.out}")
    finally:
        if not a.keep and not a.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
