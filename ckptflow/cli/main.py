"""Entry point of the ``ckptflow`` console script.

Exit codes (stable, for scripts):
  0  success
  1  the thing checked is bad (a checkpoint that does not verify, a chaos trial lost data)
  2  usage error (bad flag or argument)
  3  not found (no such path, run or checkpoint)
  4  a ckptflow error while doing the work (storage, codec, config)
"""

from __future__ import annotations

import sys

import typer

from ckptflow.cli import (
    cmd_adopt,
    cmd_advise,
    cmd_alerts,
    cmd_chaos,
    cmd_codec,
    cmd_demo,
    cmd_deploy,
    cmd_drill,
    cmd_export,
    cmd_goodput,
    cmd_ls,
    cmd_pin,
    cmd_prune,
    cmd_restore,
    cmd_serve,
    cmd_verify,
    cmd_worker,
)

app = typer.Typer(
    name="ckptflow",
    help="The whole life of a distributed-training checkpoint.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """ckptflow: async sharded checkpoints, verified tiered storage and restore drills."""


# Registration order is the order in --help.
cmd_demo.register(app)
cmd_ls.register(app)
cmd_verify.register(app)
cmd_restore.register(app)
cmd_prune.register(app)
cmd_pin.register(app)
cmd_adopt.register(app)
cmd_export.register(app)
cmd_drill.register(app)
cmd_advise.register(app)
cmd_goodput.register(app)
cmd_codec.register(app)
cmd_alerts.register(app)
cmd_serve.register(app)
cmd_deploy.register(app)
cmd_worker.register(app)
cmd_chaos.register(app)


def main() -> None:
    """Console-script entry: turn ckptflow errors into one clear line and an exit code."""
    from ckptflow.cli.errors import run_cli

    sys.exit(run_cli(app))


if __name__ == "__main__":
    main()
