"""``ckptflow restore RUN [--step N] [--tier T] --to DIR``: the newest checkpoint that verifies."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import typer

from ckptflow.cli.common import config_option, json_option, one_line_errors


@one_line_errors
def restore(
    run_id: str = typer.Argument(..., metavar="RUN", help="Run id."),
    to: Path = typer.Option(
        ...,
        "--to",
        help="New or empty directory to restore into (it receives the DCP files and manifest.json).",
        show_default=False,
    ),
    step: int | None = typer.Option(
        None, "--step", help="Exactly this step (default: the newest that verifies).", show_default=False
    ),
    tier: str | None = typer.Option(
        None, "--tier", help="Only this tier: hot, warm or cold (default: all, hot first).", show_default=False
    ),
    threads: int | None = typer.Option(None, "--threads", help="Files fetched in parallel (default 4)."),
    config: Path | None = config_option(),
    as_json: bool = json_option(),
    no_progress: bool = typer.Option(
        False, "--no-progress", help="No progress bar (it is also off with --json and when stderr is not a terminal)."
    ),
) -> None:
    """Restore a checkpoint into DIR: every byte checked, damaged copies skipped.

    Candidates are every committed step on the chosen tiers, newest step first, and for one
    step the hotter tier first. A damaged, missing or quarantined copy is skipped (and
    listed with the reason) and the next candidate is tried, so a corrupted newest
    checkpoint costs one interval of training, not the restore. DIR ends up holding a whole,
    verified checkpoint, or is not created. Exit 0 restored; 1 checkpoints exist but none
    verifies; 2 usage (DIR not empty, unknown tier); 3 no such run/step on those tiers.
    """
    import logging

    from ckptflow.cli.common import check_run, fail, load, tiers
    from ckptflow.cli.errors import EXIT_BAD, EXIT_NOT_FOUND, EXIT_USAGE
    from ckptflow.tasks.transfer import restore as do_restore
    from ckptflow.trainer.errors import CheckpointNotFoundError

    run_id = check_run(run_id)
    if step is not None and step < 0:
        fail(f"--step {step} must be >= 0", EXIT_USAGE)
    dst = os.path.abspath(to)
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        fail(f"{dst} exists and is not an empty directory; give a new or empty --to directory", EXIT_USAGE)
    cfg = load(config)
    _check_not_a_phantom(cfg, dst, run_id, step)
    chosen = tiers(cfg, tier)
    first = _newest_candidate(chosen, run_id, step)
    if first is None:
        where = ", ".join(f"{t.name} ({t.url})" for t in chosen)
        what = f"step {step}" if step is not None else "committed checkpoint"
        fail(f"run {run_id!r} has no {what} on {where}; `ckptflow ls {run_id}` lists its steps", EXIT_NOT_FOUND)

    # restore() logs each skip as a warning; they are printed below as a table instead.
    quiet = logging.getLogger("ckptflow.tasks.transfer")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    show = not (as_json or no_progress) and _stderr_is_tty()
    try:
        if show:
            res = _with_progress(do_restore, chosen, run_id, dst, step, threads, first)
        else:
            res = do_restore(chosen, run_id, dst, step=step, threads=threads, holder="ckptflow restore")
    except CheckpointNotFoundError as e:
        # Candidates existed (checked above): every one of them failed to verify.
        fail(str(e), EXIT_BAD)
    finally:
        quiet.setLevel(level)
    _report(res, as_json)


def _check_not_a_phantom(cfg: Any, dst: str, run_id: str, step: int | None) -> None:
    """A folder inside a tier's run is one of its checkpoints: restoring there is right only as that step's
    own folder (putting a checkpoint back on a tier by hand). Anywhere else in a tier it would become a
    phantom step that counts toward ``keep_last``, or land beside the tier's own records."""
    from ckptflow.cli.common import fail
    from ckptflow.cli.errors import EXIT_USAGE
    from ckptflow.tasks.config import where_in_tiers
    from ckptflow.trainer.format import layout

    hit = where_in_tiers(cfg, dst)
    if hit is None:
        return
    tier, rel = hit
    if step is not None and rel == (run_id, layout.step_name(step)):
        return
    fail(
        f"{dst} is inside tier {tier.name} ({tier.url}); a restore there must be the step's own folder "
        f"({layout.join(tier.url, run_id, 'step_<N as 9 digits>')} with --step N), so that it does not become "
        "a checkpoint the tier never committed; restore somewhere else",
        EXIT_USAGE,
    )


def _stderr_is_tty() -> bool:
    import sys

    return sys.stderr.isatty()


def _newest_candidate(chosen: list[Any], run_id: str, step: int | None) -> tuple[Any, int] | None:
    """The candidate restore tries first (tier, step), to size the progress bar; None: none."""
    best: tuple[Any, int] | None = None
    for t in chosen:
        try:
            steps = [s for s in t.committed_steps(run_id) if step is None or s == step]
        except Exception:  # noqa: BLE001 - an unreachable tier; restore() reports it
            continue
        if steps and (best is None or steps[0] > best[1]):
            best = (t, steps[0])
    return best


def _with_progress(
    do_restore: Any,
    chosen: list[Any],
    run_id: str,
    dst: str,
    step: int | None,
    threads: int | None,
    first: tuple[Any, int],
) -> Any:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from ckptflow.cli.common import console
    from ckptflow.tasks.transfer import progress_total

    tier, s = first
    try:
        total: int | None = progress_total(tier, tier.read_index(run_id, s))
    except Exception:  # a damaged newest copy: restore will skip it; the bar just has no total
        total = None
    cols = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*cols, console=console(err=True, terminal=True), transient=True) as bar:
        task = bar.add_task(f"restore {run_id}", total=total)
        res = do_restore(
            chosen,
            run_id,
            dst,
            step=step,
            threads=threads,
            holder="ckptflow restore",
            progress=lambda n: bar.advance(task, n),
        )
    return res


def _report(res: Any, as_json: bool) -> None:
    from ckptflow.cli.common import console, human_bytes

    f = res.fetch
    mbps = f.bytes_raw / max(res.seconds, 1e-9) / 1e6
    doc = {
        "run_id": res.run_id,
        "step": res.step,
        "tier": res.tier,
        "uri": res.uri,
        "dst_dir": res.dst_dir,
        "codec": f.codec,
        "files": f.files,
        "bytes_raw": f.bytes_raw,
        "bytes_stored": f.bytes_stored,
        "seconds": round(res.seconds, 4),
        "download_seconds": round(f.download_seconds, 4),
        "decompress_seconds": round(f.decompress_seconds, 4),
        "mb_per_s": round(mbps, 2),
        "skipped": [{"uri": k.uri, "step": k.step, "tier": k.tier, "reason": k.reason} for k in res.skipped],
    }
    if as_json:
        print(json.dumps(doc, indent=1))
        return
    con = console()
    if res.skipped:
        from rich.table import Table
        from rich.text import Text

        tbl = Table(title="skipped", title_justify="left")
        for c in ("tier", "step", "why"):
            tbl.add_column(c)
        for k in res.skipped:
            tbl.add_row(k.tier, str(k.step) if k.step >= 0 else "-", Text(k.reason))
        con.print(tbl)
    con.print(
        f"restored {res.run_id} step {res.step} from {res.tier} ({res.uri}) into {res.dst_dir}: "
        f"{f.files} files, {human_bytes(f.bytes_raw)} raw ({f.bytes_raw:,} B; stored "
        f"{f.bytes_stored:,} B {f.codec}) in {res.seconds:.2f} s = {mbps:.1f} MB/s "
        f"(download {f.download_seconds:.2f} s, decompress {f.decompress_seconds:.2f} s)",
        highlight=False,
        markup=False,
    )


def register(app: typer.Typer) -> None:
    app.command("restore")(restore)
