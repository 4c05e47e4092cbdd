"""The commit event: an outbox line first, then a best-effort POST to Prefect.

The outbox (``<run>/_outbox.jsonl``, one fsynced line per commit) is the durable record reconcile reads; the event,
``POST {PREFECT_API_URL}/events`` with a deterministic id (uuid5 of run, step and event) the server stores once, is
the fast path. Sending never stalls training or exit (a daemon thread; ``close()`` waits at most ``exit_budget_s``),
and Prefect is not imported (slow, starts background services). See docs/architecture.md, "The commit event".
"""

from __future__ import annotations

import io
import json
import logging
import os
import queue
import threading
import time
import urllib.error
import urllib.request
import uuid
from datetime import UTC, datetime

from ckptflow.trainer.format import layout
from ckptflow.trainer.fsutil import append_durable
from ckptflow.trainer.safeopen import open_regular

__all__ = [
    "ARCHIVED",
    "COMMITTED",
    "DRILL_COMPLETED",
    "DRILL_FAILED",
    "EXPORTED",
    "EventSender",
    "FAILED",
    "PROMOTED",
    "PRUNED",
    "UNPROVEN",
    "VERIFIED",
    "announce_commit",
    "append_outbox",
    "event_id",
    "make_event",
    "post_events",
    "read_jsonl",
    "read_outbox",
    "resource_id",
]


log = logging.getLogger(__name__)

# Every event ckptflow sends (the trainer the first, the flows the rest); all have the resource id
# ``ckptflow.checkpoint.<run>.<step>``, so one checkpoint's story filters by resource.
COMMITTED = "ckptflow.checkpoint.committed"
VERIFIED = "ckptflow.checkpoint.verified"
FAILED = "ckptflow.checkpoint.failed"
"""Verification failed: the checkpoint is quarantined."""
UNPROVEN = "ckptflow.checkpoint.unproven"
"""Its bytes verified but the sanity step could not run to a verdict (out of memory, a timeout, no builder
on the worker): carried on to warm and cold, not proven restorable; payload ``reason``."""
PROMOTED = "ckptflow.checkpoint.promoted"
ARCHIVED = "ckptflow.checkpoint.archived"
PRUNED = "ckptflow.checkpoint.pruned"
EXPORTED = "ckptflow.checkpoint.exported"
"""The model weights of a verified checkpoint, as safetensors: payload ``location``, ``index``."""
DRILL_COMPLETED = "ckptflow.drill.completed"
DRILL_FAILED = "ckptflow.drill.failed"
_NS = uuid.UUID("6b1f3f1e-3c55-4a39-9a8e-c0ffee0f10e0")  # fixed: ids must be stable across versions


def event_id(run_id: str, step: int, event: str) -> str:
    return str(uuid.uuid5(_NS, f"{event}:{run_id}:{step}"))


def resource_id(run_id: str, step: int) -> str:
    return f"ckptflow.checkpoint.{run_id}.{step}"


def make_event(event: str, run_id: str, step: int, payload: dict, *, occurred: float | None = None) -> dict:
    """A Prefect event document (the shape ``/api/events`` accepts)."""
    ts = datetime.fromtimestamp(occurred or time.time(), tz=UTC).isoformat()
    return {
        "id": event_id(run_id, step, event),
        "occurred": ts,
        "event": event,
        "resource": {
            "prefect.resource.id": resource_id(run_id, step),
            "prefect.resource.name": f"{run_id} step {step}",
            "ckptflow.run_id": run_id,
            "ckptflow.step": str(step),
        },
        "related": [],
        "payload": payload,
    }


def append_outbox(run_path: str, record: dict) -> None:
    append_durable(os.path.join(run_path, layout.OUTBOX), json.dumps(record, sort_keys=True))


def announce_commit(run_path: str, payload: dict, sender: EventSender) -> dict:
    """A commit made known: its outbox line (durable: what reconcile reads), then its event (best effort).
    ``payload`` holds at least ``run_id`` and ``step``; returns the outbox line."""
    run_id, step = payload["run_id"], payload["step"]
    record = dict(payload, event=COMMITTED, event_id=event_id(run_id, step, COMMITTED), committed_at=time.time())
    append_outbox(run_path, record)
    sender.send(make_event(COMMITTED, run_id, step, payload))
    return record


def read_jsonl(path: str) -> list[dict]:
    """Every complete record of a JSON-lines file ([] if none; torn or non-object lines skipped)."""
    out = []
    try:
        with open_regular(path, what="a run folder") as raw, io.TextIOWrapper(raw, encoding="utf-8") as f:
            for line in f:
                try:
                    d = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(d, dict):
                    out.append(d)
    except FileNotFoundError:
        pass
    return out


def read_outbox(run_path: str) -> list[dict]:
    """Every complete outbox line (a torn last line from a crash is skipped)."""
    return read_jsonl(os.path.join(run_path, layout.OUTBOX))


def post_events(api_url: str, events: list[dict], *, timeout_s: float, api_key: str | None = None) -> None:
    req = urllib.request.Request(
        api_url.rstrip("/") + "/events",
        data=json.dumps(events).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})},
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 - URL from config
        if resp.status >= 300:
            raise urllib.error.HTTPError(req.full_url, resp.status, "unexpected status", resp.headers, None)


class EventSender:
    """Background sender with bounded retries; ``send`` never blocks the caller."""

    def __init__(
        self,
        api_url: str | None = None,
        *,
        attempt_timeout_s: float = 0.5,
        attempts: int = 3,
        exit_budget_s: float = 1.0,
    ) -> None:
        self.api_url = api_url if api_url is not None else os.environ.get("PREFECT_API_URL")
        self.api_key = os.environ.get("PREFECT_API_KEY")
        self.attempt_timeout_s = attempt_timeout_s
        self.attempts = attempts
        self.exit_budget_s = exit_budget_s
        self._q: queue.Queue[dict | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.api_url)

    def send(self, event: dict) -> None:
        if not self.enabled:
            return
        if self._thread is None:
            # daemon: a hung server can never keep the process alive
            self._thread = threading.Thread(target=self._run, name="ckptflow-events", daemon=True)
            self._thread.start()
        self._q.put(event)

    def _run(self) -> None:
        assert self.api_url is not None  # only send() starts this thread, and only when enabled (api_url set)
        while (ev := self._q.get()) is not None:
            for i in range(self.attempts):
                try:
                    post_events(self.api_url, [ev], timeout_s=self.attempt_timeout_s, api_key=self.api_key)
                    break
                except Exception as e:  # any failure: retry, then leave it to the outbox
                    if i == self.attempts - 1:
                        # never log the URL's query or credentials; the host is enough
                        log.warning(
                            "event %s not delivered (%s); the outbox keeps it for reconcile",
                            ev["event"],
                            type(e).__name__,
                        )
                    else:
                        time.sleep(0.05 * (2**i))

    def close(self) -> None:
        """Give queued events up to ``exit_budget_s`` in total, then abandon them."""
        if self._thread is None:
            return
        self._q.put(None)
        self._thread.join(timeout=self.exit_budget_s)
        self._thread = None
