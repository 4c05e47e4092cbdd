"""Resume speed: ckptflow's verified load against a raw read of the same bytes, and DCP's own path.

    python -m benchmarks.bench_load [--model small] [--reps 3]

One process (world size 1) and the reference model. Two checkpoints are made first: one
saved at world size 1, one at world size 2 (FSDP, two ranks) to measure a resharding load.
Then, alternating so all see the same machine state, each ``--reps`` times:

* **raw read, cold**: ``readinto`` of every file of the checkpoint, its pages evicted first
  (``posix_fadvise(DONTNEED)`` after ``fsync``; ``fincore`` confirms none resident);
* **verified raw read, warm**: the same read plus the manifest's xxh3 of every byte (what
  anything that verifies every byte must at least do), pages resident; and, for context, the
  same again with each 8 MiB copied on into memory as large as the checkpoint (a load's bytes end
  in the model's memory, which a read into one buffer left in cache never writes); and both again
  on the load's threads with the load's checksum (each block against its manifest digest). Their
  ratio is the ceiling of any load against the verified read alone: a load does at least the read
  and the copy (printed as such);
* **ckptflow load, cold / warm**: ``load_verified`` — the one read that verifies every byte
  and fills the model, with the acceleration layer (``ckptflow/fast/reader.py``, the default);
* **core reader alone, cold / warm**: the same with ``CKPTFLOW_NO_ACCEL=1``: ``trainer/dcp/reader.py``
  verifies every block of a file, then copies (the A/B that keeps the acceleration layer);
* **DCP's own path, warm**: ``verify_checkpoint`` (read + hash) then ``dcp.load`` with its
  ``FileSystemReader`` (reads again, ``torch.load`` per item): what a resume cost before;
* **resharding load, warm**: the world-size-2 checkpoint into this one process;
* **first load, warm**: into a model and optimizer built just before (not timed), as a resume
  into a fresh process has them: the optimizer without state yet.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

from ckptflow.harness import child_env, reference_job


def drop_cache(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident(paths: list[str]) -> int | None:
    try:
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES", *paths],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return sum(int(x) for x in out.stdout.split()) if out.returncode == 0 else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def raw_read(paths: list[str], *, hashing: bool = False, into: memoryview | None = None) -> int:
    """Read every byte of ``paths`` (8 MiB at a time, one thread); ``hashing``: and take the
    manifest's xxh3 of each file; ``into``: and copy the bytes there, one after another (what a
    load must do on top: its bytes end in the model's memory, not in a buffer left in cache)."""
    from ckptflow.trainer.format.checksum import new_hasher

    buf = bytearray(8 << 20)
    view = memoryview(buf)
    n = 0
    for p in paths:
        h = new_hasher() if hashing else None
        with open(p, "rb", buffering=0) as f:
            while got := f.readinto(view):
                if h is not None:
                    h.update(view[:got])
                if into is not None:
                    into[n : n + got] = view[:got]
                n += got
    return n


def parallel_read(paths: list[str], manifest, *, threads: int, into: memoryview | None = None) -> int:  # noqa: ANN001
    """``raw_read`` with the load's checksum on the load's threads: each block the manifest records
    a digest for is read (``preadv`` into the thread's own buffer, which stays in cache) and its
    digest compared, ``threads`` at a time; ``into``: and copied on into memory
    (``memcopy.copy``, as the load copies: streaming stores where built). Nothing else of a load:
    no planning, no locating, no model."""
    import ctypes
    import threading

    import xxhash

    from ckptflow.fast import memcopy

    jobs: list[tuple[str, int, int, str | None, int]] = []  # path, start, length, digest, where in into
    n = 0
    for p in paths:
        e = manifest.files.get(os.path.basename(p))  # None: manifest.json itself, read and hashed whole
        size = os.path.getsize(p)
        bs = (e.block_size if e is not None else 0) or size
        digests = e.block_digests() if e is not None and e.block_size else [None] * (1 if size else 0)
        for k, d in enumerate(digests):
            a = k * bs
            jobs.append((p, a, min(bs, size - a), d, n + a))
        n += size
    fds = {p: os.open(p, os.O_RDONLY) for p in paths}
    base = ctypes.addressof(ctypes.c_char.from_buffer(into)) if into is not None else 0
    bad: list[str] = []

    def work(mine: list[tuple[str, int, int, str | None, int]]) -> None:
        buf = bytearray(max((j[2] for j in mine), default=0))
        view = memoryview(buf)
        src = ctypes.addressof(ctypes.c_char.from_buffer(buf)) if buf else 0
        for p, a, length, d, at in mine:
            got = os.preadv(fds[p], [view[:length]], a)
            h = xxhash.xxh3_64_hexdigest(view[:got])  # where the manifest has no block digest, hashed all the same
            if d is not None and h != d:
                bad.append(f"{p}@{a}")
            if into is not None:
                memcopy.copy(base + at, src, got)

    try:
        ts = [threading.Thread(target=work, args=(jobs[i::threads],)) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        for fd in fds.values():
            os.close(fd)
    if bad:
        raise RuntimeError(f"blocks that do not match the manifest: {bad[:3]}")
    return n


def quiesce() -> None:
    """Wait for what a load left running in the background (its unmapping thread: 8-15 ms of
    ``munmap`` per 167 MB), so it is not timed as part of whatever runs next."""
    import threading

    for t in threading.enumerate():
        if t.name in ("ckptflow-unmap", "ckptflow-stream"):
            t.join(timeout=10)


def make(root: str, model: str, nproc: int) -> str:
    extra = ["--parallel", "fsdp"] if nproc > 1 else []
    cmd = reference_job(root, "b", max_steps=2, save_every=2, nproc=nproc, model=model, extra=extra)
    subprocess.run(cmd, check=True, capture_output=True, env=child_env(), timeout=900)
    return os.path.join(root, "b", "step_000000002")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="ckptflow-bench-load-")
    try:
        one = make(os.path.join(work, "w1"), a.model, 1)
        two = make(os.path.join(work, "w2"), a.model, 2)
        res = run(one, two, a.model, a.reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(res)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def run(one: str, two: str, model: str, reps: int) -> dict:
    import torch.distributed.checkpoint as dcp

    from ckptflow.fast import memcopy
    from ckptflow.trainer.dcp.reader import THREADS
    from ckptflow.trainer.distenv import init_distributed
    from ckptflow.trainer.format.manifest import read_manifest
    from ckptflow.trainer.loader import load_target, load_verified
    from ckptflow.trainer.reference.build import TrainConfig, build
    from ckptflow.trainer.reference.model import ModelConfig
    from ckptflow.trainer.state import TrainState
    from ckptflow.trainer.verify import verify_checkpoint

    env = init_distributed()
    b = build(TrainConfig(model=ModelConfig.preset(model).to_dict(), parallel="none").to_dict(), parallel="none")
    files = [os.path.join(one, n) for n in sorted(os.listdir(one))]
    nbytes = sum(os.path.getsize(f) for f in files)
    import torch

    dest = memoryview(torch.zeros(nbytes, dtype=torch.uint8).numpy()).cast("B")  # touched: as a model's memory
    m1, m2 = read_manifest(one), read_manifest(two)
    t: dict[str, list[float]] = {}
    residents: list = []

    def timed(key: str, fn, *, cold: bool = False) -> None:  # noqa: ANN001
        quiesce()
        if cold:
            drop_cache(files)
            residents.append(resident(files))
        else:
            raw_read(files)  # warm
        t0 = time.perf_counter()
        fn()
        t.setdefault(key, []).append(time.perf_counter() - t0)

    def ours(path: str, m) -> None:  # noqa: ANN001
        load_verified(path, m, env=env, state=TrainState(b.model, b.optimizer, b.scheduler))

    def core(path: str, m) -> None:  # noqa: ANN001
        was = os.environ.get("CKPTFLOW_NO_ACCEL")
        os.environ["CKPTFLOW_NO_ACCEL"] = "1"  # read by open_reader at each load
        try:
            ours(path, m)
        finally:
            if was is None:
                os.environ.pop("CKPTFLOW_NO_ACCEL")
            else:
                os.environ["CKPTFLOW_NO_ACCEL"] = was

    def dcp_path() -> None:
        verify_checkpoint(one).raise_if_bad()
        target = load_target(m1, env=env, state=TrainState(b.model, b.optimizer, b.scheduler))
        target.pop("ranks", None)  # sized from the metadata only by our reader; the rest is what DCP reads
        dcp.load(target, checkpoint_id=one, process_group=env.ckpt_group)

    def fresh() -> None:
        nb = build(TrainConfig(model=ModelConfig.preset(model).to_dict(), parallel="none").to_dict(), parallel="none")
        quiesce()
        raw_read(files)  # warm
        t0 = time.perf_counter()
        load_verified(one, m1, env=env, state=TrainState(nb.model, nb.optimizer, nb.scheduler))
        t.setdefault("first_warm", []).append(time.perf_counter() - t0)

    for _ in range(reps):
        timed("raw_cold", lambda: raw_read(files), cold=True)
        timed("ours_cold", lambda: ours(one, m1), cold=True)
        timed("core_cold", lambda: core(one, m1), cold=True)
        timed("verified_raw_warm", lambda: raw_read(files, hashing=True))
        timed("verified_copy_warm", lambda: raw_read(files, hashing=True, into=dest))
        timed("parallel_raw_warm", lambda: parallel_read(files, m1, threads=THREADS))
        timed("parallel_copy_warm", lambda: parallel_read(files, m1, threads=THREADS, into=dest))
        timed("ours_warm", lambda: ours(one, m1))
        timed("core_warm", lambda: core(one, m1))
        timed("dcp_warm", dcp_path)
        timed("reshard_warm", lambda: ours(two, m2))
        fresh()
    med = {k: statistics.median(v) for k, v in t.items()}
    mbs = {k: nbytes / v / 1e6 for k, v in med.items()}
    return {
        "model": model,
        "bytes": nbytes,
        "files": len(files),
        "seconds": t,
        "MBps": mbs,
        "resident_before_cold": residents,
        "copy": "streaming stores" if memcopy.STREAMING else "memmove (csrc/_memcopy.c not built or off)",
    }


def report(res: dict) -> None:
    r = res["MBps"]
    print(f"model {res['model']}: {res['bytes'] / 1e6:.0f} MB in {res['files']} files, one process; MB/s (median)")
    print(f"  raw read, cold                 {r['raw_cold']:7.0f}")
    print(
        f"  ckptflow load, cold            {r['ours_cold']:7.0f}  {r['ours_cold'] / r['raw_cold']:.2f}x raw cold "
        "(target >= 0.8x)"
    )
    print(f"  verified raw read, warm        {r['verified_raw_warm']:7.0f}")
    if "verified_copy_warm" in r:
        print(
            f"    + a copy into memory, warm   {r['verified_copy_warm']:7.0f}  (the load at "
            f"{r['ours_warm'] / r['verified_copy_warm']:.2f}x this; for context, not the target)"
        )
    if "parallel_raw_warm" in r:
        print(
            f"    the same on the load's threads {r['parallel_raw_warm']:5.0f}  (block digests, the load's checksum; "
            f"the load at {r['ours_warm'] / r['parallel_raw_warm']:.2f}x this)"
        )
        print(
            f"    + a copy into memory, likewise {r['parallel_copy_warm']:5.0f}  (the load at "
            f"{r['ours_warm'] / r['parallel_copy_warm']:.2f}x this)"
        )
        # A load must end with the bytes in the model's memory, and verify them before they go there:
        # it does at least the verified read and a copy, so against the verified read alone it cannot
        # do better than this, whatever its code (on a host where both are CPU-bound).
        print(
            f"    so the ceiling of any load that copies, against the verified read on these threads: "
            f"{r['parallel_copy_warm'] / r['parallel_raw_warm']:.2f}x"
        )
    print(
        f"  ckptflow load, warm            {r['ours_warm']:7.0f}  {r['ours_warm'] / r['verified_raw_warm']:.2f}x "
        "verified raw warm (target >= 0.8x)"
    )
    print(f"  DCP's path (verify + dcp.load) {r['dcp_warm']:7.0f}  ckptflow is {r['ours_warm'] / r['dcp_warm']:.1f}x")
    for way in ("cold", "warm"):
        print(
            f"  core reader alone, {way}        {r['core_' + way]:7.0f}  the acceleration layer is "
            f"{r['ours_' + way] / r['core_' + way]:.2f}x it; {r['core_' + way] / r['dcp_warm']:.1f}x DCP's path"
        )
    print(f"  resharding load (2 -> 1), warm {r['reshard_warm']:7.0f}")
    print(
        f"  first load (fresh objects), warm {r['first_warm']:5.0f}  {r['first_warm'] / r['verified_raw_warm']:.2f}x "
        "verified raw warm"
    )
    print(f"  resident before the cold reads: {res['resident_before_cold']}")
    print(f"  the load's copies: {res.get('copy', '?')}")


if __name__ == "__main__":
    raise SystemExit(main())
