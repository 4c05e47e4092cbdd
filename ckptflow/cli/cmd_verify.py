"""``ckptflow verify PATH``: check one checkpoint directory against its manifest."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def verify(
    path: Path = typer.Argument(..., help="A committed checkpoint directory (step_NNNNNNNNN)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON report."),
    threads: int = typer.Option(4, help="Files hashed in parallel."),
) -> None:
    """Check every file of a checkpoint against its manifest (size + xxh3-128).

    Exit 0 when the checkpoint is whole; 1 with each offending file named when not.
    Nothing is unpickled or loaded.
    """
    from ckptflow.trainer.verify import verify_checkpoint

    res = verify_checkpoint(str(path), threads=threads)
    if as_json:
        print(
            json.dumps(
                {
                    "path": str(path),
                    "ok": res.ok,
                    "step": res.manifest.step if res.manifest else None,
                    "files": len(res.manifest.files) if res.manifest else 0,
                    "bytes": res.bytes_checked,
                    "seconds": round(res.seconds, 4),
                    "problems": [{"path": p.path, "what": p.what} for p in res.problems],
                },
                indent=1,
            )
        )
    elif res.ok:
        m = res.manifest
        assert m is not None  # ok implies the manifest was read
        mbps = res.bytes_checked / max(res.seconds, 1e-9) / 1e6
        print(
            f"OK {path}: step {m.step}, {len(m.files)} files, {res.bytes_checked} bytes "
            f"verified in {res.seconds:.3f} s ({mbps:.0f} MB/s)"
        )
    else:
        for p in res.problems:
            typer.echo(f"BAD {p}", err=True)
    raise typer.Exit(0 if res.ok else 1)


def register(app: typer.Typer) -> None:
    app.command("verify")(verify)
