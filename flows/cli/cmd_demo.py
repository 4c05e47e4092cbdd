"""``ckptflow demo``: the main job on an embedded default, start to finish."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import typer


def demo(
    workdir: Path = typer.Option(Path(".ckptflow/demo"), help="Where the demo keeps everything."),
    steps: int = typer.Option(120, help="Training steps."),
    save_every: int = typer.Option(20, help="Checkpoint interval (steps)."),
    model: str = typer.Option("mini", help="Model preset: tiny, mini (2.2M params), small (14M), medium."),
    kill_at: int = typer.Option(50, help="SIGKILL one worker after this step (0: no kill)."),
    keep: bool = typer.Option(False, help="Keep the previous demo's files instead of starting clean."),
) -> None:
    """Train a 2-rank job with async checkpoints, kill a worker, watch it resume exactly."""
    from rich.console import Console
    from rich.table import Table

    from flows.demo.procs import Supervisor
    from flows.demo.training import run_training
    from trainer import commit, layout
    from trainer.verify import verify_checkpoint

    con = Console()
    workdir = workdir.resolve()
    if workdir.exists() and not keep:
        shutil.rmtree(workdir)
    hot = workdir / "hot"
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    run_id = "demo"
    t0 = time.monotonic()
    con.print(f"[bold]ckptflow demo[/] — workdir {workdir}")
    con.print(f"training: torchrun 2 ranks (gloo, FSDP2), {steps} steps, checkpoint every {save_every}")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with Supervisor() as sup:
        out = run_training(sup, root=str(hot), run_id=run_id, steps=steps, save_every=save_every,
                           model=model, kill_at=kill_at or None, env=env, log_dir=str(logs),
                           say=con.print)
    if out.returncode != 0:
        con.print(f"[red]training failed (exit {out.returncode}); log: {out.log_path}[/]")
        raise typer.Exit(4)
    if out.resumed_from is not None:
        con.print(f"  torchrun restarted the workers; they resumed from step {out.resumed_from} "
                  f"and finished step {out.steps}")
    run_dir = Path(out.run_dir)
    tbl = Table(title=f"checkpoints of run '{run_id}'")
    for c in ("step", "files", "bytes", "verified", "loss", "lr"):
        tbl.add_column(c, justify="right")
    for step in sorted(commit.committed_steps(str(run_dir))):
        res = verify_checkpoint(str(run_dir / layout.step_name(step)))
        m = res.manifest
        tbl.add_row(str(step), str(len(m.files)) if m else "-", f"{m.total_bytes:,}" if m else "-",
                    "[green]yes[/]" if res.ok else f"[red]{res.problems[0]}[/]",
                    f"{m.training.get('loss', float('nan')):.4f}" if m else "-",
                    f"{m.training.get('lr', float('nan')):.2e}" if m else "-")
    con.print(tbl)
    con.print(f"latest -> {commit.read_latest(str(run_dir))}; metrics: {run_dir / layout.METRICS}; "
              f"done in {time.monotonic() - t0:.0f} s")


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
