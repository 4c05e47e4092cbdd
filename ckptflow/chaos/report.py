"""The campaign's table (rich) and its one-line-per-trial progress output."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptflow.chaos.model import TrialResult, summarize

if TYPE_CHECKING:
    from rich.console import Console

    from ckptflow.chaos.runner import CampaignReport


def trial_line(r: TrialResult) -> str:
    verdict = "ok" if r.ok else ("ERROR" if r.error else "FAIL")
    rec = f", recovery {r.recovery_s:.1f} s" if r.recovery_s is not None else ""
    extra = "" if r.injected else " (fault not reached)"
    return f"[{r.index:>4}] {r.kind:<8} {r.fault:<44} {verdict}{extra} ({r.seconds:.1f} s{rec})"


def problems(r: TrialResult) -> list[str]:
    return (
        ([f"error: {r.error.splitlines()[0]}"] if r.error else [])
        + [f"lost: {x}" for x in r.lost]
        + [f"undetected: {x}" for x in r.undetected]
        + [f"violation: {x}" for x in r.violations]
        + ([] if r.recovered or not r.injected else ["not recovered"])
    )


def print_report(rep: CampaignReport, con: Console) -> None:
    from rich.table import Table

    tbl = Table(title=f"ckptflow chaos — {len(rep.results)} trials, seed {rep.seed}, {rep.seconds / 60:.1f} min")
    for c in (
        "kind",
        "trials",
        "faults injected",
        "detected",
        "recovered",
        "data lost",
        "undetected",
        "violations",
        "findings",
        "longest recovery",
    ):
        tbl.add_column(c, justify="left" if c == "kind" else "right")
    for name, s in summarize(rep.results).items():
        style = "bold" if name == "total" else None
        longest = f"{s.longest_recovery_s:.1f} s" if s.longest_recovery_trial is not None else "-"
        tbl.add_row(
            name,
            str(s.trials),
            str(s.faults),
            f"{s.detected}/{s.faulted_trials}",
            f"{s.recovered}/{s.faulted_trials}",
            _red(s.lost),
            _red(s.undetected),
            _red(s.violations),
            str(s.findings),
            longest,
            style=style,
        )
    con.print(tbl)
    total = summarize(rep.results)["total"]
    if total.not_injected:
        con.print(f"{total.not_injected} trial(s) never reached their fault (counted, not faulted).")
    found: dict[str, list[int]] = {}
    for r in rep.results:
        for f in r.findings:
            found.setdefault(f, []).append(r.index)
    for f, idx in found.items():
        con.print(
            f"[yellow]finding[/] (trials {', '.join(map(str, idx[:8]))}{'…' if len(idx) > 8 else ''}): {f}",
            highlight=False,
        )
    bad = [r for r in rep.results if not r.ok]
    for r in bad:
        con.print(f"[red]trial {r.index} ({r.kind}, {r.fault})[/]" + (f" — kept in {r.workdir}" if r.workdir else ""))
        for line in problems(r):
            con.print(f"  {line}", markup=False)
    if not bad:
        con.print("[green]nothing lost, every fault detected, every recovery finished[/]")


def _red(n: int) -> str:
    return f"[red]{n}[/]" if n else "0"
