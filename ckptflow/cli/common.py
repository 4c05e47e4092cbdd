"""Helpers shared by the storage commands (ls, restore, prune, pin, drill, advise, alerts).

Light at import: only typer and the standard library; everything heavy is imported
inside the functions, so ``ckptflow --help`` stays fast.
"""

from __future__ import annotations

import functools
import os
import sys
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import typer

from ckptflow.cli.errors import EXIT_ERROR, EXIT_NOT_FOUND, EXIT_USAGE

if TYPE_CHECKING:
    from rich.console import Console

    from ckptflow.tasks.config import CkptflowConfig
    from ckptflow.tasks.storage import Tier

TIER_NAMES = ("hot", "warm", "cold")

CONFIG_HELP = (
    "Config file (default: $CKPTFLOW_CONFIG, else ./ckptflow.toml, else the built-in "
    "default: ./.ckptflow/hot and ./.ckptflow/warm)."
)


def config_option() -> Path | None:
    return typer.Option(None, "--config", help=CONFIG_HELP, show_default=False)


def json_option() -> bool:
    return typer.Option(False, "--json", help="Print one JSON document (for scripts) instead of tables.")


def fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    """One line on stderr — what, which path, what to do — and the documented exit code."""
    typer.echo(f"ckptflow: error: {message}", err=True)
    raise typer.Exit(code)


F = TypeVar("F", bound=Callable[..., Any])


def one_line_errors(fn: F) -> F:
    """Any other exception from the work becomes one line and exit 4, not a traceback.

    Storage clients raise types that are neither ckptflow errors nor OSError (botocore's
    EndpointConnectionError from an unreachable S3 endpoint, for one); ``flows.cli.errors``
    maps ckptflow errors, FileNotFoundError and PermissionError, this catches the rest.
    ``CKPTFLOW_DEBUG=1`` keeps the traceback.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from click.exceptions import ClickException

        from ckptflow.trainer.errors import CkptflowError

        try:
            return fn(*args, **kwargs)
        except (
            typer.Exit,
            typer.Abort,
            ClickException,
            CkptflowError,
            FileNotFoundError,
            PermissionError,
            KeyboardInterrupt,
        ):
            raise
        except Exception as e:
            if os.environ.get("CKPTFLOW_DEBUG"):
                raise
            first = (str(e).strip().splitlines() or [""])[0][:300]
            fail(
                f"{type(e).__name__}: {first}; check that the configured tiers (and the Prefect API) "
                "are reachable, then re-run (CKPTFLOW_DEBUG=1 shows the traceback)",
                EXIT_ERROR,
            )

    return wrapper  # type: ignore[return-value]


def check_numbers(
    seconds: tuple[tuple[str, float | None, bool], ...] = (), counts: tuple[tuple[str, int | None], ...] = ()
) -> None:
    """Usage errors for number flags: ``(flag, value, strict)`` must be finite and > 0 (strict)
    or >= 0; ``(flag, n)`` counts must be >= 1. None means "not given" and passes."""
    import math

    for flag, v, strict in seconds:
        if v is not None and not (math.isfinite(v) and (v > 0 if strict else v >= 0)):
            fail(f"{flag} {v} must be {'> 0' if strict else '>= 0'}", EXIT_USAGE)
    for flag, n in counts:
        if n is not None and n < 1:
            fail(f"{flag} {n} must be >= 1", EXIT_USAGE)


def hint(message: str) -> None:
    typer.echo(f"ckptflow: {message}", err=True)


def load(config: Path | None) -> CkptflowConfig:
    """The config; a named file that does not exist is 'not found' (exit 3)."""
    from ckptflow.tasks.config import find_config_file, load_config
    from ckptflow.trainer.errors import ConfigError

    try:
        find_config_file(str(config) if config else None)
    except ConfigError as e:
        fail(str(e), EXIT_NOT_FOUND)
    return load_config(str(config) if config else None)


def check_run(run_id: str) -> str:
    from ckptflow.trainer.errors import ConfigError
    from ckptflow.trainer.format import layout

    try:
        return layout.check_run_id(run_id)
    except ConfigError as e:
        fail(str(e), EXIT_USAGE)


def tiers(cfg: CkptflowConfig, only: str | None = None) -> list[Tier]:
    """Configured tiers in restore order, or just ``only`` (usage error if not configured)."""
    from ckptflow.tasks.storage import open_tiers

    all_tiers = open_tiers(cfg)
    if only is None:
        return all_tiers
    if only not in TIER_NAMES:
        fail(f"--tier {only!r} is not a tier name; use one of {', '.join(TIER_NAMES)}", EXIT_USAGE)
    picked = [t for t in all_tiers if t.name == only]
    if not picked:
        fail(
            f"tier {only!r} is not configured in {cfg.source} (configured: "
            f"{', '.join(t.name for t in all_tiers)}); add a [{only}] section or pick another",
            EXIT_USAGE,
        )
    return picked


def console(err: bool = False, *, terminal: bool | None = None) -> Console:
    """A rich console; at least 120 columns when not a terminal, so piped tables do not wrap.
    ``terminal=True`` forces live output (a progress bar the caller decided to show)."""
    from rich.console import Console

    stream = sys.stderr if err else sys.stdout
    tty = stream.isatty() if terminal is None else terminal
    width = None if tty else max(120, int(os.environ.get("COLUMNS", "0") or 0))
    return Console(file=stream, width=width, soft_wrap=True, force_terminal=terminal)


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n} B"


def redact_url(url: str) -> str:
    """Scheme and host only: webhook paths and query strings often are the secret."""
    p = urllib.parse.urlsplit(url)
    return f"{p.scheme}://{p.hostname}/…" if p.scheme and p.hostname else "<redacted>"


def prefect_api_url() -> str | None:
    """The Prefect API this process talks to (environment, profile or test harness), or None."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or None
