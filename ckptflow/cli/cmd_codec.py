"""``ckptflow compress`` / ``ckptflow decompress``: whole checkpoint directories."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def compress(
    src: Path = typer.Argument(..., help="A DCP checkpoint directory (any, not only ckptflow's)."),
    dst: Path = typer.Argument(..., help="New or empty directory for the compressed copy."),
    codec: str = typer.Option("bytegroup", "--codec", help="bytegroup (tensor-aware), zstd (plain) or none."),
    level: int | None = typer.Option(None, "--level", help="zstd level; default: the codec's fastest good one."),
    threads: int | None = typer.Option(None, help="Worker threads (default: all cores)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON report."),
) -> None:
    """Compress every file of a checkpoint; prints the ratio and the speed.

    Float tensor shards use the tensor-aware codec, other files plain zstd, and
    small non-DCP files are copied as they are. Only DCP's .metadata is unpickled,
    through an allow-list of DCP's own classes.
    """
    from ckptflow.tasks.codec.tool import compress_dir

    rep = compress_dir(str(src), str(dst), codec=codec, level=level, threads=threads)
    _print(rep, "compressed", as_json)


def decompress(
    src: Path = typer.Argument(..., help="A directory made by `ckptflow compress`."),
    dst: Path = typer.Argument(..., help="New or empty directory for the restored checkpoint."),
    threads: int | None = typer.Option(None, help="Worker threads (default: all cores)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON report."),
) -> None:
    """Restore a compressed checkpoint byte for byte; every file's digests are checked."""
    from ckptflow.tasks.codec.tool import decompress_dir

    rep = decompress_dir(str(src), str(dst), threads=threads)
    _print(rep, "decompressed", as_json)


def _print(rep, verb: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps(rep.to_json(), indent=1))
        return
    for f in rep.files:
        r = f.raw_bytes / f.stored_bytes if f.stored_bytes else 1.0
        print(f"  {f.name:<32} {f.codec:<9} {f.raw_bytes:>13,} -> {f.stored_bytes:>13,}  {r:5.3f}x")
    print(
        f"{verb} {len(rep.files)} files: {rep.raw_bytes:,} raw bytes, {rep.stored_bytes:,} "
        f"stored, ratio {rep.ratio:.3f}x, {rep.seconds:.2f} s ({rep.mb_per_s():.0f} MB/s raw)"
    )


def register(app: typer.Typer) -> None:
    app.command("compress")(compress)
    app.command("decompress")(decompress)
