"""Restore-path download throughput: ckptflow's fetch vs a plain parallel ranged GET.

    python -m benchmarks.bench_restore [--model small] [--repeats 3] [--out results.json]

Restore is what decides how long a cluster sits idle after a failure. This archives a
checkpoint of the reference model to an S3-compatible server started here (moto, over
HTTP on 127.0.0.1), then, alternating so both see the same machine state:

* **fetch**: ``tasks.transfer.fetch`` from the cold tier (codec "none": download only;
  every object's digest is checked, as always);
* **baseline**: the same objects downloaded with plain boto3 ``get_object`` calls on byte
  ranges of the tier's part size, in a thread pool of the tier's ``max_concurrency``,
  written to local files with ``os.pwrite`` — no checks at all.

It prints MB/s for each and the ratio (target >= 0.8x), and the same for a bytegroup
cold tier (download and decompress reported separately).
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
from concurrent.futures import ThreadPoolExecutor

from ckptflow.harness import LOCAL_AWS, MotoServer


def plain_ranged_get(
    endpoint: str, bucket: str, keys: list[tuple[str, int]], dst: str, *, part: int, workers: int
) -> float:
    import boto3
    from botocore.config import Config

    s3 = boto3.client("s3", endpoint_url=endpoint, config=Config(max_pool_connections=workers))
    os.makedirs(dst, exist_ok=True)
    jobs = []
    fds = {}
    for key, size in keys:
        path = os.path.join(dst, key.replace("/", "_"))
        fds[key] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for off in range(0, max(size, 1), part):
            jobs.append((key, off, min(size, off + part) - 1))

    def one(job):
        key, a, b = job
        body = s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={a}-{b}")["Body"]
        pos = a
        while chunk := body.read(1 << 20):
            os.pwrite(fds[key], chunk, pos)
            pos += len(chunk)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(one, jobs))
    for fd in fds.values():
        os.close(fd)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    os.environ.update(LOCAL_AWS)
    work = tempfile.mkdtemp(prefix="ckptflow-bench-restore-")
    moto = MotoServer()
    try:
        endpoint = moto.url
        import boto3

        from ckptflow.tasks.config import RetentionConfig, TierConfig
        from ckptflow.tasks.storage import Tier
        from ckptflow.tasks.transfer import archive, fetch

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        hot_root = os.path.join(work, "hot")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "ckptflow.trainer.train",
                "--parallel",
                "none",
                "--ckpt-root",
                hot_root,
                "--run-id",
                "b",
                "--model",
                a.model,
                "--max-steps",
                "4",
                "--save-every",
                "4",
            ],
            check=True,
            capture_output=True,
        )
        hot = Tier(TierConfig(name="hot", url=hot_root))
        results = {}
        for codec in ("none", "bytegroup"):
            cold_cfg = TierConfig(
                name="cold",
                url=f"s3://bench/{codec}",
                codec=codec,
                endpoint_url=endpoint,
                retention=RetentionConfig(keep_all=True),
            )
            cold = Tier(cold_cfg)
            archive(hot, cold, "b", 4)
            idx = cold.read_index("b", 4)
            keys = [(f"{codec}/b/step_000000004/{f.stored_name}", f.stored_size) for f in idx.files.values()]
            part = cold_cfg.multipart_chunksize_mb << 20
            fetch_dl, fetch_dec, base = [], [], []
            for i in range(a.repeats):
                d = os.path.join(work, f"f-{codec}-{i}")
                fr = fetch(cold, "b", 4, d, threads=cold_cfg.max_concurrency)
                fetch_dl.append(fr.download_seconds)
                fetch_dec.append(fr.decompress_seconds)
                shutil.rmtree(d)
                bd = os.path.join(work, f"p-{codec}-{i}")
                base.append(plain_ranged_get(endpoint, "bench", keys, bd, part=part, workers=cold_cfg.max_concurrency))
                shutil.rmtree(bd)
            stored = idx.total_stored_bytes
            r = {
                "codec": codec,
                "bytes_raw": idx.total_raw_bytes,
                "bytes_stored": stored,
                "fetch_download_MBps": stored / statistics.median(fetch_dl) / 1e6,
                "plain_ranged_get_MBps": stored / statistics.median(base) / 1e6,
                "decompress_MBps": idx.total_raw_bytes / statistics.median(fetch_dec) / 1e6
                if codec != "none"
                else None,
            }
            r["ratio"] = r["fetch_download_MBps"] / r["plain_ranged_get_MBps"]
            results[codec] = r
        print(
            f"{'cold codec':<11} {'stored MB':>9} {'fetch MB/s':>11} {'plain GET MB/s':>15} {'ratio':>6} "
            f"{'decompress MB/s':>16}"
        )
        for r in results.values():
            dec = f"{r['decompress_MBps']:.0f}" if r["decompress_MBps"] else "-"
            print(
                f"{r['codec']:<11} {r['bytes_stored'] / 1e6:>9.1f} {r['fetch_download_MBps']:>11.0f} "
                f"{r['plain_ranged_get_MBps']:>15.0f} {r['ratio']:>5.2f}x {dec:>16}"
            )
        if a.out:
            with open(a.out, "w") as f:
                json.dump(results, f, indent=1)
        return 0
    finally:
        moto.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
