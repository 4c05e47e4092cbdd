"""The lifecycle of a checkpoint saved on node-local hot roots: each node's part runs on that node.

A node's hot files are readable only on that node, so the work that reads them runs there:
every node has a work queue ``node-<node id>`` in the work pool and a worker started with
that node's config (``ckptflow worker``: it finds the node id on the hot root and serves that
queue). Prefect's automations cannot route a run to a queue; a flow can, with
``run_deployment(..., work_queue_name=...)`` — so the lifecycle (on any worker, it only needs
warm, cold and the API) fans the per-node part out:

1. **promote, per node**: :func:`node_part` (``action="stage"``) on every node stages the files
   that node wrote into warm's staging dir (``tasks/transfer/_parts.py``). The lifecycle waits
   for every part (``[lifecycle] node_part_timeout_s``); a node whose worker is down delays only
   its own part, and one whose queue no worker polled lately (a node gone or replaced) is not
   waited for. Files still missing after that are taken over by nodes that hold them as
   replicas; if none does, the lifecycle fails and says which files and nodes, and warm holds
   nothing committed (a later run, or reconcile, retries: staged parts are kept).
2. **commit on warm** once every file is staged and checks out (the rename).
3. **verify, once, on the complete warm copy**: fetched into scratch (every byte checked
   against the index and manifest), then the sanity step and the expectations.
4. **export** (``[export]``, off by default): the model as safetensors beside it on warm.
5. **archive** from warm (as for any checkpoint).
6. **prune**: warm and cold by their policies; every node's hot by hot's policy, on that node
   (``action="prune"``), never its copy of the newest globally committed step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from prefect import flow, get_run_logger

from ckptflow.flows.secrets import export_manifest_key
from ckptflow.tasks.checkpoint import CheckpointRef
from ckptflow.tasks.config import load_config
from ckptflow.tasks.stages import ARCHIVE, EXPORT, Done, Stage, fault_hook
from ckptflow.tasks.storage import Tier
from ckptflow.trainer import events
from ckptflow.trainer.errors import ConfigError

NODE_PART = "ckptflow-node-part/node-part"
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


UNCLAIMED = "UNCLAIMED"
"""A run no worker picked up within ``unclaimed_s`` (cancelled, so a late worker skips it)."""


def _wait(runs: dict[str, Any], timeout_s: float, *, unclaimed_s: float | None = None) -> dict[str, str]:
    """Poll the flow runs until every one is final or ``timeout_s`` passed; name -> state type.

    With ``unclaimed_s``: a run still SCHEDULED after that long has no live worker (workers poll
    every ~10 s); it is cancelled and reported ``UNCLAIMED`` instead of being waited for."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    t0 = time.monotonic()
    deadline = t0 + timeout_s
    states: dict[str, str] = {}
    with get_client(sync_client=True) as c:
        while runs:
            for name, fr in runs.items():
                if states.get(name) == UNCLAIMED:
                    continue
                st = c.read_flow_run(fr.id).state_type
                states[name] = st.value if st is not None else "UNKNOWN"
                if unclaimed_s is not None and states[name] == "SCHEDULED" and time.monotonic() - t0 > unclaimed_s:
                    try:
                        c.set_flow_run_state(fr.id, Cancelled(message=f"no worker claimed it in {unclaimed_s:.0f} s"))
                    except Exception:  # best effort: a late worker would only run an idempotent scan
                        pass
                    states[name] = UNCLAIMED
            if all(v in FINAL or v == UNCLAIMED for v in states.values()) or time.monotonic() > deadline:
                break
            time.sleep(1.0)
    return states


def queue_for(node: str) -> str:
    """The work queue of node ``node`` (its worker serves only that one)."""
    return f"node-{node}"


@flow(name="ckptflow-node-part", flow_run_name="node-part-{run_id}-step{step}-{node}-{action}", log_prints=True)
def node_part(
    run_id: str, step: int, node: str, action: str = "stage", take: list[str] | None = None, config: str | None = None
) -> dict[str, Any]:
    """One node's part of a checkpoint's lifecycle, on that node (``action``: stage or prune)."""
    export_manifest_key()
    from ckptflow.trainer.nodes.topology import node_id

    cfg = load_config(config)
    here = node_id(cfg.hot.url)
    if here != node:
        raise ConfigError(
            f"this worker's hot root {cfg.hot.url} is node {here}, not {node}: it serves queue "
            f"{queue_for(here)}; start each node's worker with that node's config"
        )
    if cfg.warm is None:
        raise ConfigError(f"{cfg.source}: node-local checkpoints need a warm tier: their parts are joined there")
    if action == "stage":
        from ckptflow.tasks.transfer._parts import stage_part

        res = stage_part(
            Tier(cfg.hot), Tier(cfg.warm), run_id, step, node=node, take=take or [], fault=fault_hook(step)
        )
        get_run_logger().info("node %s: %s step %d part %s (%d files)", node, run_id, step, res.status, len(res.files))
        return asdict(res)
    if action == "prune":
        return prune_node(CheckpointRef(cfg, run_id, step, records_tier="warm"))
    if action == "scan":
        return scan_node(cfg, node)
    raise ConfigError(f"node_part action={action!r}; choose stage, prune or scan")


def scan_node(cfg: Any, node: str) -> dict[str, Any]:
    """Reconcile, on this node: stage this node's part of every committed node-local checkpoint
    whose lifecycle never finished (its event lost, or the lifecycle failed before this part),
    so the warm side of reconcile can finish it. Returns run -> steps staged."""
    from ckptflow.tasks.stages import finished
    from ckptflow.tasks.transfer._parts import stage_part
    from ckptflow.trainer.format import layout
    from ckptflow.trainer.format.manifest import PLACEMENT

    hot, warm = Tier(cfg.hot), Tier(cfg.warm)
    out: dict[str, Any] = {}
    for run_id in hot.list_runs():
        for s in hot.committed_steps(run_id):
            if warm.is_committed(run_id, s) or finished(layout.run_dir(warm.url, run_id), s):
                continue
            try:
                pl = hot.read_manifest(run_id, s).extra.get(PLACEMENT) or {}
            except Exception as e:  # a damaged copy here: the other nodes' parts or replicas decide
                get_run_logger().warning("node %s: %s step %d unreadable here (%s)", node, run_id, s, e)
                continue
            if pl.get("scope") != "node":
                continue
            res = stage_part(hot, warm, run_id, s, node=node, fault=fault_hook(s))
            out.setdefault(run_id, []).append({"step": s, "status": res.status, "files": len(res.files)})
    return out


def node_pool() -> str:
    """The work pool the node-part deployment runs in (``ckptflow deploy --pool``)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        try:
            return c.read_deployment_by_name(NODE_PART).work_pool_name or "ckptflow-pool"
        except Exception:  # not deployed: no node workers to ask either
            return "ckptflow-pool"


def _polled_ago(pool: str) -> dict[str, float | None]:
    """Every node with a queue in the pool (``node-<id>``) -> seconds since a worker polled it
    (None: never)."""
    from datetime import UTC, datetime

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        try:
            qs = c.read_work_queues(work_pool_name=pool)
        except Exception:  # no such pool: no node workers
            return {}
    now = datetime.now(UTC)
    return {
        q.name[len("node-") :]: (now - q.last_polled).total_seconds() if q.last_polled is not None else None
        for q in qs
        if q.name.startswith("node-")
    }


def _fresh(ago: float | None, within_s: float | None) -> bool:
    return within_s is None or (ago is not None and ago <= within_s)


def node_queues(pool: str = "ckptflow-pool", *, polled_within_s: float | None = None) -> list[str]:
    """The nodes that have a queue in the pool: every node a worker was ever started for — or,
    with ``polled_within_s``, only those whose queue a worker polled that recently (workers
    poll every ~10 s)."""
    return sorted(n for n, ago in _polled_ago(pool).items() if _fresh(ago, polled_within_s))


NO_WORKER = "NO_WORKER"
"""A node's scan state when no worker polled its queue lately (a node gone or replaced)."""
SKIPPED = "SKIPPED"
"""A node not asked to prune a step whose promote part it did not finish (taken over from replicas)."""


def scan_all(
    timeout_s: float = 300.0,
    pool: str | None = None,
    polled_within_s: float | None = 90.0,
    unclaimed_s: float = 30.0,
) -> dict[str, str]:
    """Reconcile's per-node half: a scan on every node's queue (``scan_node``), waited for.

    A replaced or stopped node leaves its queue behind, and a scan there held every reconcile
    for ``timeout_s`` (seen: +270 s per pass). So only queues a worker polled in the last
    ``polled_within_s`` get a scan (the others report ``NO_WORKER``), and a scan no worker
    claims within ``unclaimed_s`` is given up (``UNCLAIMED``). Those nodes' steps are still
    finished by the per-step pass (their parts are taken over from the peers' replicas)."""
    from prefect.deployments import run_deployment

    ago = _polled_ago(pool or node_pool())  # one read of the queues for both lists
    live = sorted(n for n, a in ago.items() if _fresh(a, polled_within_s))
    runs = {
        n: run_deployment(
            NODE_PART,
            parameters={"run_id": "scan", "step": 0, "node": n, "action": "scan"},
            work_queue_name=queue_for(n),
            timeout=0,
        )
        for n in live
    }
    states = _wait(runs, timeout_s, unclaimed_s=unclaimed_s) if runs else {}
    states.update(dict.fromkeys(sorted(set(ago) - set(live)), NO_WORKER))
    return states


def unfinished_node_steps(cfg: Any) -> dict[str, list[tuple[int, list[str]]]]:
    """Node-local checkpoints some node has staged a part of, whose lifecycle never finished:
    run -> [(step, the nodes that committed it)]."""
    from ckptflow.tasks import records
    from ckptflow.tasks.stages import finished
    from ckptflow.tasks.transfer._parts import parts_status
    from ckptflow.trainer.format import layout

    if cfg.warm is None:
        return {}
    warm = Tier(cfg.warm)
    out: dict[str, list[tuple[int, list[str]]]] = {}
    for run_id in warm.list_runs():
        run_path = layout.run_dir(warm.url, run_id)
        if not os.path.isdir(run_path):
            continue  # a stray file where a run would be: nothing of ours to finish
        for s in records.steps_with_records(run_path):
            if finished(run_path, s):
                continue
            st = parts_status(warm, run_id, s)
            if st.manifest is None:
                continue
            nodes = [str(n.get("node")) for n in (st.manifest.extra.get("placement") or {}).get("nodes", [])]
            out.setdefault(run_id, []).append((s, nodes))
    return out


def prune_node(ref: CheckpointRef) -> dict[str, Any]:
    """This node's hot copy of the run, by hot's policy: what the furthest tier does not hold yet,
    and this node's copy of the newest globally committed step (``latest``), are kept."""
    from ckptflow.tasks.prune import prune_run

    rep = prune_run(ref.cfg, ref.run_id, tiers=["hot"], records_run_path=ref.records_path)["hot"]
    return {"deleted": rep.deleted, "kept": {str(k): v for k, v in rep.kept.items()}, "errors": rep.errors}


def fan_out(
    action: str,
    ref: CheckpointRef,
    nodes: list[str],
    *,
    timeout_s: float,
    take: dict[str, list[str]] | None = None,
    polled_within_s: float | None = 90.0,
) -> dict[str, str]:
    """Run ``node_part(action)`` on each node's queue and wait (at most ``timeout_s``) for all;
    returns node -> final state type (``SCHEDULED``/``PENDING``/``RUNNING`` when it timed out).

    A node whose queue a worker polled once but not in the last ``polled_within_s`` (workers
    poll every ~10 s) is gone or replaced: it gets no run and reports ``NO_WORKER`` at once, so its files
    are taken over from replicas now instead of after the whole part timeout (30 min by
    default)."""
    from prefect.deployments import run_deployment

    ago = _polled_ago(node_pool()) if polled_within_s is not None else {}
    # Only a queue polled once and then not for a while: a queue never polled may be a worker
    # still starting, which the part timeout waits for as it always did.
    gone = [n for n in nodes if polled_within_s is not None and (ago.get(n) or 0.0) > polled_within_s]
    runs: dict[str, Any] = {}
    for node in nodes:
        if node in gone:
            continue
        params = {"run_id": ref.run_id, "step": ref.step, "node": node, "action": action}
        if take and take.get(node):
            params["take"] = take[node]
        runs[node] = run_deployment(NODE_PART, parameters=params, work_queue_name=queue_for(node), timeout=0)
    states = _wait(runs, timeout_s) if runs else {}
    states.update(dict.fromkeys(gone, NO_WORKER))
    return states


def node_promote(
    ref: CheckpointRef, nodes: list[str], *, fan: Callable[..., dict[str, str]] | None = None, log: Any = None
) -> dict[str, Any]:
    """Steps 1-2 of the module docstring; raises ``IncompleteError`` when a file cannot be had. ``fan``: how the
    nodes' parts are run (:func:`fan_out`'s signature; by default, it: each on its node's queue); ``log``: by
    default the flow run's logger."""
    from ckptflow.tasks.transfer._parts import IncompleteError, commit_parts, parts_status

    log = log or get_run_logger()
    run_parts = fan or fan_out
    warm = ref.tier("warm")
    timeout = ref.cfg.lifecycle.node_part_timeout_s
    states: dict[str, str] = {}
    if not warm.is_committed(ref.run_id, ref.step):
        states = run_parts("stage", ref, nodes, timeout_s=timeout)
        st = parts_status(warm, ref.run_id, ref.step)
        late = [n for n, s in states.items() if s != "COMPLETED"]
        if st.manifest is None:
            raise IncompleteError(
                f"{ref.name}: no node staged its part within {timeout:.0f} s (part states {states}); "
                "nothing was committed on warm — the next lifecycle run (or reconcile) retries once "
                "those nodes' workers answer"
            )
        if st.missing:
            log.warning(
                "%s: parts of nodes %s not in after %.0f s (%s); taking over %d file(s) from replicas",
                ref.name,
                late,
                timeout,
                states,
                len(st.missing),
            )
            take: dict[str, list[str]] = {}
            for name, holders in st.holders.items():
                live = [h for h in holders if states.get(h) == "COMPLETED"]
                if live:
                    take.setdefault(live[0], []).append(name)
            if take:
                states.update(
                    {
                        f"{n} (take-over)": s
                        for n, s in run_parts("stage", ref, list(take), timeout_s=timeout, take=take).items()
                    }
                )
            st = parts_status(warm, ref.run_id, ref.step)
            if st.missing:
                raise IncompleteError(
                    f"{ref.name}: {len(st.missing)} file(s) can be had from no node that answered "
                    f"({', '.join(st.missing[:4])}); part states {states}; nothing was committed on warm — "
                    "the next lifecycle run (or reconcile) retries once those nodes' workers are back"
                )
    res = commit_parts(warm, ref.run_id, ref.step, fault=fault_hook(ref.step))
    body = asdict(res)
    body.update(ratio=res.ratio, tier="warm", nodes=nodes, part_states=states)
    return body


# ---- the stage table of a node-local checkpoint ---------------------------------------------


def _promote(ref: CheckpointRef) -> Done:
    return Done(node_promote(ref, list(ref.nodes)))


def _verify_warm(ref: CheckpointRef) -> Done:
    """Verify, once, on the complete warm copy: fetched into scratch — every byte checked against
    the index and the manifest — then integrity, the sanity step and the expectations."""
    import os
    import shutil
    import tempfile

    from ckptflow.tasks.transfer import fetch
    from ckptflow.tasks.verify import verify
    from ckptflow.trainer.format import layout

    lc = ref.cfg.lifecycle
    scratch = tempfile.mkdtemp(prefix="ckptflow-verify-")
    try:
        dst = os.path.join(scratch, layout.step_name(ref.step))
        fetch(ref.tier("warm"), ref.run_id, ref.step, dst)
        out = verify(
            ref,
            sanity_step=lc.sanity_step,
            expectations=bool(lc.expectations),
            max_norm_change=lc.max_norm_change,
            ckpt_dir=dst,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return Done(out.to_dict(), ok=out.ok)


def _prune(ref: CheckpointRef) -> Done:
    """Warm and cold by their policies (here); every node's hot on that node, not waited for long:
    a node that is down prunes at its next lifecycle. A node whose promote part did not come in is not
    asked at all (a node that is gone would hold every lifecycle here for the whole wait)."""
    from ckptflow.tasks import records
    from ckptflow.tasks.prune import prune_run

    t0 = time.perf_counter()
    tiers = {}
    for name, rep in prune_run(
        ref.cfg, ref.run_id, tiers=[t for t in ("warm", "cold") if ref.has(t)], records_run_path=ref.records_path
    ).items():
        tiers[name] = {
            "kept": {str(k): v for k, v in rep.kept.items()},
            "deleted": rep.deleted,
            "planned": rep.planned,
            "errors": {str(k): v for k, v in rep.errors.items()},
        }
    promoted = records.read_record(ref.records_path, ref.step, NODE_PROMOTE.record) or {}
    late = {n for n, st in (promoted.get("part_states") or {}).items() if n in ref.nodes and st != "COMPLETED"}
    asked = [n for n in ref.nodes if n not in late]
    states = fan_out("prune", ref, asked, timeout_s=min(120.0, ref.cfg.lifecycle.node_part_timeout_s)) if asked else {}
    states.update(dict.fromkeys(late, SKIPPED))
    return Done({"tiers": tiers, "nodes": states, "dry_run": False, "seconds": time.perf_counter() - t0})


NODE_PROMOTE = Stage("promote", "promoted", "P", events.PROMOTED, "warm", _promote)
NODE_VERIFY = Stage("verify", "verified", "V", events.VERIFIED, None, _verify_warm, (5.0,))
NODE_PRUNE = Stage("prune", "pruned", "R", events.PRUNED, None, _prune, (5.0,))
NODE_STAGES: tuple[Stage, ...] = (NODE_PROMOTE, NODE_VERIFY, EXPORT, ARCHIVE, NODE_PRUNE)
"""The lifecycle of a checkpoint saved on node-local roots: promote (per node, joined on warm)
comes first, because no single hot root holds the whole checkpoint to verify; the sanity step
and the expectations then run once, on the complete warm copy. Record names are the usual ones."""
