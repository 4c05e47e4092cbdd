"""Alerting: Prefect automations that send a webhook notification, plus a direct path.

``setup_alerts(webhook_url)`` (``ckptflow alerts setup URL``) saves a webhook
notification block and (re)creates one automation per condition:

| automation | fires on |
|---|---|
| lifecycle run failed or crashed | a ``ckptflow-lifecycle`` flow run entering Failed or Crashed |
| drill run crashed | a ``ckptflow-restore-drill`` flow run entering Crashed (infrastructure) |
| checkpoint quarantined | ``ckptflow.checkpoint.failed`` |
| checkpoint not proven | ``ckptflow.checkpoint.unproven`` (its bytes verified, the sanity step could not run) |
| restore drill failed | ``ckptflow.drill.failed`` (one per failed drill; the drill run also fails, but that
  state is not alerted again) |
| trainer stalled | no ``ckptflow.checkpoint.committed`` for a run within ``stall_after_s`` (proactive) |

Each message says which run, which checkpoint and what failed. Re-running setup
replaces the automations (matched by name), so it is safe to repeat.

The second path — ``notify_on_failure``, a flow failure hook — posts to the webhook
directly, but only when the Prefect API cannot be reached (then no automation would
fire); when the server is up it stays silent so nobody gets two alerts for one failure.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import urllib.parse
import urllib.request
from datetime import timedelta
from typing import Any
from uuid import UUID

log = logging.getLogger(__name__)

BLOCK_NAME = "ckptflow-alerts"
PREFIX = "ckptflow: "
WEBHOOK_ENV = "CKPTFLOW_WEBHOOK_URL"


def _private(url: str) -> bool:
    host = urllib.parse.urlparse(url).hostname or ""
    try:
        return any(
            ipaddress.ip_address(ai[4][0]).is_private or ipaddress.ip_address(ai[4][0]).is_loopback
            for ai in socket.getaddrinfo(host, None)
        )
    except (OSError, ValueError):
        return False


def _templates() -> dict[str, tuple[str, str]]:
    """Subject and body per automation (Jinja, rendered by the Prefect server)."""
    run = "{{ event.resource['ckptflow.run_id'] }}"
    step = "{{ event.resource['ckptflow.step'] }}"
    return {
        "lifecycle run failed or crashed": (
            "ckptflow: lifecycle {{ flow_run.name }} {{ flow_run.state.name }}",
            "Flow run {{ flow_run.name }} (checkpoint lifecycle) ended {{ flow_run.state.name }}: "
            "{{ flow_run.state.message }}. Run `ckptflow ls` and look at the flow run's logs.",
        ),
        "drill run crashed": (
            "ckptflow: restore drill {{ flow_run.name }} crashed",
            "The restore drill flow run {{ flow_run.name }} crashed (infrastructure): {{ flow_run.state.message }}.",
        ),
        "checkpoint quarantined": (
            f"ckptflow: checkpoint {run} step {step} quarantined",
            f"Run {run}, checkpoint step {step} ({{{{ event.payload.uri }}}}) failed verification and was "
            "quarantined (never promoted; resume skips it). What failed: {{ event.payload.reasons | join('; ') }}",
        ),
        "checkpoint not proven": (
            f"ckptflow: checkpoint {run} step {step} not proven restorable",
            f"Run {run}, checkpoint step {step} ({{{{ event.payload.uri }}}}): its bytes verified, but the sanity "
            "step could not run to a verdict: {{ event.payload.reason }}. It was carried on to warm and cold, not "
            "quarantined. Give the lifecycle's workers what the step needs (memory, lifecycle.sanity_timeout_s, "
            "the model's builder), then prove it with a restore drill.",
        ),
        "restore drill failed": (
            f"ckptflow: restore drill FAILED for {run} step {step}",
            f"Run {run}, checkpoint step {step} ({{{{ event.payload.uri }}}}): the restore drill failed: "
            "{{ event.payload.failure or event.payload.reason }}",
        ),
        "trainer stalled": (
            "ckptflow: no checkpoint committed for run {{ event.resource['ckptflow.run_id'] }}",
            "Run {{ event.resource['ckptflow.run_id'] }}: no ckptflow.checkpoint.committed event within the "
            "expected time (last committed: step {{ event.resource['ckptflow.step'] }} at {{ event.occurred }}). "
            "The trainer may be stalled or dead.",
        ),
    }


def _triggers(stall_after_s: float) -> dict[str, Any]:
    from prefect.events.schemas.automations import EventTrigger, Posture

    ckpt: dict[str, str | list[str]] = {"prefect.resource.id": "ckptflow.checkpoint.*"}
    return {
        "lifecycle run failed or crashed": EventTrigger(
            expect={"prefect.flow-run.Failed", "prefect.flow-run.Crashed"},
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={"prefect.resource.role": "flow", "prefect.resource.name": "ckptflow-lifecycle"},
            posture=Posture.Reactive,
            threshold=1,
            within=timedelta(0),
        ),
        "drill run crashed": EventTrigger(
            expect={"prefect.flow-run.Crashed"},
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={"prefect.resource.role": "flow", "prefect.resource.name": "ckptflow-restore-drill"},
            posture=Posture.Reactive,
            threshold=1,
            within=timedelta(0),
        ),
        "checkpoint quarantined": EventTrigger(
            expect={"ckptflow.checkpoint.failed"},
            match=ckpt,
            posture=Posture.Reactive,
            threshold=1,
            within=timedelta(0),
        ),
        "checkpoint not proven": EventTrigger(
            expect={"ckptflow.checkpoint.unproven"},
            match=ckpt,
            posture=Posture.Reactive,
            threshold=1,
            within=timedelta(0),
        ),
        "restore drill failed": EventTrigger(
            expect={"ckptflow.drill.failed"}, match=ckpt, posture=Posture.Reactive, threshold=1, within=timedelta(0)
        ),
        # One bucket per run: each run that has ever committed is watched on its own.
        # `after` starts a run's bucket at its first commit; `expect` then wants the next
        # commit within the window, else the trigger fires for that run.
        "trainer stalled": EventTrigger(
            after={"ckptflow.checkpoint.committed"},
            expect={"ckptflow.checkpoint.committed"},
            match=ckpt,
            for_each={"ckptflow.run_id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=stall_after_s),
        ),
    }


def setup_alerts(webhook_url: str, *, stall_after_s: float = 3600.0, allow_private: bool | None = None) -> dict:
    """Create or replace the webhook block and the automations; returns their ids."""
    from prefect.automations import Automation
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.events.actions import SendNotification

    # Prefect gives headers/cookies their default positionally (Field(None, ...)), which mypy does not see
    block = CustomWebhookNotificationBlock(  # type: ignore[call-arg]
        name="ckptflow",
        url=webhook_url,
        method="POST",
        json_data={"subject": "{{subject}}", "body": "{{body}}", "source": "ckptflow"},
        allow_private_urls=_private(webhook_url) if allow_private is None else allow_private,
    )
    # Prefect's async_dispatch types the result as UUID | Coroutine; called from sync code, it is the UUID
    block_id: UUID = block.save(BLOCK_NAME, overwrite=True)  # type: ignore[assignment]
    texts, triggers = _templates(), _triggers(stall_after_s)
    from prefect.client.orchestration import get_client

    out: dict[str, Any] = {"block": str(block_id), "automations": {}}
    with get_client(sync_client=True) as c:
        for old in c.read_automations():
            if old.name.startswith(PREFIX):
                c.delete_automation(old.id)
    for name, trig in triggers.items():
        full = PREFIX + name
        subject, body = texts[name]
        a = Automation(
            name=full,
            description=f"ckptflow alert: {name}",
            trigger=trig,
            actions=[SendNotification(block_document_id=block_id, subject=subject, body=body)],
        ).create()
        out["automations"][name] = str(a.id)  # type: ignore[union-attr]  # sync create() returns the Automation
    return out


def _api_reachable() -> bool:
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as c:
            return c.api_healthcheck() is None  # None = healthy, else the exception
    except Exception:
        return False


def post_webhook(url: str, subject: str, body: str, timeout: float = 5.0) -> None:
    req = urllib.request.Request(
        url,
        data=json.dumps({"subject": subject, "body": body, "source": "ckptflow"}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=timeout):  # noqa: S310 - URL from config
        pass


def notify_on_failure(flow, flow_run, state) -> None:  # noqa: ANN001 - Prefect hook signature
    """Flow failure/crash hook: alert directly only when the server's automations cannot."""
    if _api_reachable():
        return  # the automations fire; a second message for the same failure is noise
    url = os.environ.get(WEBHOOK_ENV)
    if not url:
        try:
            from ckptflow.tasks.config import load_config

            url = load_config(None).drill.webhook_url
        except Exception:
            url = None
    if not url:
        log.error(
            "flow run %s %s and no alert could be sent: Prefect API unreachable and no %s configured",
            flow_run.name,
            state.name,
            WEBHOOK_ENV,
        )
        return
    try:
        post_webhook(
            url,
            f"ckptflow: {flow_run.name} {state.name} (Prefect API unreachable)",
            f"Flow run {flow_run.name} of {flow.name} ended {state.name}: {state.message}",
        )
    except Exception as e:
        log.error("could not post the failure alert for %s: %s", flow_run.name, type(e).__name__)
