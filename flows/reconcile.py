"""``reconcile(root)``: catch up on whatever the event path missed.

Runs on an interval. For every run on the hot tier:

1. **Unfinished commits** — a committed checkpoint (found on storage, or in the outbox)
   whose lifecycle has not finished (no ``pruned`` record and not quarantined): its
   event was lost while the server was down, or its flow crashed. The lifecycle runs
   again as a subflow; its stages skip what is already done. Steps whose lifecycle is
   running right now (a flow run in a non-final state) are left alone, so the event
   path and reconcile never do the same work twice.
2. **Age-based tier moves** — a checkpoint older than its tier's ``move_after_hours``
   that the next tier lacks is copied there (promote or archive).
3. **Stale ``.tmp``** — temporary dirs older than an hour are removed on every tier
   (a live save of the trainer is always younger).
"""

from __future__ import annotations

import os
import time
from typing import Any

from prefect import flow, get_run_logger

from ckptflow.flows.lifecycle import lifecycle, with_hot_root
from ckptflow.tasks import records
from ckptflow.tasks.config import CkptflowConfig, load_config
from ckptflow.tasks.storage import Tier
from ckptflow.trainer import commit, events, layout

def unfinished_steps(run_path: str) -> list[int]:
    """Committed (on storage or in the outbox) and no terminal lifecycle record."""
    on_disk = set(commit.committed_steps(run_path))
    outboxed = {int(x["step"]) for x in events.read_outbox(run_path) if "step" in x}
    out = []
    for s in sorted(on_disk | outboxed):
        st = records.status(run_path, s)
        if "pruned" in st or records.QUARANTINED in st:
            continue
        if s not in on_disk:
            continue  # in the outbox but gone from hot: nothing left to process here
        out.append(s)
    return out


def in_flight_lifecycles(run_id: str) -> dict[int, list[tuple[str, str, float]]]:
    """Steps of ``run_id`` with lifecycle flow runs pending, scheduled or running.

    Step -> [(flow run id, state type, seconds since it was created)], all of them: a
    step killed twice leaves two RUNNING runs behind, and each must be dealt with. Runs
    of no deployment (subflows of reconcile or of a script) count as RUNNING whatever
    their state: only a deployment's run can be queued for a worker.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterName,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    prefix = f"lifecycle-{run_id}-step"
    with get_client(sync_client=True) as c:
        runs = c.read_flow_runs(flow_run_filter=FlowRunFilter(
            name=FlowRunFilterName(like_=prefix),
            state=FlowRunFilterState(type=FlowRunFilterStateType(
                any_=[StateType.PENDING, StateType.SCHEDULED, StateType.RUNNING]))), limit=200)
    steps: dict[int, list[tuple[str, str, float]]] = {}
    now = time.time()
    for r in runs:
        tail = r.name[len(prefix):] if r.name.startswith(prefix) else ""
        if tail.isdigit():
            age = now - r.created.timestamp() if r.created else float("inf")
            # Only a deployment's run waits for a worker; a subflow run that is not RUNNING
            # belongs to a process that died between creating it and starting it.
            state = r.state_type.value if r.deployment_id else "RUNNING"
            steps.setdefault(int(tail), []).append((str(r.id), state, age))
    return steps


def mark_crashed(flow_run_id: str, why: str) -> None:
    """Tell the server a run whose process is gone has crashed (it cannot say so itself)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    try:
        with get_client(sync_client=True) as c:
            # Read back: a transition the server did not take would leave the run showing
            # RUNNING forever, which misleads people and the next reconcile alike.
            for attempt in range(3):
                res = c.set_flow_run_state(flow_run_id, Crashed(message=why), force=True)
                if c.read_flow_run(flow_run_id).state_type.value == "CRASHED":
                    return
                time.sleep(0.5 * (attempt + 1))
        get_run_logger().warning("flow run %s did not take the crashed state (%s)", flow_run_id,
                                 getattr(res, "status", None))
    except Exception as e:  # bookkeeping only: the lifecycle re-runs either way
        get_run_logger().warning("could not mark flow run %s crashed: %s", flow_run_id, e)


def age_moves(cfg: CkptflowConfig, run_id: str, now: float) -> list[dict[str, Any]]:
    """Copy checkpoints older than their tier's ``move_after_hours`` onto the next tier."""
    from ckptflow.tasks.transfer import archive, promote

    moved = []
    tiers = cfg.tiers()
    for cur, nxt in zip(tiers, tiers[1:]):
        if cur.move_after_hours is None:
            continue
        src, dst = Tier(cur), Tier(nxt)
        for s in src.committed_steps(run_id):
            if dst.is_committed(run_id, s) or src.is_quarantined(run_id, s):
                continue
            age_h = (now - src.read_manifest(run_id, s).created_at) / 3600
            if age_h < cur.move_after_hours:
                continue
            res = archive(src, dst, run_id, s) if nxt.is_s3 else promote(src, dst, run_id, s)
            moved.append({"step": s, "from": cur.name, "to": nxt.name, "bytes": res.bytes_stored})
    return moved


@flow(name="ckptflow-reconcile", flow_run_name="reconcile", log_prints=True)
def reconcile(root: str | None = None, config: str | None = None, tmp_older_than_s: float = 3600.0,
              run_lifecycles: bool = True, queued_grace_s: float = 600.0) -> dict[str, Any]:
    """Process missed commits, move aged checkpoints, clean stale temporary dirs.

    ``queued_grace_s``: a lifecycle run queued (scheduled/pending) for less than this is
    left to its worker; older, it is taken over like a run whose process died.
    """
    log = get_run_logger()
    base = load_config(config)
    cfg = with_hot_root(base, os.path.abspath(root)) if root else base
    hot = Tier(cfg.hot)
    out: dict[str, Any] = {"runs": {}}
    now = time.time()
    for run_id in hot.list_runs():
        run_path = layout.run_dir(cfg.hot.url, run_id)
        todo = unfinished_steps(run_path)
        busy = in_flight_lifecycles(run_id) if todo else {}
        done = []
        for s in todo:
            runs = busy.get(s, [])
            if any(state != "RUNNING" and age < queued_grace_s for _, state, age in runs):
                # queued (event-triggered, waiting for a worker slot): the worker will run it
                log.info("%s step %d: lifecycle queued, left alone", run_id, s)
                continue
            if runs:
                if records.heartbeat_alive(records.read_heartbeat(run_path, s)):
                    log.info("%s step %d: lifecycle already running, left alone", run_id, s)
                    continue
                # Running on the server but its process is gone (no live heartbeat: a killed
                # worker), or queued for longer than any worker would take: say so on the
                # server and take the work over.
                for fr_id, state, _ in runs:
                    log.warning("%s step %d: lifecycle run %s shows as %s but no process is running it; "
                                "marking it crashed and running the lifecycle again", run_id, s, fr_id,
                                state.lower())
                    mark_crashed(fr_id, "reconcile: no live heartbeat from a process running this lifecycle")
            log.info("%s step %d: committed but its lifecycle never finished; running it now", run_id, s)
            if run_lifecycles:
                # One failing lifecycle (a store down past its retries, a step pruned under it)
                # must not hold back the steps and runs after it: its own run failed and
                # alerted; reconcile records it and goes on, and the next pass retries it.
                state = lifecycle(run_id=run_id, step=s, uri=layout.join(run_path, layout.step_name(s)),
                                  root=cfg.hot.url, config=config, return_state=True)
                if state.is_completed():
                    done.append({"step": s, "status": state.result().get("status")})
                else:
                    log.error("%s step %d: lifecycle ended %s; the next reconcile retries it",
                              run_id, s, state.name)
                    done.append({"step": s, "status": "failed", "state": state.name})
        moved = age_moves(cfg, run_id, now)
        cleaned = []
        for t in cfg.tiers():
            cleaned += Tier(t).clean_stale(run_id, older_than_s=tmp_older_than_s)
        out["runs"][run_id] = {"unfinished": todo, "in_flight": sorted(busy), "processed": done,
                               "moved": moved, "cleaned": cleaned}
        log.info("%s: %d unfinished, %d processed, %d moved, %d stale dirs removed", run_id, len(todo),
                 len(done), len(moved), len(cleaned))
    return out
