"""Emitting ckptflow's events from flows, and naming their artifacts.

Event names live in ``ckptflow.trainer.events`` (the trainer sends the commit event; the
flows send the rest). Event ids are deterministic (uuid5 of event, run and step): a
lifecycle that runs twice emits the same ids, and the server stores each once.
"""

from __future__ import annotations

import logging
import re
import uuid
from typing import Any

from ckptflow.trainer.events import event_id, resource_id

log = logging.getLogger(__name__)


def emit(event: str, run_id: str, step: int, payload: dict[str, Any], *, key: str | None = None) -> None:
    """Emit through Prefect's client (buffered, sent in the background); never raises.

    ``key`` distinguishes occurrences that are not the same event (two drills of one
    checkpoint on different nights); without it a repeat is deduplicated by the server.
    """
    try:
        from prefect.events import emit_event

        emit_event(
            event=event,
            resource={
                "prefect.resource.id": resource_id(run_id, step),
                "prefect.resource.name": f"{run_id} step {step}",
                "ckptflow.run_id": run_id,
                "ckptflow.step": str(step),
            },
            payload=payload,
            id=uuid.UUID(event_id(run_id, step, f"{event}#{key}" if key else event)),
        )
    except Exception as e:  # an event is a notification, not part of the work
        log.warning("could not emit %s for %s step %s: %s", event, run_id, step, e)


def artifact_key(*parts: object) -> str:
    """A stable artifact key (Prefect allows lowercase letters, digits and dashes), so the
    artifacts of one checkpoint or run keep a history: ``lifecycle-<run>-<step>``."""
    return re.sub(r"[^a-z0-9-]", "-", "-".join(str(p) for p in parts).lower())
