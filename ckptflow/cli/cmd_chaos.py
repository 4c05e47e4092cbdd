"""``ckptflow chaos``: a fault-injection campaign; exit 1 if anything was lost or undetected."""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
from pathlib import Path

import typer

from ckptflow.chaos.model import DEFAULT_KINDS, KINDS
from ckptflow.cli.errors import EXIT_BAD, EXIT_USAGE


def chaos(
    trials: int = typer.Option(10, "--trials", "-n", min=1, help="Trials to run (round-robin over --kinds)."),
    kinds: str = typer.Option(
        ",".join(DEFAULT_KINDS),
        "--kinds",
        help="Comma-separated fault kinds: kill, corrupt, s3, prefect, enospc, net (root); KIND:N "
        "gives a kind N turns per round (kill:4 = four kills per round).",
    ),
    seed: int | None = typer.Option(None, "--seed", help="Replays the same trials (default: a random seed, printed)."),
    config: Path | None = typer.Option(
        None,
        "--config",
        help="Your ckptflow.toml: its codecs, levels, storage "
        "class and lifecycle checks are used; its tier locations never are.",
    ),
    workdir: Path | None = typer.Option(
        None,
        "--workdir",
        help="Where the scratch tiers live (default: a new temp dir, removed afterwards when every trial passed).",
    ),
    keep: bool = typer.Option(False, "--keep", help="Keep every trial's folders and logs (failed ones always are)."),
    sign: bool = typer.Option(
        True, "--sign/--no-sign", help="Sign manifests with a throwaway HMAC key (default) or run unsigned."
    ),
    s3_share: float = typer.Option(
        0.2, "--s3-fault-share", min=0.0, max=1.0, help="Share of S3 requests the proxy breaks (storm trials: 0.6)."
    ),
    prefect_share: float = typer.Option(
        0.2,
        "--prefect-fault-share",
        min=0.0,
        max=1.0,
        help="Share of Prefect API requests broken in flow-flaky trials.",
    ),
    timeout: float = typer.Option(
        300.0, "--timeout", min=10.0, help="Seconds before a trial's process counts as hung."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (progress goes to stderr)."),
) -> None:
    """Inject faults into SCRATCH COPIES of your storage setup and prove checkpoints survive.

    Never touches your real tiers: every trial gets its own folders under the work dir, a
    prefix of a bucket on a local S3 server (moto) the campaign starts, and — for the
    prefect kind — its own Prefect server. Fault kinds: kill (SIGKILL during save, commit,
    verify, compress, promote, archive, prune), corrupt (bit flips, truncation, missing
    objects, stale latest, edited manifests, markers without objects and objects without
    markers, on every tier), s3 (HTTP 500/503, resets, stalls through a proxy), prefect
    (server refusing, hanging or restarted during training and flows), enospc (a full
    disk while saving; needs root to mount a small tmpfs), net (two nodes in network
    namespaces, a link cut during the two-level commit or training, flapping or throttled;
    root only, not in the default set).

    Prints a table of trials, faults injected, detected, recovered, data lost and the
    longest recovery. Exit 0 when nothing was lost, everything was detected and every
    recovery finished; 1 otherwise.
    """
    from rich.console import Console

    from ckptflow.chaos import Options, run_campaign
    from ckptflow.chaos.report import print_report, problems, trial_line
    from ckptflow.chaos.workspace import Style
    from ckptflow.cli.common import load

    wanted, weights = _parse_kinds(kinds)
    if "net" in wanted and os.geteuid() != 0:
        typer.echo("ckptflow: error: --kinds net needs root (it makes network namespaces); run as root", err=True)
        raise typer.Exit(EXIT_USAGE)
    style = Style.from_config(load(config)) if config is not None else Style()
    seed = seed if seed is not None else secrets.randbelow(1 << 31)
    stream = sys.stderr if as_json else sys.stdout
    out = Console(file=stream, width=None if stream.isatty() else 132)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    say(
        f"ckptflow chaos: {trials} trials of {', '.join(wanted)}, seed {seed} (replay with --seed {seed}); "
        f"config: {style.source}"
    )

    def progress(r) -> None:
        say(trial_line(r))
        if not r.ok:
            for line in problems(r):
                say(f"       {line}")

    opts = Options(
        trials=trials,
        kinds=wanted,
        weights=weights,
        seed=seed,
        style=style,
        workdir=str(workdir) if workdir else None,
        keep=keep,
        sign=sign,
        s3_share=s3_share,
        prefect_share=prefect_share,
        timeout_s=timeout,
    )
    # SIGTERM behaves like Ctrl-C: trials' processes are stopped and their namespaces and servers removed.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    rep = run_campaign(opts, say=lambda m: say(f"  {m}"), on_result=progress)
    if as_json:
        print(json.dumps(rep.to_dict(), indent=1, default=str))
    else:
        print_report(rep, out)
    raise typer.Exit(0 if rep.ok else EXIT_BAD)


def _parse_kinds(text: str) -> tuple[tuple[str, ...], dict[str, int]]:
    kinds, weights = [], {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, _, n = item.partition(":")
        if name not in KINDS or (n and (not n.isdigit() or int(n) < 1)):
            typer.echo(
                f"ckptflow: error: --kinds {item!r}: use KIND or KIND:N (N >= 1) with KIND one of {', '.join(KINDS)}",
                err=True,
            )
            raise typer.Exit(EXIT_USAGE)
        kinds.append(name)
        if n:
            weights[name] = int(n)
    if not kinds:
        typer.echo(f"ckptflow: error: --kinds names no fault kind; choose from {', '.join(KINDS)}", err=True)
        raise typer.Exit(EXIT_USAGE)
    return tuple(kinds), weights


def register(app: typer.Typer) -> None:
    app.command("chaos")(chaos)
