"""Uniform error reporting for every command: one line, what/which path/what to do."""

from __future__ import annotations

import sys

import typer

from trainer.errors import CheckpointNotFoundError, CkptflowError, IntegrityError

EXIT_OK = 0
EXIT_BAD = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_ERROR = 4


def exit_code_for(exc: BaseException) -> int:
    if isinstance(exc, IntegrityError):
        return EXIT_BAD
    if isinstance(exc, (CheckpointNotFoundError, FileNotFoundError)):
        return EXIT_NOT_FOUND
    return EXIT_ERROR


def run_cli(app: typer.Typer) -> int:
    try:
        app(standalone_mode=False)
    except SystemExit as e:  # typer/click exits for --help and usage errors
        return int(e.code or 0) if isinstance(e.code, int) else EXIT_USAGE
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort:
        print("ckptflow: aborted", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("ckptflow: interrupted", file=sys.stderr)
        return 130
    except CkptflowError as e:
        print(f"ckptflow: error: {e}", file=sys.stderr)
        return exit_code_for(e)
    except FileNotFoundError as e:
        print(f"ckptflow: error: {e.strerror or e}: {e.filename}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except Exception as e:  # click usage errors come through here in non-standalone mode
        import click

        if isinstance(e, click.exceptions.UsageError):
            e.show()
            return EXIT_USAGE
        if isinstance(e, click.exceptions.ClickException):
            e.show()
            return EXIT_ERROR
        raise
    return EXIT_OK
