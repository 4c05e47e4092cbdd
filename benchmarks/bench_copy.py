"""The load's data phase against its floors: hashing and copying a mapped file's 1 MiB blocks.

    python -m benchmarks.bench_copy [--mb 512] [--reps 7]

A file of ``--mb`` random bytes is written, mapped (its pages mapped in first, as the load's
streamer does) and, on 1, 2 and 4 threads, each 1 MiB block is: hashed only (the block digest,
xxh3-64); copied only into memory the size of the file (touched first, as a model's is); hashed
then copied, the load's own order. Each copy once with ``memmove`` (glibc, through ctypes) and
once with ``memcopy.copy`` (streaming stores, ``csrc/_memcopy.c``). For reference, a one-thread
``readinto`` of the file into an 8 MiB buffer plus the file's xxh3-128: bench_load's "verified
raw read". Medians, in one run, alternating.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

BLOCK = 1 << 20


def main(argv: list[str] | None = None) -> int:
    import torch
    import xxhash

    from ckptflow.fast import memcopy

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=512)
    p.add_argument("--reps", type=int, default=7)
    a = p.parse_args(argv)
    size = a.mb << 20
    fd_w, path = tempfile.mkstemp(prefix="ckptflow-bench-copy-")
    try:
        chunk = os.urandom(8 << 20)
        with os.fdopen(fd_w, "wb") as f:
            for _ in range(size // len(chunk)):
                f.write(chunk)
        fd = os.open(path, os.O_RDONLY)
        data = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        view = memoryview(data)
        src = torch.frombuffer(data, dtype=torch.uint8)
        src[::4096].sum()  # every page mapped in, as the load's streamer leaves them
        dst = torch.zeros(size, dtype=torch.uint8)  # touched: as a model's memory
        s0, d0 = src.data_ptr(), dst.data_ptr()
        blocks = range(0, size, BLOCK)

        def hash_(k: int) -> None:
            xxhash.xxh3_64_hexdigest(view[k : k + BLOCK])

        def memmove(k: int) -> None:
            ctypes.memmove(d0 + k, s0 + k, BLOCK)

        def stream(k: int) -> None:
            memcopy.copy(d0 + k, s0 + k, BLOCK)

        def hash_memmove(k: int) -> None:
            hash_(k)
            memmove(k)

        def hash_stream(k: int) -> None:
            hash_(k)
            stream(k)

        def on(n: int, fn: Callable[[int], None]) -> float:
            parts = [blocks[i::n] for i in range(n)]
            ts = [threading.Thread(target=lambda ks=ks: [fn(k) for k in ks]) for ks in parts]
            t0 = time.perf_counter()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            return time.perf_counter() - t0

        buf = memoryview(bytearray(8 << 20))

        def verified_read() -> float:
            t0 = time.perf_counter()
            h = xxhash.xxh3_128()
            with open(path, "rb", buffering=0) as f:
                while got := f.readinto(buf):
                    h.update(buf[:got])
            h.hexdigest()
            return time.perf_counter() - t0

        cases: list[tuple[str, Callable[[], float]]] = [("verified raw read, 1 thread", verified_read)]
        for n in (1, 2, 4):
            for name, fn in (
                ("hash", hash_),
                ("copy, memmove", memmove),
                ("copy, streaming", stream),
                ("hash + copy, memmove", hash_memmove),
                ("hash + copy, streaming", hash_stream),
            ):
                cases.append((f"{name}, {n} thread{'s' if n > 1 else ''}", lambda n=n, fn=fn: on(n, fn)))
        times: dict[str, list[float]] = {k: [] for k, _ in cases}
        for r in range(a.reps):
            for k, fn in cases if r % 2 == 0 else cases[::-1]:
                times[k].append(fn())
        print(f"{a.mb} MiB in 1 MiB blocks; memcopy.STREAMING={memcopy.STREAMING}; median of {a.reps}")
        ref = statistics.median(times[cases[0][0]])
        for k, ts in times.items():
            t = statistics.median(ts)
            print(f"  {k:36s} {t * 1e3:7.1f} ms  {size / t / 1e9:5.1f} GB/s  {ref / t:4.2f}x the verified read")
        view.release()
        del src
        data.close()
        os.close(fd)
    finally:
        os.unlink(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
