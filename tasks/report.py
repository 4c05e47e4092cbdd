"""Drill reports: a markdown summary with trends, and a PNG of the run's loss curve.

The plot shows the training loss per step, the steps that have checkpoints, the points
where the job resumed after a failure (the torchrun attempt changes), and the drill's
restored probe loss next to the one recorded at save time — the picture of "we lost
this much and got it back exactly".
"""

from __future__ import annotations

import os
import time
from typing import Any

from ckptflow.trainer.format import layout
from ckptflow.trainer.reference.metrics import read_metrics

__all__ = ["read_metrics"]  # re-exported: the drill flow reads the curve through the report


def resume_points(rows: list[dict[str, Any]]) -> list[int]:
    """Steps at which a new attempt started (the step it resumed after is one less)."""
    return [b for _, b in failures_and_resumes(rows)]


def failures_and_resumes(rows: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(last step of the failed attempt, first step of the next attempt) per restart."""
    out, prev = [], None
    for r in rows:
        a = r.get("attempt", 0)
        if prev is not None and a != prev[0]:
            out.append((prev[1], r["step"]))
        prev = (a, r["step"])
    return out


def plot_drill(
    path: str, *, run_id: str, rows: list[dict[str, Any]], checkpoint_steps: list[int], drills: list[dict[str, Any]]
) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=110)
    last = {r["step"]: r["loss"] for r in rows}  # replayed steps: the surviving attempt
    if last:
        xs = sorted(last)
        ax.plot(xs, [last[x] for x in xs], lw=1.2, color="#3465a4", label="training loss")
    for i, s in enumerate(sorted(checkpoint_steps)):
        ax.axvline(s, color="#8ae234", lw=0.8, alpha=0.7, label="checkpoint" if i == 0 else None)
    for i, (died, resumed) in enumerate(failures_and_resumes(rows)):
        ax.axvline(died, color="#cc0000", lw=1.2, ls=":", label="failure (worker killed)" if i == 0 else None)
        ax.axvline(resumed - 0.5, color="#cc0000", lw=1.5, ls="--", label="resumed from checkpoint" if i == 0 else None)
    for i, d in enumerate(drills):
        if d.get("probe_loss_recorded") is not None:
            ax.scatter(
                [d["step"]],
                [d["probe_loss_recorded"]],
                marker="o",
                s=70,
                facecolors="none",
                edgecolors="#75507b",
                label="probe loss at save" if i == 0 else None,
                zorder=5,
            )
        if d.get("probe_loss_restored") is not None:
            ax.scatter(
                [d["step"]],
                [d["probe_loss_restored"]],
                marker="x",
                s=60,
                color="#f57900",
                label="probe loss restored by drill" if i == 0 else None,
                zorder=6,
            )
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ok = all(d.get("ok") for d in drills) if drills else False
    ax.set_title(
        f"{run_id}: restore drill {'PASSED' if ok else 'FAILED'} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})"
    )
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def drill_markdown(
    run_id: str, results: list[dict[str, Any]], history: list[dict[str, Any]], plot_path: str | None
) -> str:
    lines = [f"# Restore drill: {run_id}", ""]
    for r in results:
        verdict = "PASSED" if r["ok"] else f"FAILED — {r['failure']}"
        s = r.get("seconds", {})
        lines += [
            f"## {layout.step_name(r['step'])} from {r['tier']}: {verdict}",
            "",
            f"- object: `{r['uri']}`",
            f"- world size: saved {r.get('saved_world_size')}, restored at {r.get('world_size')}",
            f"- bytes: {r.get('bytes_stored', 0):,} stored, {r.get('bytes_raw', 0):,} raw",
            f"- probe loss: recorded {r.get('probe_loss_recorded')}, restored "
            f"{r.get('probe_loss_restored')} ({r.get('probe_match')}); lr {r.get('lr_restored')} vs "
            f"{r.get('lr_recorded')}",
            "",
            "| phase | seconds |",
            "|---|---|",
        ]
        lines += [
            f"| {k} | {s[k]:.2f} |" for k in ("download", "decompress", "verify", "sanity", "load", "total") if k in s
        ]
        lines.append("")
    earlier = [h for h in history if h.get("ok")][-10:]
    if earlier:
        rto = [h["recovery_seconds"] for h in earlier]
        lines += [
            "## Trend (earlier passing drills)",
            "",
            f"recovery time over the last {len(rto)}: min {min(rto):.1f} s, median "
            f"{sorted(rto)[len(rto) // 2]:.1f} s, max {max(rto):.1f} s",
            "",
            "| when (UTC) | step | recovery s | MB stored |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {time.strftime('%Y-%m-%d %H:%M', time.gmtime(h['started_at']))} | {h['step']} | "
            f"{h['recovery_seconds']:.1f} | {h.get('bytes_stored', 0) / 1e6:.1f} |"
            for h in earlier
        ]
    if plot_path:
        lines += ["", f"Loss curve with checkpoints, resume points and the restored probe loss: `{plot_path}`"]
    return "\n".join(lines)
