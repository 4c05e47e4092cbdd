"""``ckptflow ls [ROOT|RUN]``: every checkpoint across the tiers, one row per step."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from ckptflow.cli.common import config_option, json_option, one_line_errors

if TYPE_CHECKING:
    from rich.console import JustifyMethod


@dataclass(slots=True)
class Row:
    run_id: str
    step: int
    tiers: list[str] = field(default_factory=list)
    """Tiers where the step is committed (and its manifest/index read back)."""
    raw_bytes: int | None = None
    stored_bytes: dict[str, int] = field(default_factory=dict)
    codec: dict[str, str] = field(default_factory=dict)
    stages: list[str] = field(default_factory=list)
    """Lifecycle stage records on hot (verified, compressed, promoted, archived, pruned)."""
    verified: bool = False
    """The verify stage passed it, or a warm/cold tier holds a copy (checked before commit)."""
    quarantined: bool = False
    quarantine_reasons: list[str] = field(default_factory=list)
    not_proven: str | None = None
    """Its bytes verified but the sanity step could not run to a verdict: why (the verify record's)."""
    pinned: list[str] = field(default_factory=list)
    latest: list[str] = field(default_factory=list)
    """Tiers whose ``latest`` names this step."""
    problems: dict[str, str] = field(default_factory=dict)
    """Tier -> why its copy could not be read (damaged index or manifest)."""
    nodes: list[str] = field(default_factory=list)
    """Saved on node-local hot roots: the nodes that committed it (their ids), else empty."""
    replicas: int | None = None
    """Node-local roots: how many nodes hold each shard file."""
    hot_part: list[int] | None = None
    """Node-local roots: [files this node's hot root holds, files in the manifest]."""
    parts: dict[str, str] = field(default_factory=dict)
    """Node-local roots: each node's part on warm — staged, absent (the node had no copy),
    waiting (no report yet) — until warm commits the whole (then: committed)."""


@one_line_errors
def ls(
    target: str | None = typer.Argument(
        None,
        metavar="[ROOT|RUN]",
        show_default=False,
        help="A run id (that run on every tier); or an existing directory: a hot root (all its "
        "runs), or one run's directory inside it. Default: every run on every tier.",
    ),
    config: Path | None = config_option(),
    as_json: bool = json_option(),
) -> None:
    """List checkpoints across tiers: step, tiers, size, stored size, stages, verified, pinned.

    Reads manifests, tier indexes and lifecycle records only (run `ckptflow verify DIR` to
    re-hash a checkpoint's bytes). A copy whose manifest or index is damaged is listed with
    the problem. Exit 0; 3 when RUN has no checkpoint anywhere; 4 when a tier could not be
    listed (the others are still shown).
    """
    import dataclasses

    from ckptflow.cli.common import check_run, fail, hint, load, tiers
    from ckptflow.cli.errors import EXIT_ERROR, EXIT_NOT_FOUND
    from ckptflow.trainer.format import layout

    cfg = load(config)
    run_filter: str | None = None
    if target is not None and os.path.isdir(target):
        root = os.path.abspath(target)
        if _looks_like_run(root):
            root, run_filter = os.path.dirname(root), check_run(os.path.basename(root))
        cfg = dataclasses.replace(cfg, hot=dataclasses.replace(cfg.hot, url=root))
    elif target is not None:
        if "/" in target or os.sep in target:
            fail(
                f"{target}: no such directory (give an existing hot root, a run directory, or a run id)", EXIT_NOT_FOUND
            )
        run_filter = check_run(target)

    rows, unreachable, aside = collect(cfg, run_filter)
    for name, why in unreachable.items():
        hint(f"warning: tier {name} could not be listed: {why}")
    if run_filter is not None and not rows and not unreachable and not aside:
        fail(
            f"run {run_filter!r} has no committed checkpoint on any tier "
            f"({', '.join(f'{t.name} {t.url}' for t in tiers(cfg))}); `ckptflow ls` lists the runs",
            EXIT_NOT_FOUND,
        )
    if as_json:
        print(
            json.dumps(
                {
                    "config": cfg.source,
                    "tiers": {t.name: t.url for t in cfg.tiers()},
                    "unreachable": unreachable,
                    "checkpoints": [asdict(r) for r in rows],
                    "set_aside": [asdict(a) for a in aside],
                },
                indent=1,
            )
        )
    else:
        _table(cfg, rows, layout)
        _aside_lines(aside)
    if unreachable:
        raise typer.Exit(EXIT_ERROR)


@dataclass(slots=True)
class Aside:
    """A checkpoint found damaged and set aside: no longer committed, kept for inspection."""

    run_id: str
    step: int
    tier: str
    location: str


def _aside_lines(aside: list[Aside]) -> None:
    from ckptflow.cli.common import console

    if not aside:
        return
    con = console()
    con.print("set aside as damaged (no longer committed, kept to inspect; remove by hand when done):")
    for a in aside:
        con.print(f"  {a.run_id} step {a.step} on {a.tier}: {a.location}", highlight=False, markup=False)


def _looks_like_run(path: str) -> bool:
    from ckptflow.trainer.format import layout

    try:
        names = os.listdir(path)
    except OSError:
        return False
    return layout.LATEST in names or any(layout.parse_step(n) is not None for n in names)


def collect(cfg: Any, run_filter: str | None = None) -> tuple[list[Row], dict[str, str], list[Aside]]:
    """Rows for every committed checkpoint (of ``run_filter``) on every tier, the tiers that could not be
    listed (name -> reason), and the checkpoints set aside as damaged."""
    from ckptflow.tasks import records
    from ckptflow.tasks.stages import RECORDS, VERIFY, stage_records
    from ckptflow.tasks.storage import open_tiers
    from ckptflow.trainer.errors import CkptflowError
    from ckptflow.trainer.format import layout

    found: dict[tuple[str, int], Row] = {}
    unreachable: dict[str, str] = {}
    latest_of: dict[tuple[str, str], int | None] = {}
    aside: list[Aside] = []
    for tier in open_tiers(cfg):
        try:
            runs = [run_filter] if run_filter else tier.list_runs()
            for run in runs:
                for name in tier.set_aside_names(run):
                    where = layout.join(tier.url_for(run), layout.DAMAGED_DIR, name)
                    aside.append(Aside(run, layout.parse_set_aside(name) or 0, tier.name, where))
                steps = tier.committed_steps(run)
                if not steps:
                    continue
                pins = tier.pinned_steps(run)
                latest_of[(tier.name, run)] = tier.latest_step(run)
                for s in steps:
                    row = found.setdefault((run, s), Row(run, s))
                    try:
                        ck = tier.open_checkpoint(run, s)
                    except (CkptflowError, OSError) as e:
                        row.problems[tier.name] = str(e)
                        continue
                    row.tiers.append(tier.name)
                    row.raw_bytes = ck.manifest.total_bytes
                    pl = ck.manifest.extra.get("placement") or {}
                    if pl.get("scope") == "node":
                        row.nodes = [str(n.get("node")) for n in pl.get("nodes", [])]
                        row.replicas = pl.get("replicas")
                        if tier.name == "warm":
                            row.parts = dict.fromkeys(row.nodes, "committed")
                        if tier.name == "hot":
                            here = sum(tier.exists(tier.url_for(run, s, n)) for n in ck.manifest.files)
                            row.hot_part = [here, len(ck.manifest.files)]
                    row.stored_bytes[tier.name] = ck.index.total_stored_bytes
                    row.codec[tier.name] = ck.index.codec
                    if tier.name != "hot" and ck.has_tier_index:
                        row.verified = True  # checked byte for byte before that tier committed it
                    if s in pins:
                        row.pinned.append(tier.name)
                    if latest_of[(tier.name, run)] == s:
                        row.latest.append(tier.name)
        except Exception as e:  # noqa: BLE001 - storage clients raise many types (botocore's
            # EndpointConnectionError is no OSError); one dead tier must not hide the others
            first = (str(e).strip().splitlines() or [""])[0][:300]
            unreachable[tier.name] = f"{tier.url}: {type(e).__name__}: {first}"
    if cfg.warm is not None:
        _add_parts(cfg, found)
    hot_root = cfg.hot.url
    for (run, s), row in found.items():
        run_path = layout.run_dir(hot_root, run)
        st = stage_records(run_path, s) if os.path.isdir(run_path) else {}
        row.stages = [x for x in RECORDS if x in st]
        if VERIFY.record in st:
            row.verified = True
            if st[VERIFY.record].get("proven") is False:
                row.not_proven = str(st[VERIFY.record].get("not_proven") or "no reason recorded")
        q = st.get(records.QUARANTINED)
        if q is not None:
            row.quarantined, row.verified = True, False
            row.quarantine_reasons = [str(x) for x in q.get("reasons", [])] or ["no reason recorded"]
    return sorted(found.values(), key=lambda r: (r.run_id, r.step)), unreachable, aside


def _add_parts(cfg: Any, found: dict) -> None:
    """Node-local checkpoints not yet whole on warm: each node's part, from the reports on warm."""
    from ckptflow.tasks.storage import Tier
    from ckptflow.tasks.transfer._parts import parts_status

    warm = Tier(cfg.warm)
    for (run, s), row in found.items():
        if not row.nodes or "warm" in row.tiers:
            continue
        st = parts_status(warm, run, s)
        row.parts = {n: str(st.reports.get(n, {}).get("status", "waiting")) for n in row.nodes}


def _nodes_text(r: Row) -> str:
    """``2 x2, here 3/5, parts 1/2``: committed by 2 nodes, each shard on 2 of them, this node holds
    3 of 5 files, 1 of the 2 nodes' parts staged on warm (all: the whole is committed there)."""
    if not r.nodes:
        return "-"
    here = f", here {r.hot_part[0]}/{r.hot_part[1]}" if r.hot_part else ""
    done = sum(v in ("staged", "committed") for v in r.parts.values())
    parts = f", parts {done}/{len(r.nodes)}" if r.parts else ""
    return f"{len(r.nodes)} x{r.replicas}{here}{parts}"


def status_text(r: Row) -> str:
    if r.quarantined:
        return "QUARANTINED (" + "; ".join(r.quarantine_reasons)[:120] + ")"
    bad = "; ".join(f"{t}: {p}" for t, p in r.problems.items())
    base = "verified" if r.verified else "not verified"
    if r.not_proven is not None:
        base = f"bytes verified, NOT PROVEN restorable ({r.not_proven[:120]})"
    return f"{base}; DAMAGED {bad[:120]}" if bad else base


def _table(cfg: Any, rows: list[Row], layout: Any) -> None:
    from rich.table import Table
    from rich.text import Text

    from ckptflow.cli.common import console, human_bytes
    from ckptflow.tasks.stages import STAGES

    marks = {s.record: s.letter for s in STAGES}

    con = console()
    if not rows:
        con.print(f"no checkpoints on {', '.join(f'{t.name} ({t.url})' for t in cfg.tiers())}")
        return
    names = [t.name for t in cfg.tiers()]
    tbl = Table(title=f"checkpoints ({cfg.source})", title_justify="left")
    just: JustifyMethod
    for col, just in (("run", "left"), ("step", "right"), ("tiers", "left"), ("raw", "right")):
        tbl.add_column(col, justify=just, no_wrap=True)
    for n in names:
        tbl.add_column(f"stored {n}", justify="right", no_wrap=True)
    tbl.add_column("stages", no_wrap=True)  # initials, legend under the table (keeps 80 columns)
    tbl.add_column("status", overflow="fold", min_width=12)  # the one column that wraps (reasons)
    if any(r.nodes for r in rows):
        tbl.add_column("nodes", no_wrap=True)  # node-local hot roots: nodes x replicas, this node's part
    tbl.add_column("pinned", no_wrap=True)
    tbl.add_column("latest", no_wrap=True)
    for r in rows:
        style = "red" if r.quarantined or r.problems else ("green" if r.verified and not r.not_proven else "yellow")
        tbl.add_row(
            r.run_id,
            str(r.step),
            ",".join(r.tiers) or "-",
            human_bytes(r.raw_bytes),
            *[human_bytes(r.stored_bytes.get(n)) for n in names],
            "".join(marks.get(x, "?") for x in r.stages) or "-",
            Text(status_text(r), style=style),
            *([_nodes_text(r)] if any(x.nodes for x in rows) else []),
            ",".join(r.pinned) or "-",
            ",".join(r.latest) or "-",
        )
    con.print(tbl)
    con.print(
        "stages: " + ", ".join(f"{s.letter} {s.record}" for s in STAGES) + " (from the hot run's "
        "_lifecycle records; --json gives the names)"
    )


def register(app: typer.Typer) -> None:
    app.command("ls")(ls)
