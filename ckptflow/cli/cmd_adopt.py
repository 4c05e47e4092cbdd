"""``ckptflow adopt PATH --run-id RUN [--step N]``: a checkpoint another tool wrote, committed as ckptflow's."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ckptflow.cli.common import config_option, json_option, one_line_errors


@one_line_errors
def adopt(
    path: Path | None = typer.Argument(
        None,
        help="A finished DCP folder (torchtitan's step-N, Lightning's sharded folders) or torch.save file (.ckpt).",
        show_default=False,
    ),
    run_id: str = typer.Option(..., "--run-id", help="The run it belongs to in ckptflow."),
    step: int | None = typer.Option(
        None,
        "--step",
        help="Its step (default: the number in its name, e.g. step-200).",
        show_default=False,
    ),
    root: Path | None = typer.Option(
        None, "--root", help="The hot root to commit it in (default: the config's [hot] url).", show_default=False
    ),
    watch: Path | None = typer.Option(
        None,
        "--watch",
        help="Keep adopting every checkpoint that completes in this folder (until Ctrl-C or SIGTERM).",
        show_default=False,
    ),
    poll_s: float = typer.Option(10.0, "--poll-s", help="With --watch: seconds between looks at the folder."),
    config: Path | None = config_option(),
    as_json: bool = json_option(),
) -> None:
    """Adopt a finished checkpoint another tool wrote into the lifecycle.

    Its files are copied into the hot root with a manifest of every file's size and digest and
    committed as ckptflow commits its own (never half-adopted); the commit event goes out as for a
    save, so the deployed lifecycle verifies, promotes, archives and prunes it. A folder or file
    still being written is refused. Exit 0 when committed (or already, with the same files); 2 for
    a bad argument or a checkpoint that is not finished or not ours to trust. With ``--watch DIR``
    every entry of DIR whose name carries a step is adopted once it is finished; one line (or
    JSON document) per adoption, until stopped (exit 0).
    """
    import os

    from ckptflow.cli.common import check_run, fail, load
    from ckptflow.cli.errors import EXIT_USAGE
    from ckptflow.tasks.adopt import adopt as do_adopt
    from ckptflow.trainer.errors import ConfigError

    run_id = check_run(run_id)
    if root is None:
        hot = load(config).hot.url
        if "://" in hot:
            fail(f"the config's hot tier is {hot}: adoption commits on a local hot root; give --root DIR", EXIT_USAGE)
        root = Path(hot)
    api = os.environ.get("PREFECT_API_URL")
    if (path is None) == (watch is None):
        fail("give PATH (one checkpoint) or --watch DIR (every one that completes there), not both", EXIT_USAGE)
    if watch is not None:
        if not poll_s > 0:
            fail(f"--poll-s {poll_s} must be > 0", EXIT_USAGE)
        if step is not None:
            fail("--step names one checkpoint; with --watch each step comes from its name", EXIT_USAGE)
        _watch(str(watch), run_id, str(root), poll_s, api, as_json)
        return
    try:
        rec = do_adopt(str(path), run_id=run_id, root=str(root), step=step, api_url=api)
    except ConfigError as e:
        fail(str(e), EXIT_USAGE)
    if as_json:
        print(json.dumps(rec, indent=1))
    else:
        what = "already adopted as" if rec.get("already") else "adopted as"
        typer.echo(f"{path}: {what} {run_id} step {rec['step']} in {rec['uri']}")


def _watch(folder: str, run_id: str, root: str, poll_s: float, api: str | None, as_json: bool) -> None:
    import signal
    import threading

    from ckptflow.cli.common import hint
    from ckptflow.tasks.adopt import watch

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    def report(path: str, rec: dict | None, err: str | None) -> None:
        if err is not None:
            hint(f"not adopted: {err}")
        elif as_json:
            print(json.dumps(rec), flush=True)
        else:
            assert rec is not None
            print(f"{path}: adopted as {run_id} step {rec['step']} in {rec['uri']}", flush=True)

    hint(f"watching {folder} for finished checkpoints (every {poll_s:g} s; Ctrl-C stops)")
    watch(folder, run_id=run_id, root=root, poll_s=poll_s, api_url=api, stop=stop, report=report)


def register(app: typer.Typer) -> None:
    app.command("adopt")(adopt)
