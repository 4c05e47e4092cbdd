"""Lifecycle throughput: promote vs a plain copy, archive vs a plain boto3 upload.

    python -m benchmarks.bench_storage [--repeat 3] [--ckpt-root DIR] [--json OUT]

On one checkpoint of the reference model (``--model small``: ~167 MB, made here by
the real trainer unless ``--ckpt-root`` names an existing run ``b``):

* **promote** (hot -> a fresh warm folder; codec "none", "zstd", "bytegroup") against
  ``shutil.copyfile`` of the same files, ``copyfile`` + fsync (what a durable copy
  costs), and ``dd bs=8M conv=fsync``. Promote includes its after-copy digest check,
  tier.json, manifest copy and the rename commit.
* **archive** (hot -> a fresh S3 prefix; "none", "zstd", "bytegroup") against boto3
  ``upload_file`` of the same files, each in its own thread, with the *same*
  ``TransferConfig`` (part size, concurrency) to the same endpoint: a moto S3 server
  started here, in its own process, over HTTP; and, for the compressing archive, against
  plain zstd of each file to a spool file followed by the same uploads. Archive includes its HEADs (skip
  check before, presence check after), tier.json, manifest and the marker.

Every variant runs ``--repeat`` times, interleaved (baseline, ckptflow, baseline, ...)
so background load hits both alike; the median is reported, and every ratio compares
numbers from this one run. Files are read from the page cache (the checkpoint was just
written), as they are when the lifecycle flow runs right after a save.
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
import threading
import time
import uuid

from ckptflow.harness import MotoServer
from ckptflow.tasks.config import TierConfig
from ckptflow.tasks.storage import Tier
from ckptflow.tasks.transfer import archive, promote

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = "b"
STEP = 4
CODECS = ("none", "zstd", "bytegroup")  # bytegroup: the default of the example warm/cold tiers


def make_checkpoint(root: str, model: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "ckptflow.trainer.train",
        "--ckpt-root",
        root,
        "--run-id",
        RUN,
        "--max-steps",
        str(STEP),
        "--save-every",
        str(STEP),
        "--model",
        model,
        "--parallel",
        "none",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    env.pop("PREFECT_API_URL", None)
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)


def files_of(hot: Tier) -> list[str]:
    d = hot.url_for(RUN, STEP)
    return [os.path.join(d, n) for n in sorted(hot.read_manifest(RUN, STEP).files)]


# ---- promote baselines --------------------------------------------------------------


def plain_copy(files: list[str], dst: str, *, fsync: bool) -> None:
    os.makedirs(dst)
    for f in files:
        out = os.path.join(dst, os.path.basename(f))
        shutil.copyfile(f, out)
        if fsync:
            fd = os.open(out, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    if fsync:
        fd = os.open(dst, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def plain_zstd(files: list[str], dst: str) -> None:
    """zstd of the same files with the codec's defaults (level 3, one thread per core) + fsync:
    what compressing costs without ckptflow (the baseline for the compressing promote)."""
    import zstandard

    os.makedirs(dst)
    threads = os.cpu_count() or 1
    for f in files:
        out = os.path.join(dst, os.path.basename(f) + ".zst")
        cctx = zstandard.ZstdCompressor(level=3, threads=threads if threads > 1 else 0, write_checksum=True)
        with open(f, "rb") as fi, open(out, "wb") as fo:
            cctx.copy_stream(fi, fo, read_size=1 << 20, write_size=1 << 20)
            fo.flush()
            os.fsync(fo.fileno())


def dd_copy(files: list[str], dst: str) -> None:
    os.makedirs(dst)
    for f in files:
        subprocess.run(
            ["dd", f"if={f}", f"of={os.path.join(dst, os.path.basename(f))}", "bs=8M", "conv=fsync", "status=none"],
            check=True,
        )


# ---- archive baseline ---------------------------------------------------------------


def plain_upload(client, transfer_config, files: list[str], bucket: str, prefix: str) -> None:
    errors: list[BaseException] = []

    def one(f: str) -> None:
        try:
            client.upload_file(f, bucket, f"{prefix}/{os.path.basename(f)}", Config=transfer_config)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(f,)) for f in files]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def zstd_then_upload(client, transfer_config, files: list[str], bucket: str, prefix: str, tmp: str) -> None:
    """The same work as a compressing archive, without ckptflow: zstd each file to a local
    spool file (codec defaults), then upload the spools in parallel threads."""
    spool = os.path.join(tmp, prefix)
    plain_zstd(files, spool)
    plain_upload(client, transfer_config, [os.path.join(spool, n) for n in sorted(os.listdir(spool))], bucket, prefix)
    shutil.rmtree(spool)


def empty_bucket(client, bucket: str) -> None:
    """moto keeps objects in memory: drop each repeat's copies."""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys})


def start_moto() -> tuple[MotoServer, str]:
    srv = MotoServer()
    return srv, srv.url


# ---- driver -------------------------------------------------------------------------


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--ckpt-root", help="existing trainer root holding run 'b' step 4")
    ap.add_argument("--model", default="small", help="reference model preset to train (tiny, small, medium)")
    ap.add_argument("--json", help="write the raw timings here")
    args = ap.parse_args(argv)

    work = tempfile.mkdtemp(prefix="ckptflow-bench-storage-")
    root = args.ckpt_root or os.path.join(work, "hot")
    if not args.ckpt_root:
        print(f"training the reference model ({args.model}, 4 steps) for a checkpoint ...", flush=True)
        make_checkpoint(root, args.model)
    hot = Tier(TierConfig(name="hot", url=root))
    files = files_of(hot)
    nbytes = sum(os.path.getsize(f) for f in files)
    print(f"checkpoint: {len(files)} files, {nbytes / 1e6:.1f} MB raw ({hot.url_for(RUN, STEP)})")
    times: dict[str, list[float]] = {}
    stored: dict[str, int] = {}

    def add(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    # promote ---------------------------------------------------------------------
    have_dd = shutil.which("dd") is not None
    for i in range(args.repeat):
        d = os.path.join(work, f"p{i}")
        add("copyfile", timed(lambda: plain_copy(files, d + "-copy", fsync=False)))
        add("copyfile+fsync", timed(lambda: plain_copy(files, d + "-copyfs", fsync=True)))
        if have_dd:
            add("dd conv=fsync", timed(lambda: dd_copy(files, d + "-dd")))
        add("zstd -3 stream+fsync", timed(lambda: plain_zstd(files, d + "-zstd")))
        for codec in CODECS:
            warm = Tier(TierConfig(name="warm", url=f"{d}-warm-{codec}", codec=codec))
            r = promote(hot, warm, RUN, STEP)
            add(f"promote {codec}", r.seconds)
            stored[f"promote {codec}"] = r.bytes_stored
        for name in os.listdir(work):
            if name.startswith(f"p{i}-"):
                shutil.rmtree(os.path.join(work, name))

    # archive ---------------------------------------------------------------------
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench-key-id")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench-secret")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    proc, endpoint = start_moto()
    try:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        probe = Tier(TierConfig(name="cold", url=f"s3://{bucket}/x", endpoint_url=endpoint))
        client, tconf = probe.s3.client, probe.s3.transfer_config()
        client.create_bucket(Bucket=bucket)
        # warm up both sides alike: connections, moto's first calls, s3fs's session
        plain_upload(client, tconf, files, bucket, "warmup")
        archive(hot, Tier(TierConfig(name="cold", url=f"s3://{bucket}/warmup", endpoint_url=endpoint)), RUN, STEP)
        empty_bucket(client, bucket)
        for i in range(args.repeat):
            add("boto3 upload_file", timed(lambda: plain_upload(client, tconf, files, bucket, f"plain{i}")))
            empty_bucket(client, bucket)
            add(
                "zstd -3 then upload_file",
                timed(lambda: zstd_then_upload(client, tconf, files, bucket, f"zplain{i}", work)),
            )
            empty_bucket(client, bucket)
            for codec in CODECS:
                cold = Tier(
                    TierConfig(name="cold", url=f"s3://{bucket}/a{i}{codec}", codec=codec, endpoint_url=endpoint)
                )
                r = archive(hot, cold, RUN, STEP)
                add(f"archive {codec}", r.seconds)
                stored[f"archive {codec}"] = r.bytes_stored
                if codec == "none":
                    again = archive(hot, cold, RUN, STEP)
                    assert again.files == 0
                    add("archive re-run (no-op)", again.seconds)
                empty_bucket(client, bucket)
        chunk_mb, conc = probe.config.multipart_chunksize_mb, probe.config.max_concurrency
    finally:
        proc.stop()
        shutil.rmtree(work, ignore_errors=True)

    # report ----------------------------------------------------------------------
    med = {k: statistics.median(v) for k, v in times.items()}
    mbs = {k: nbytes / v / 1e6 for k, v in med.items()}
    print(
        f"\nmedian of {args.repeat}; MB/s = raw MB (10^6 B) per second; S3 parts {chunk_mb} MiB x {conc} concurrent\n"
    )
    print(f"{'variant':26s} {'seconds':>8s} {'MB/s':>8s} {'stored MB':>10s}")
    for k in times:
        st = f"{stored[k] / 1e6:10.1f}" if k in stored else f"{'':10s}"
        print(f"{k:26s} {med[k]:8.3f} {mbs[k]:8.1f} {st}")
    ratios = [
        ("promote none / copyfile+fsync", "promote none", "copyfile+fsync"),
        ("promote none / copyfile (no fsync)", "promote none", "copyfile"),
        ("promote none / dd conv=fsync", "promote none", "dd conv=fsync"),
        ("promote zstd / copyfile+fsync", "promote zstd", "copyfile+fsync"),
        ("promote zstd / zstd -3 stream+fsync", "promote zstd", "zstd -3 stream+fsync"),
        ("promote bytegroup / copyfile+fsync", "promote bytegroup", "copyfile+fsync"),
        ("archive none / boto3 upload_file", "archive none", "boto3 upload_file"),
        ("archive zstd / boto3 upload_file", "archive zstd", "boto3 upload_file"),
        ("archive zstd / zstd -3 then upload_file", "archive zstd", "zstd -3 then upload_file"),
        ("archive bytegroup / boto3 upload_file", "archive bytegroup", "boto3 upload_file"),
    ]
    print()
    for label, a, b in ratios:
        if a in mbs and b in mbs:
            print(f"{label:41s} {mbs[a] / mbs[b]:5.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": nbytes, "files": len(files), "seconds": times, "stored": stored}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
