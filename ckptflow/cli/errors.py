"""Uniform error reporting for every command: one line, what/which path/what to do."""

from __future__ import annotations

import os
import re
import sys

import typer

from ckptflow.trainer.errors import CheckpointNotFoundError, CkptflowError, IntegrityError

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


def one_line(msg: str) -> str:
    """An error message as the one line the CLI promises: a wrapped library error can carry a traceback."""
    lines = [x.strip() for x in msg.strip().splitlines() if x.strip()]
    return lines[0] + (" (...)" if len(lines) > 1 else "") if lines else msg


def run_cli(app: typer.Typer, argv: list[str] | None = None) -> int:
    """Run the app; usage errors are typer's (exit 2), ckptflow errors become one line."""
    try:
        app(args=argv, standalone_mode=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (EXIT_OK if e.code is None else EXIT_ERROR)
    except KeyboardInterrupt:
        print("ckptflow: interrupted", file=sys.stderr)
        return 130
    except CkptflowError as e:
        print(f"ckptflow: error: {one_line(str(e))}", file=sys.stderr)
        return exit_code_for(e)
    except FileNotFoundError as e:
        print(f"ckptflow: error: {e.strerror or e}: {e.filename}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except PermissionError as e:
        print(f"ckptflow: error: permission denied: {e.filename}; check the path's owner and mode", file=sys.stderr)
        return EXIT_ERROR
    except Exception as e:
        # Anything else (a botocore connection error, a server that went away): still one
        # line, with URLs' query strings (signed URLs, tokens) cut off. The traceback is
        # there for whoever asks.
        if os.environ.get("CKPTFLOW_DEBUG"):
            raise
        msg = re.sub(r"(https?://[^\s?'\"]+)\?[^\s'\"]*", r"\1?…", str(e))
        print(f"ckptflow: error: {type(e).__name__}: {msg} (set CKPTFLOW_DEBUG=1 for the traceback)", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK
