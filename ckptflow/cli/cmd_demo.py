"""``ckptflow demo``: the whole product on an embedded default, start to finish."""

from __future__ import annotations

import signal
from pathlib import Path

import typer


def demo(
    workdir: Path = typer.Option(Path(".ckptflow/demo"), help="Where the demo keeps everything (wiped first)."),
    steps: int = typer.Option(120, help="Training steps."),
    save_every: int = typer.Option(20, help="Checkpoint interval (steps)."),
    model: str = typer.Option("mini", help="Model preset: tiny, mini (2.2M params), small (14M), medium."),
    kill_at: int = typer.Option(50, help="SIGKILL one worker after this step (0: no kill)."),
    timeout: float = typer.Option(600.0, help="Give up waiting for the lifecycles after this many seconds."),
    nodes: int = typer.Option(
        1, "--nodes", help="Simulate this many nodes, each with its own hot folder and lifecycle worker (2+)."
    ),
) -> None:
    """Start Prefect and S3 locally, train 2 ranks with checkpoints, kill a worker, watch the
    run resume exactly, let every checkpoint's lifecycle run, drill a restore, and summarise.

    Everything it starts is stopped at the end, also on Ctrl-C. Exit 0 when every
    lifecycle completed and the drill passed.
    """
    from rich.console import Console
    from rich.table import Table

    from ckptflow.demo.nodes import run_node_demo
    from ckptflow.demo.runner import DemoSettings, run_demo

    con = Console()
    # SIGTERM behaves like Ctrl-C: the supervisor's cleanup runs either way.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    con.print(f"[bold]ckptflow demo[/] — everything under {workdir.resolve()}")
    settings = DemoSettings(
        workdir=str(workdir),
        steps=steps,
        save_every=save_every,
        model=model,
        kill_at=kill_at or None,
        timeout_s=timeout,
    )
    if nodes > 1:
        out = run_node_demo(settings, nodes, say=con.print)
    else:
        out = run_demo(settings, say=con.print)
    if out.training is not None and out.training.killed_pid:
        same, total = out.replay_identical
        con.print(
            f"resume: worker killed after step {out.training.killed_at_step}, resumed from step "
            f"{out.training.resumed_from}; {same}/{total} replayed steps have bit-identical losses"
        )
    t = Table(title="checkpoints of run 'demo'")
    for c in ("step", "on tiers", "raw MB", "warm MB", "cold MB", "verified", "stages"):
        t.add_column(c, justify="right" if c in ("step", "raw MB", "warm MB", "cold MB") else "left")
    for r in out.checkpoints:
        raw = r["raw"] or 0

        def cell(name: str) -> str:
            v = r["stored"].get(name)
            return f"{v / 1e6:.1f} ({raw / v:.2f}x)" if v else "-"

        ver = (
            ("[red]QUARANTINED[/] " + "; ".join(r["quarantined"])[:40])
            if r["quarantined"]
            else (f"[green]yes[/] {r['probe']}" if r["verified"] else "no")
        )
        t.add_row(
            str(r["step"]),
            " ".join(r["tiers"]),
            f"{raw / 1e6:.1f}" if raw else "-",
            cell("warm"),
            cell("cold"),
            ver,
            f"{len(r['stages'])}/{5 if nodes > 1 else 6}",
        )
    con.print(t)
    con.print(
        (
            "stages: promoted (every node's part joined on warm), verified (on the warm copy), exported, "
            "archived, pruned"
            if nodes > 1
            else "stages: verified, compressed, promoted, exported, archived, pruned"
        )
        + " (a checkpoint that is gone from hot was pruned there by retention; it lives on in warm and cold)"
    )
    ex = [r for r in out.checkpoints if r.get("export")]
    if ex:
        e = ex[-1]["export"]
        con.print(
            f"exported: {len(ex)} checkpoint(s) as safetensors for evaluation; step {ex[-1]['step']}: "
            f"{e['tensors']} tensors, {(e['bytes'] or 0) / 1e6:.1f} MB in {len(e['shards'] or [])} shard(s) at "
            f"{e['location']}{' and ' + e['cold'] if e.get('cold') else ''} (event ckptflow.checkpoint.exported)"
        )
    a = out.adopted
    if a:
        con.print(
            f"adopted: {a['record']['uri']} (written by dcp.save, run '{a['run_id']}'), verified "
            f"{'[green]yes[/]' if a['verified'] else '[red]no[/]'} by its {a['check']} check, "
            f"on tiers {' '.join(a['tiers'])}"
        )
    d = out.drill or {}
    for r in d.get("results", []):
        sec = r["seconds"]
        con.print(
            f"restore drill: step {r['step']} from {r['tier']} restored at world size {r['world_size']} "
            f"(saved at {r['saved_world_size']}): {'[green]PASSED[/]' if r['ok'] else '[red]FAILED[/]'}, "
            f"probe loss {r['probe_match']}; recovery {sec['total']:.1f} s = download "
            f"{sec.get('download', 0):.1f} + decompress {sec.get('decompress', 0):.1f} + verify "
            f"{sec.get('verify', 0):.1f} + sanity {sec.get('sanity', 0):.1f}"
        )
    if d.get("plot"):
        con.print(f"drill plot: {d['plot']}")
    w = getattr(out, "way_back", None)
    if w is not None and w.step is not None:
        con.print(
            f"the way back: {'every node' + chr(39) + 's disk' if nodes > 1 else 'hot'} wiped and warm offline; "
            f"step {w.step} brought back from {w.tier} by the job itself"
            f"{', each node what its rank reads' if nodes > 1 else ''} ({w.bytes_fetched / 1e6:.1f} MB fetched; the "
            f"job's whole run {w.seconds:.1f} s); steps "
            f"{w.steps[0]}-{w.steps[-1]} {'[green]bitwise equal[/]' if w.bitwise else '[red]differ from[/]'} "
            "to the run before"
            + (
                " (per node: " + ", ".join(f"{f} files {b / 1e6:.2f} MB" for f, b in w.node_parts.values()) + ")"
                if w.node_parts
                else ""
            )
        )
    for p in out.problems:
        con.print(f"[red]problem:[/] {p}")
    con.print(
        f"{'[green]demo OK[/]' if out.ok else '[red]demo FAILED[/]'} in {out.seconds:.0f} s; "
        f"summary: {Path(out.workdir) / 'summary.json'}; logs: {Path(out.workdir) / 'logs'}"
    )
    raise typer.Exit(0 if out.ok else 1)


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
