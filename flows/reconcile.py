"""``reconcile(root)``: catch up on whatever the event path missed.

Runs on an interval. For every run on the hot tier:

1. **Unfinished commits** — a committed checkpoint (found on storage, or in the outbox)
   whose lifecycle has not finished (no record of its last stage and not quarantined):
   its event was lost while the server was down, or its flow crashed. What to do with
   each is :func:`decide`'s (a pure function of the step's flow runs on the server and
   its heartbeat): leave it to a queued or live run, take over from a dead one (marked
   Crashed on the server), or run the lifecycle as a subflow; its stages skip what is
   already done, so the event path and reconcile never do the same work twice.
2. **Age-based tier moves** — a checkpoint older than its tier's ``move_after_hours``
   that the next tier lacks is brought there by the stage that does so (promote or
   archive), through the same stage path as the lifecycle: lease, record, retries.
3. **Stale ``.tmp``** — temporary dirs older than an hour are removed on every tier
   (a live save of the trainer is always younger).
"""

from __future__ import annotations

import enum
import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefect import flow, get_run_logger

from ckptflow.flows.lifecycle import lifecycle, run_name_prefix, run_stage_task
from ckptflow.flows.secrets import export_manifest_key
from ckptflow.tasks.checkpoint import CheckpointRef, with_hot_root
from ckptflow.tasks.config import CkptflowConfig, load_config
from ckptflow.tasks.heartbeat import heartbeat_alive, read_heartbeat
from ckptflow.tasks.stages import finished, stage_for_tier
from ckptflow.tasks.storage import Tier
from ckptflow.trainer import events
from ckptflow.trainer.format import commit, layout

if TYPE_CHECKING:
    from prefect.client.schemas import OrchestrationResult


@dataclass(frozen=True, slots=True)
class FlowRun:
    """A lifecycle flow run the server holds for a step, as reconcile sees it."""

    id: str
    state: str
    """PENDING, SCHEDULED or RUNNING (a subflow run counts as RUNNING whatever its state)."""
    age_s: float


class Action(enum.Enum):
    LEAVE_QUEUED = "queued: its worker will run it"
    LEAVE_RUNNING = "running, and its process is alive"
    TAKE_OVER = "shown running or queued too long, but no process runs it"
    RUN = "never finished and nothing runs it"
    LEAVE_FRESH = "committed moments ago: its event's run may not exist yet"


def decide(
    runs: list[FlowRun],
    beat_alive: bool,
    queued_grace_s: float,
    *,
    commit_age_s: float = math.inf,
    fresh_grace_s: float = 0.0,
) -> Action:
    """What reconcile does with an unfinished step, given its lifecycle runs on the server.

    A deployment's run queued for less than ``queued_grace_s`` is its worker's to run. A run
    shown running with a live heartbeat is left alone. Any other run is a dead one (a killed
    worker, or queued past any worker's delay): take over. No run at all: run it — unless the
    step was committed less than ``fresh_grace_s`` ago, when its event's run may simply not
    have been created yet (the event -> trigger -> run path takes seconds under load); the next
    reconcile decides. (Were both to start anyway, the heartbeat lock lets only one work.)
    """
    if any(r.state != "RUNNING" and r.age_s < queued_grace_s for r in runs):
        return Action.LEAVE_QUEUED
    if runs and beat_alive:
        return Action.LEAVE_RUNNING
    if not runs and beat_alive:
        return Action.LEAVE_RUNNING  # a run the server does not list (a script's) is working on it
    if not runs and commit_age_s < fresh_grace_s:
        return Action.LEAVE_FRESH
    return Action.TAKE_OVER if runs else Action.RUN


def commit_times(run_path: str) -> dict[int, float]:
    """``{step: committed_at}`` from the run's outbox (steps without a line are old or foreign)."""
    return {
        int(x["step"]): float(x["committed_at"])
        for x in events.read_outbox(run_path)
        if isinstance(x.get("step"), int) and isinstance(x.get("committed_at"), (int, float))
    }


def unfinished_steps(run_path: str) -> list[int]:
    """Committed on hot (by storage or the outbox) and no terminal lifecycle record."""
    on_disk = set(commit.committed_steps(run_path))
    outboxed = {int(x["step"]) for x in events.read_outbox(run_path) if "step" in x}
    # in the outbox but gone from hot: nothing left to process here
    return [s for s in sorted(on_disk | outboxed) if s in on_disk and not finished(run_path, s)]


def in_flight_lifecycles(run_id: str) -> dict[int, list[FlowRun]]:
    """Steps of ``run_id`` with lifecycle flow runs pending, scheduled or running — all of
    them: a step killed twice leaves two RUNNING runs behind, and each must be dealt with.
    Runs of no deployment (subflows of reconcile or of a script) count as RUNNING whatever
    their state: only a deployment's run can be queued for a worker."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterName,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    prefix = run_name_prefix(run_id)
    with get_client(sync_client=True) as c:
        runs = c.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                name=FlowRunFilterName(like_=prefix),
                state=FlowRunFilterState(
                    type=FlowRunFilterStateType(any_=[StateType.PENDING, StateType.SCHEDULED, StateType.RUNNING])
                ),
            ),
            limit=200,
        )
    steps: dict[int, list[FlowRun]] = {}
    now = time.time()
    for r in runs:
        tail = r.name[len(prefix) :] if r.name.startswith(prefix) else ""
        if tail.isdigit():
            age = now - r.created.timestamp() if r.created else float("inf")
            # A subflow run that is not RUNNING belongs to a process that died between
            # creating it and starting it.
            state = r.state_type.value if r.deployment_id and r.state_type else "RUNNING"
            steps.setdefault(int(tail), []).append(FlowRun(str(r.id), state, age))
    return steps


def mark_crashed(flow_run_id: str, why: str) -> None:
    """Tell the server a run whose process is gone has crashed (it cannot say so itself)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    try:
        with get_client(sync_client=True) as c:
            # Read back: a transition the server did not take would leave the run showing
            # RUNNING forever, which misleads people and the next reconcile alike.
            res: OrchestrationResult[Any] | None = None
            for attempt in range(3):
                res = c.set_flow_run_state(flow_run_id, Crashed(message=why), force=True)
                # the id only goes into the URL; a str works (set_flow_run_state takes UUID | str)
                state = c.read_flow_run(flow_run_id).state_type  # type: ignore[arg-type]
                if state is not None and state.value == "CRASHED":
                    return
                time.sleep(0.5 * (attempt + 1))
        get_run_logger().warning(
            "flow run %s did not take the crashed state (%s)", flow_run_id, getattr(res, "status", None)
        )
    except Exception as e:  # bookkeeping only: the lifecycle re-runs either way
        get_run_logger().warning("could not mark flow run %s crashed: %s", flow_run_id, e)


def age_moves(cfg: CkptflowConfig, run_id: str, now: float) -> list[dict[str, Any]]:
    """Bring checkpoints older than their tier's ``move_after_hours`` onto the next tier, with
    the stage that does so (lease, record): a move is done once, like the lifecycle's."""
    moved = []
    tiers = cfg.tiers()
    for cur, nxt in zip(tiers, tiers[1:], strict=False):
        if cur.move_after_hours is None:
            continue
        stage = stage_for_tier(nxt.name)
        src, dst = Tier(cur), Tier(nxt)
        for s in src.committed_steps(run_id):
            if dst.is_committed(run_id, s) or src.is_quarantined(run_id, s):
                continue
            if (now - src.read_manifest(run_id, s).created_at) / 3600 < cur.move_after_hours:
                continue
            rec = run_stage_task(stage, CheckpointRef(cfg, run_id, s))
            if rec is not None and not rec.skipped:
                moved.append(
                    {
                        "step": s,
                        "from": cur.name,
                        "to": nxt.name,
                        "stage": stage.name,
                        "bytes": rec.body.get("bytes_stored"),
                        "ok": rec.ok,
                    }
                )
    return moved


@flow(name="ckptflow-reconcile", flow_run_name="reconcile", log_prints=True)
def reconcile(
    root: str | None = None,
    config: str | None = None,
    tmp_older_than_s: float = 3600.0,
    run_lifecycles: bool = True,
    queued_grace_s: float = 600.0,
    fresh_grace_s: float = 0.0,
) -> dict[str, Any]:
    """Process missed commits, move aged checkpoints, clean stale temporary dirs.

    ``queued_grace_s``: a lifecycle run queued (scheduled/pending) for less than this is
    left to its worker; older, it is taken over like a run whose process died.
    ``fresh_grace_s``: a step committed less than this ago with no run yet is left to its
    event (see :func:`decide`). Off by default: right after an outage every commit without a
    run is a missed one, and the heartbeat lock already lets only one lifecycle work on a
    checkpoint; a grace only saves the redundant start when reconcile races a live event.
    """
    export_manifest_key()
    log = get_run_logger()
    base = load_config(config)
    cfg = with_hot_root(base, os.path.abspath(root)) if root else base
    out: dict[str, Any] = {"runs": {}}
    now = time.time()
    for run_id in Tier(cfg.hot).list_runs():
        run_path = layout.run_dir(cfg.hot.url, run_id)
        todo = unfinished_steps(run_path)
        busy = in_flight_lifecycles(run_id) if todo else {}
        born = commit_times(run_path) if todo else {}
        done = []
        for s in todo:
            runs = busy.get(s, [])
            action = decide(
                runs,
                heartbeat_alive(read_heartbeat(run_path, s)),
                queued_grace_s,
                commit_age_s=now - born.get(s, -math.inf),
                fresh_grace_s=fresh_grace_s,
            )
            log.info("%s step %d: lifecycle %s", run_id, s, action.value)
            if action in (Action.LEAVE_QUEUED, Action.LEAVE_RUNNING, Action.LEAVE_FRESH):
                continue
            for r in runs:  # TAKE_OVER: say so on the server, then do the work here
                mark_crashed(r.id, "reconcile: no live heartbeat from a process running this lifecycle")
            if run_lifecycles:
                done.append(_run_lifecycle(cfg, config, run_id, s))
        moved = age_moves(cfg, run_id, now)
        cleaned = [p for t in cfg.tiers() for p in Tier(t).clean_stale(run_id, older_than_s=tmp_older_than_s)]
        out["runs"][run_id] = {
            "unfinished": todo,
            "in_flight": sorted(busy),
            "processed": done,
            "moved": moved,
            "cleaned": cleaned,
        }
        log.info(
            "%s: %d unfinished, %d processed, %d moved, %d stale dirs removed",
            run_id,
            len(todo),
            len(done),
            len(moved),
            len(cleaned),
        )
    if cfg.warm is not None:
        try:
            out["nodes"] = _reconcile_nodes(cfg, config, queued_grace_s, run_lifecycles)
        except Exception as e:  # the node-local pass must not cost the hot runs' results above
            log.error("node-local checkpoints: %s: %s; the next reconcile retries", type(e).__name__, e)
            out["nodes"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def _reconcile_nodes(
    cfg: CkptflowConfig, config: str | None, queued_grace_s: float, run_lifecycles: bool
) -> dict[str, Any]:
    """Checkpoints saved on node-local roots: every node's worker first stages its part of any
    committed step warm lacks (a scan on its queue), then each such step whose lifecycle never
    finished runs it here — the same decision as for the hot tier's steps."""
    from ckptflow.flows.nodes import node_queues, scan_all, unfinished_node_steps

    log = get_run_logger()
    out: dict[str, Any] = {}
    if node_queues():
        log.info("node scans: %s", scan_all())
    for run_id, steps in unfinished_node_steps(cfg).items():
        records_path = layout.run_dir(cfg.warm.url, run_id) if cfg.warm is not None else ""
        busy = in_flight_lifecycles(run_id)
        done = []
        for s, nodes in steps:
            runs = busy.get(s, [])
            action = decide(runs, heartbeat_alive(read_heartbeat(records_path, s)), queued_grace_s)
            log.info("%s step %d (node-local): lifecycle %s", run_id, s, action.value)
            if action in (Action.LEAVE_QUEUED, Action.LEAVE_RUNNING, Action.LEAVE_FRESH):
                continue
            for r in runs:
                mark_crashed(r.id, "reconcile: no live heartbeat from a process running this lifecycle")
            if run_lifecycles:
                done.append(_run_lifecycle(cfg, config, run_id, s, scope="node", nodes=nodes))
        out[run_id] = {"unfinished": [s for s, _ in steps], "processed": done}
    return out


def _run_lifecycle(
    cfg: CkptflowConfig, config: str | None, run_id: str, step: int, *, scope: str = "", nodes: list[str] | None = None
) -> dict[str, Any]:
    # One failing lifecycle (a store down past its retries, a step pruned under it) must not
    # hold back the steps and runs after it: its own run failed and alerted; reconcile
    # records it and goes on, and the next pass retries it.
    run_path = layout.run_dir(cfg.hot.url, run_id)
    state = lifecycle(
        run_id=run_id,
        step=step,
        uri=layout.join(run_path, layout.step_name(step)),
        root=cfg.hot.url,
        config=config,
        scope=scope,
        nodes=",".join(nodes or []),
        return_state=True,
    )
    if state.is_completed():
        return {"step": step, "status": state.result().get("status")}
    get_run_logger().error("%s step %d: lifecycle ended %s; the next reconcile retries it", run_id, step, state.name)
    return {"step": step, "status": "failed", "state": state.name}
