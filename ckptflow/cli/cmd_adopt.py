"""``ckptflow adopt PATH --run-id RUN [--step N]``: a checkpoint another tool wrote, committed as ckptflow's."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ckptflow.cli.common import config_option, json_option, one_line_errors


@one_line_errors
def adopt(
    path: Path = typer.Argument(
        ..., help="A finished DCP folder (torchtitan's step-N, Lightning's sharded folders) or torch.save file (.ckpt)."
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
    config: Path | None = config_option(),
    as_json: bool = json_option(),
) -> None:
    """Adopt a finished checkpoint another tool wrote into the lifecycle.

    Its files are copied into the hot root with a manifest of every file's size and digest and
    committed as ckptflow commits its own (never half-adopted); the commit event goes out as for a
    save, so the deployed lifecycle verifies, promotes, archives and prunes it. A folder or file
    still being written is refused. Exit 0 when committed (or already, with the same files); 2 for
    a bad argument or a checkpoint that is not finished or not ours to trust.
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
    try:
        rec = do_adopt(str(path), run_id=run_id, root=str(root), step=step, api_url=os.environ.get("PREFECT_API_URL"))
    except ConfigError as e:
        fail(str(e), EXIT_USAGE)
    if as_json:
        print(json.dumps(rec, indent=1))
    else:
        what = "already adopted as" if rec.get("already") else "adopted as"
        typer.echo(f"{path}: {what} {run_id} step {rec['step']} in {rec['uri']}")


def register(app: typer.Typer) -> None:
    app.command("adopt")(adopt)
