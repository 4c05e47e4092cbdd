"""``ckptflow verify PATH [PATH ...]``: check a checkpoint directory (or nodes' parts) against its manifest."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def verify(
    paths: list[Path] = typer.Argument(
        ...,
        help="A committed checkpoint directory (step_NNNNNNNNN); with "
        "node-local hot roots, one node's part, or every node's.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON report."),
    threads: int = typer.Option(4, help="Files hashed in parallel."),
) -> None:
    """Check every file of a checkpoint against its manifest (size + xxh3-128).

    One directory of a checkpoint saved on node-local roots is that node's part: the files it
    holds are verified and the others are named as held elsewhere. Several directories (every
    node's part of one step) must together hold every file. Exit 0 when what was asked is whole;
    1 with each offending file named when not. Nothing is unpickled or loaded.
    """
    from ckptflow.tasks.verify import verify_parts
    from ckptflow.trainer.verify import VerifyResult, verify_checkpoint

    parts: list[VerifyResult]
    whole: list[str]

    if len(paths) == 1:
        parts, whole = [verify_checkpoint(str(paths[0]), threads=threads, part=True)], []
    else:
        parts, whole = verify_parts([str(p) for p in paths], threads=threads)
    ok = all(r.ok for r in parts) and not whole
    if as_json:
        print(
            json.dumps(
                {
                    "path": str(paths[0]) if len(paths) == 1 else [str(p) for p in paths],
                    "ok": ok,
                    "step": parts[0].manifest.step if parts[0].manifest else None,
                    "files": len(parts[0].manifest.files) if parts[0].manifest else 0,
                    "bytes": sum(r.bytes_checked for r in parts),
                    "seconds": round(sum(r.seconds for r in parts), 4),
                    "problems": [{"path": p.path, "what": p.what} for r in parts for p in r.problems]
                    + [{"path": "", "what": w} for w in whole],
                    "parts": [{"path": r.ckpt_dir, "elsewhere": r.elsewhere} for r in parts],
                },
                indent=1,
            )
        )
        raise typer.Exit(0 if ok else 1)
    for path, r in zip(paths, parts, strict=True):
        if r.ok:
            m = r.manifest
            assert m is not None  # ok implies the manifest was read
            mbps = r.bytes_checked / max(r.seconds, 1e-9) / 1e6
            held = len(m.files) - len(r.elsewhere)
            what = (
                f"{len(m.files)} files"
                if not r.elsewhere
                else (
                    f"node part: {held} of {len(m.files)} files (the others are held by other nodes: "
                    f"{', '.join(r.elsewhere[:4])}{' ...' if len(r.elsewhere) > 4 else ''})"
                )
            )
            print(
                f"OK {path}: step {m.step}, {what}, {r.bytes_checked} bytes verified in {r.seconds:.3f} s "
                f"({mbps:.0f} MB/s)"
            )
        else:
            for p in r.problems:
                typer.echo(f"BAD {p}", err=True)
    for w in whole:
        typer.echo(f"BAD {w}", err=True)
    if ok and len(paths) > 1:
        print(
            f"OK the {len(paths)} parts hold every file of step {parts[0].manifest.step if parts[0].manifest else '?'}"
        )
    raise typer.Exit(0 if ok else 1)


def register(app: typer.Typer) -> None:
    app.command("verify")(verify)
