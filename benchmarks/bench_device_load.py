"""Resume into GPU tensors: ckptflow's verified load against its floors, where there is a CUDA device.

    python -m benchmarks.bench_device_load [--mb 2048] [--reps 5]

A resume on a GPU node loads into tensors on the GPU. The checkpoint here is written by
``dcp.save`` itself (plain DCP, one process) with a manifest of its files' digests beside it
(``plain_checkpoint``), so this needs torch and xxhash only — it runs on an image with another
torch and without ckptflow's other dependencies. Alternating, warm page cache, each ``--reps``
times:

* **verified read**: every block read and its digest compared on the load's threads
  (``bench_load.parallel_read``): the target's reference, as for host loads;
* **host to device alone**: the same bytes from pinned memory to the GPU in one copy (the link's floor);
* **verified read, then to the device**: the two one after the other (nothing overlapped);
* **ckptflow load into CUDA**: ``FastReader`` (``ckptflow/fast/devicecopy.py``: each matched block
  staged in pinned memory, copied asynchronously on the copying thread's stream);
* **the same, pageable**: each piece ``dst.copy_`` from the mapped file, as before the staging;
* **ckptflow load into host memory**: the same load, CPU tensors;
* **DCP's own load into CUDA**: ``dcp.load`` with its ``FileSystemReader`` (no verification).

Every load into CUDA is compared bitwise with the saved tensors once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from typing import Any

import torch

from benchmarks.bench_load import parallel_read, quiesce, raw_read


def tensors(mb: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """About ``mb`` MB in a model's mix: large fp32 and bf16 matrices, vectors, a few tiny tensors."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    left, i = mb << 20, 0
    while left > 0:
        rows = (1024, 2048, 4096, 512)[i % 4]
        dtype = torch.float32 if i % 3 else torch.bfloat16
        cols = max(1, min(2048, left // (rows * dtype.itemsize)))
        out[f"layers.{i}.weight"] = torch.randn(rows, cols, generator=g).to(dtype)
        out[f"layers.{i}.bias"] = torch.randn(rows, generator=g).to(dtype)
        out[f"layers.{i}.step"] = torch.tensor(float(i))
        left -= rows * cols * dtype.itemsize + rows * dtype.itemsize
        i += 1
    return out


def plain_checkpoint(path: str, state: dict[str, torch.Tensor]) -> Any:
    """Save ``state`` with ``dcp.save`` (one process) into ``path`` and return a manifest of its files
    (whole and block digests, as ckptflow's commit records them; not written to disk)."""
    import torch.distributed.checkpoint as dcp

    from ckptflow.trainer.format.checksum import digest_file
    from ckptflow.trainer.format.manifest import FileEntry, Manifest

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=path, no_dist=True)
    files = {}
    for name in sorted(os.listdir(path)):
        d = digest_file(os.path.join(path, name))
        files[name] = FileEntry(d.size, d.hexdigest(), d.block, d.blocks())
    return Manifest(run_id="bench", step=0, world_size=1, files=files)


def load(path: str, manifest: Any, target: dict[str, torch.Tensor], threads: int | None = None) -> None:
    """ckptflow's verified load of ``path`` into ``target`` (one process); raises if it failed."""
    from ckptflow.fast.reader import FastReader
    from ckptflow.trainer.dcp.planner import SafeLoadPlanner
    from ckptflow.trainer.dcp.reader import THREADS
    from ckptflow.trainer.distenv import DistEnv
    from ckptflow.trainer.loader import load_local

    mine = [n for n in manifest.files if n.startswith("__0_")]
    reader = FastReader(path, manifest, prefetch=mine, threads=threads or THREADS)
    try:
        failed = load_local(target, reader, SafeLoadPlanner(), DistEnv(0, 1, 0, 1, 0, None))  # type: ignore[arg-type]
    finally:
        reader.close()
        reader.unmap()
    if failed is not None:
        raise RuntimeError(failed[0])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cuda")
    a = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="ckptflow-bench-device-")
    try:
        res = run(os.path.join(work, "ckpt"), a.mb, a.reps, torch.device(a.device))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(res)
    return 0


def run(path: str, mb: int, reps: int, device: torch.device) -> dict:
    import torch.distributed.checkpoint as dcp

    from ckptflow.fast import verifiedcopy
    from ckptflow.trainer.dcp.reader import THREADS

    state = tensors(mb)
    manifest = plain_checkpoint(path, state)
    files = [os.path.join(path, n) for n in sorted(os.listdir(path))]
    nbytes = sum(os.path.getsize(f) for f in files)
    on_device = {k: torch.zeros_like(v, device=device) for k, v in state.items()}
    on_host = {k: torch.zeros_like(v) for k, v in state.items()}
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    t: dict[str, list[float]] = {}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(key: str, fn: Any) -> None:
        quiesce()
        raw_read(files)  # warm
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        t.setdefault(key, []).append(time.perf_counter() - t0)

    def check(target: dict[str, torch.Tensor], what: str) -> None:
        bad = [k for k, v in state.items() if not torch.equal(target[k].cpu(), v)]
        if bad:
            raise SystemExit(f"{what}: {len(bad)} tensors differ from the saved ones, e.g. {bad[:3]}")
        for v in target.values():
            v.zero_()

    def pageable() -> None:
        real = verifiedcopy.staged
        verifiedcopy.staged = lambda _t: False  # type: ignore[assignment]  # each piece dst.copy_(mapped bytes)
        try:
            load(path, manifest, on_device)
        finally:
            verifiedcopy.staged = real  # type: ignore[assignment]

    runs = {
        "verified_read": lambda: parallel_read(files, manifest, threads=THREADS),
        "h2d": lambda: flat.copy_(pinned, non_blocking=True),
        "verified_then_h2d": lambda: (
            parallel_read(files, manifest, threads=THREADS, into=memoryview(pinned.numpy())),
            flat.copy_(pinned, non_blocking=True),
        ),
        "ours_device": lambda: load(path, manifest, on_device),
        "ours_device_pageable": pageable,
        "ours_host": lambda: load(path, manifest, on_host),
        "dcp_device": lambda: dcp.load(on_device, checkpoint_id=path, no_dist=True),
        # where the host has the cores (a GPU node): the same on twice the threads
        "verified_read_t8": lambda: parallel_read(files, manifest, threads=2 * THREADS),
        "ours_device_t8": lambda: load(path, manifest, on_device, threads=2 * THREADS),
        "ours_host_t8": lambda: load(path, manifest, on_host, threads=2 * THREADS),
    }
    for rep in range(reps + 1):  # the first round warms up (pinned buffers, streams, CUDA context)
        for key, fn in runs.items():
            timed(key, fn)
            if rep == 0 and key.startswith(("ours", "dcp")):
                check(on_host if key.startswith("ours_host") else on_device, key)
    med = {k: statistics.median(v[1:]) for k, v in t.items()}
    return {
        "bytes": nbytes,
        "files": len(files),
        "tensors": len(state),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "torch": torch.__version__,
        "cores": os.cpu_count(),
        "ms": {k: v * 1e3 for k, v in med.items()},
        "first_ms": {k: v[0] * 1e3 for k, v in t.items()},
        "GBps": {k: nbytes / v / 1e9 for k, v in med.items()},
    }


def report(res: dict) -> None:
    ms, r = res["ms"], res["GBps"]
    print(
        f"{res['bytes'] / 1e6:.0f} MB in {res['files']} files, {res['tensors']} tensors; {res['device']}, "
        f"torch {res['torch']}, {res['cores']} cores; median of the timed rounds, warm page cache"
    )
    rows = [
        ("verified read (the load's threads)", "verified_read"),
        ("host to device alone (pinned)", "h2d"),
        ("verified read, then to the device", "verified_then_h2d"),
        ("ckptflow load into the device", "ours_device"),
        ("  the same, pageable copies", "ours_device_pageable"),
        ("ckptflow load into host memory", "ours_host"),
        ("DCP's own load into the device", "dcp_device"),
    ]
    for label, key in rows:
        print(f"  {label:38s} {ms[key]:8.1f} ms {r[key]:6.2f} GB/s  {r[key] / r['verified_read']:.2f}x verified read")
    print("  on twice the threads:")
    for label, key in (
        ("verified read", "verified_read_t8"),
        ("ckptflow load into the device", "ours_device_t8"),
        ("ckptflow load into host memory", "ours_host_t8"),
    ):
        print(
            f"    {label:36s} {ms[key]:8.1f} ms {r[key]:6.2f} GB/s  {r[key] / r['verified_read_t8']:.2f}x "
            "verified read (as many threads)"
        )
    print(f"  staged against pageable: {ms['ours_device_pageable'] / ms['ours_device']:.2f}x faster")
    first = res["first_ms"]
    print(
        "  first round (fresh pinned buffers, as in a resumed process): "
        + ", ".join(f"{k} {first[k]:.1f} ms" for k in ("ours_device", "ours_device_pageable", "ours_host"))
    )


if __name__ == "__main__":
    raise SystemExit(main())
