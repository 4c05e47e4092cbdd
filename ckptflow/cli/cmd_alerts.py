"""``ckptflow alerts setup WEBHOOK_URL``: Prefect automations that post to a webhook."""

from __future__ import annotations

import json

import typer

from ckptflow.cli.common import json_option

alerts_app = typer.Typer(
    help="Alerting: webhook notifications from Prefect automations.", no_args_is_help=True, add_completion=False
)


@alerts_app.command("setup")
def setup(
    webhook_url: str = typer.Argument(
        ..., metavar="WEBHOOK_URL", help="http(s) URL that receives a JSON POST {subject, body, source}."
    ),
    stall_after: float = typer.Option(
        3600.0, "--stall-after", help="Seconds without a committed checkpoint (per run) before 'trainer stalled' fires."
    ),
    allow_private: bool | None = typer.Option(
        None,
        "--allow-private/--no-allow-private",
        help="Allow a private or loopback address (default: allowed exactly when the URL resolves to one).",
        show_default=False,
    ),
    as_json: bool = json_option(),
) -> None:
    """Save the webhook (a Prefect block) and (re)create ckptflow's automations.

    Alerts on: a lifecycle run failed or crashed, a drill run crashed, a checkpoint
    quarantined, a restore drill failed, no commit for a run within --stall-after seconds.
    Safe to repeat (replaces ckptflow's automations). Needs PREFECT_API_URL: automations on
    a temporary server would vanish with it. The URL is stored in the block, never printed
    (paths and query strings of webhooks are often the secret). Exit 0; 2 bad URL or no
    Prefect API; 4 the Prefect API refused or could not be reached.
    """
    from ckptflow.cli.common import fail, prefect_api_url, redact_url
    from ckptflow.cli.errors import EXIT_ERROR, EXIT_USAGE

    shown = redact_url(webhook_url)
    if not webhook_url.startswith(("http://", "https://")) or shown == "<redacted>":
        fail("WEBHOOK_URL must be an http:// or https:// URL with a host", EXIT_USAGE)
    if not stall_after > 0:
        fail(f"--stall-after {stall_after} must be > 0 seconds", EXIT_USAGE)
    api = prefect_api_url()
    if not api:
        fail(
            "PREFECT_API_URL is not set: automations need a lasting Prefect server; start one "
            "(prefect server start) and export PREFECT_API_URL=http://127.0.0.1:4200/api",
            EXIT_USAGE,
        )
    from ckptflow.flows.alerts import BLOCK_NAME, setup_alerts

    try:
        out = setup_alerts(webhook_url, stall_after_s=stall_after, allow_private=allow_private)
    except Exception as e:  # httpx/pydantic/prefect errors: many types; never echo the URL
        msg = str(e).replace(webhook_url, shown).splitlines()[0] if str(e) else ""
        fail(
            f"could not set up alerts on the Prefect API at {api} ({type(e).__name__}: {msg[:200]}); "
            "check that the server is up and reachable",
            EXIT_ERROR,
        )
    if as_json:
        print(
            json.dumps(
                {
                    "webhook": shown,
                    "block": BLOCK_NAME,
                    "block_id": out["block"],
                    "automations": out["automations"],
                    "stall_after_s": stall_after,
                },
                indent=1,
            )
        )
        return
    typer.echo(f"webhook {shown} saved as Prefect block '{BLOCK_NAME}'; automations:")
    for name, aid in out["automations"].items():
        typer.echo(f"  ckptflow: {name}  ({aid})")


def register(app: typer.Typer) -> None:
    app.add_typer(alerts_app, name="alerts")
