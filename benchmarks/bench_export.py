"""The safetensors export against a plain read of the same bytes, and its peak memory, in one run.

    python -m benchmarks.bench_export [--mb 1024] [--tensors 32] [--shard-mb 128] [--ranks 2]
        [--rounds 3] [--root DIR] [--json PATH]

The checkpoint: ``--mb`` MB of float32 model tensors (``--tensors`` of them, equal sizes) saved by
``dcp.save`` from ``--ranks`` processes, each tensor split in row chunks across the ranks as FSDP
shards it, and adopted (``tasks.adopt``: a manifest with every file's digest), so the export
must assemble every tensor from every rank's files. Arms, each in a fresh process:

``read``    every data file read start to end into one reused buffer (what ``cat`` costs);
``copy``    the same bytes read and written to new files, fsynced (what ``dd`` costs: the floor
            of any export that writes the model once);
``export``  ``export_dir`` as saved (fp32), shards of ``--shard-mb``: verified read, assembly,
            write, fsync and the read-back check;
``bf16``    the same with the cast to bf16 (half the bytes written).

A round runs the three in an order rotated by one per round; the page cache is warm for all
(the checkpoint is read once before the first round): the figure is the export's own work, not
the disk's. Measured: MB/s of checkpoint bytes read, the ratio export / read, and the export
process's peak anonymous memory (``RssAnon``, sampled every 2 ms) above its level before the
export (after its imports), against the shard size and the model size. (RSS would also count
the checkpoint files the reader maps: page cache, which the kernel drops under pressure.)

Target: peak memory bounded by the shard size (<= 3x a shard, whatever the model's size:
a shard loaded, its cast, and the read-back of one tensor); throughput is reported, not targeted.
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
ARMS = ("read", "copy", "export", "bf16")

WRITER = """
import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from ckptflow.trainer.distenv import exit_process
from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor
dist.init_process_group("gloo")
mb, n = float(sys.argv[2]), int(sys.argv[3])
rows = max(2, int(mb * 1e6 / 4 / n / 1024))
g = torch.Generator().manual_seed(0)
mesh = DeviceMesh("cpu", list(range(dist.get_world_size())))
state = {}
for i in range(n):
    full = torch.randn(rows, 1024, generator=g)
    state[f"layers.{i}.weight"] = distribute_tensor(full, mesh, [Shard(0)])
dcp.save({"model": state}, checkpoint_id=sys.argv[1])
dist.barrier()
dist.destroy_process_group()
exit_process(0)  # no interpreter finalization racing gloo's threads (a SIGABRT seen here)
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--mb", type=float, default=1024.0, help="model tensors, MB (1e6 bytes)")
    p.add_argument("--tensors", type=int, default=32)
    p.add_argument("--shard-mb", type=float, default=128.0, help="largest export shard, MiB")
    p.add_argument("--ranks", type=int, default=2, help="processes that save the checkpoint")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--root", help="work folder (default: a temp dir, removed after)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # one arm, in a child
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _anon_kb() -> int:
    """Anonymous resident memory (heap, tensors): not the checkpoint files the reader maps, whose
    pages are the page cache's and are counted in RSS although the kernel can drop them."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    return 0


class _Peak:
    """The highest ``_anon_kb`` seen, sampled every 2 ms in a thread."""

    def __init__(self) -> None:
        import threading

        self.peak = _anon_kb()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _anon_kb())

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return max(self.peak, _anon_kb())


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One arm, in this (fresh) process, its imports done first (as in a worker's fork server)."""
    import safetensors.torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    import ckptflow.trainer.dcp.planner  # noqa: F401
    import ckptflow.trainer.dcp.reader  # noqa: F401
    from ckptflow.tasks.export import export_dir

    data = [os.path.join(args.ckpt, n) for n in sorted(os.listdir(args.ckpt)) if n.endswith(".distcp")]
    nbytes = sum(os.path.getsize(p) for p in data)
    before = _anon_kb()
    peak = _Peak()
    t0 = time.perf_counter()
    if args.arm in ("read", "copy"):
        buf = bytearray(16 << 20)
        view = memoryview(buf)
        if args.arm == "copy":
            os.makedirs(args.out)
        for p in data:
            dst = open(os.path.join(args.out, os.path.basename(p)), "wb") if args.arm == "copy" else None
            with open(p, "rb", buffering=0) as f:
                while n := f.readinto(view):
                    if dst is not None:
                        dst.write(view[:n])
            if dst is not None:
                dst.flush()
                os.fsync(dst.fileno())
                dst.close()
        out: dict[str, Any] = {}
    else:
        dtype = "bf16" if args.arm == "bf16" else "as_saved"
        res = export_dir(args.ckpt, args.out, dtype=dtype, shard_mb=args.shard_mb)
        out = {"shards": len(res.shards), "bytes_written": res.bytes, "stages": res.seconds}
    wall = time.perf_counter() - t0
    top = peak.stop()
    return {"arm": args.arm, "seconds": wall, "bytes": nbytes, "peak_extra_mb": (top - before) / 1024, **out}


def _run_child(args: argparse.Namespace, arm: str, ckpt: str, out: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.bench_export", "--arm", arm, "--ckpt", ckpt, "--out", out]
    cmd += ["--shard-mb", str(args.shard_mb)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"arm {arm} failed:\n{r.stderr[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.arm:
        print(json.dumps(child(args)))
        return 0
    from ckptflow.tasks.adopt import adopt

    root = args.root or tempfile.mkdtemp(prefix="bench-export-")
    os.makedirs(root, exist_ok=True)
    try:
        src = os.path.join(root, "job", "step-10")
        script = os.path.join(root, "writer.py")
        with open(script, "w") as f:
            f.write(WRITER)
        env = dict(os.environ, OMP_NUM_THREADS="1", PREFECT_API_URL="")
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}"]
            + [script, src, str(args.mb), str(args.tensors)],
            cwd=REPO,
            env=env,
            check=True,
            capture_output=True,
        )
        rec = adopt(src, run_id="bench", root=os.path.join(root, "hot"))
        ckpt = rec["uri"]
        _run_child(args, "read", ckpt, os.path.join(root, "warmup"))  # the page cache, warm for every arm
        rows: dict[str, list[dict[str, Any]]] = {a: [] for a in ARMS}
        for r in range(args.rounds):
            order = ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]
            for arm in order:
                rows[arm].append(_run_child(args, arm, ckpt, os.path.join(root, f"out-{arm}")))
        nbytes = rows["read"][0]["bytes"]
        med = {a: statistics.median(x["seconds"] for x in rows[a]) for a in ARMS}
        mbps = {a: nbytes / med[a] / 1e6 for a in ARMS}
        peak = {a: max(x["peak_extra_mb"] for x in rows[a]) for a in ARMS}
        shard_mib = args.shard_mb
        result = {
            "machine": f"{platform.node()} {os.cpu_count()} cores",
            "date": time.strftime("%Y-%m-%d"),
            "model_mb": nbytes / 1e6,
            "tensors": args.tensors,
            "ranks": args.ranks,
            "shard_mib": shard_mib,
            "mb_per_s": mbps,
            "ratio_export_to_read": mbps["export"] / mbps["read"],
            "ratio_export_to_copy": mbps["export"] / mbps["copy"],
            "ratio_bf16_to_read": mbps["bf16"] / mbps["read"],
            "peak_extra_mib": peak,
            "peak_over_shard": {a: peak[a] / shard_mib for a in ("export", "bf16")},
            "model_over_shard": nbytes / 2**20 / shard_mib,
            "stages_export": rows["export"][0].get("stages"),
        }
        print(
            f"checkpoint: {nbytes / 1e6:.0f} MB of fp32 model tensors ({args.tensors}), saved by {args.ranks} ranks; "
            f"export shards of {shard_mib:.0f} MiB (model = {result['model_over_shard']:.1f} shards); "
            f"{args.rounds} rounds, page cache warm"
        )
        for a in ARMS:
            print(
                f"  {a:6s}  {mbps[a]:8.0f} MB/s of checkpoint read   peak anonymous memory above start "
                f"{peak[a]:7.0f} MiB"
            )
        print(
            f"export / read: {result['ratio_export_to_read']:.2f}x (bf16: {result['ratio_bf16_to_read']:.2f}x); "
            f"export / copy: {result['ratio_export_to_copy']:.2f}x; "
            f"peak / shard: {result['peak_over_shard']['export']:.2f}x "
            f"(bf16 {result['peak_over_shard']['bf16']:.2f}x), "
            f"target <= 3x: {'met' if max(result['peak_over_shard'].values()) <= 3 else 'MISSED'}"
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
