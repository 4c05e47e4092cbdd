"""``lifecycle(run_id, step, uri)``: what happens to every committed checkpoint.

    verify -> compress -> promote (warm) -> export (warm, if configured) -> archive (cold, S3) -> prune (every tier)

Triggered by ``ckptflow.checkpoint.committed`` (see ``deployments/prefect.yaml``) or by
the reconcile flow for commits whose event was lost. The stages are the table of
``ckptflow.tasks.stages``; each runs as one Prefect task (:func:`stage_task`) through
``run_stage``: a stage whose write-once record exists is skipped, so a second run — or
one after a crash half-way — finishes only what is left. A checkpoint that fails
verification is quarantined and goes no further.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from ckptflow.flows.emit import artifact_key, emit
from ckptflow.flows.limits import machine_slot
from ckptflow.flows.secrets import export_manifest_key
from ckptflow.tasks.checkpoint import CheckpointRef
from ckptflow.tasks.config import load_config
from ckptflow.tasks.heartbeat import Heartbeat, LifecycleBusy
from ckptflow.tasks.stages import STAGES, Stage, StageRecord, run_stage_forked
from ckptflow.trainer import events
from ckptflow.trainer.errors import ConfigError
from ckptflow.trainer.format import layout

FLOW_RUN_NAME = "lifecycle-{run_id}-step{step}"
"""How the lifecycle's flow runs are named; reconcile finds a step's runs by it."""


def run_name_prefix(run_id: str) -> str:
    return FLOW_RUN_NAME.split("{step}")[0].format(run_id=run_id)


@task(task_run_name="{stage.name}-{ref.run_id}-{ref.step}", cache_policy=NO_CACHE)
def stage_task(stage: Stage, ref: CheckpointRef) -> StageRecord | None:
    """One stage of one checkpoint (record-checked; see ``run_stage``)."""
    rec = run_stage_forked(stage, ref)  # in the worker's fork server when it has one
    log = get_run_logger()
    if rec is None:
        log.info("%s: no %s tier configured, skipped", stage.name, stage.tier)
    elif not rec.ok:
        log.error("%s step %d QUARANTINED: %s", ref.run_id, ref.step, "; ".join(rec.reasons))
    else:
        log.info(
            "%s step %d %s%s (%.1f s)",
            ref.run_id,
            ref.step,
            rec.record,
            " (record existed)" if rec.skipped else "",
            rec.seconds,
        )
    return rec


def run_stage_task(stage: Stage, ref: CheckpointRef) -> StageRecord | None:
    """``stage_task`` with the stage's own name and retries."""
    return stage_task.with_options(
        name=stage.name, retries=len(stage.retry_delays_s), retry_delay_seconds=list(stage.retry_delays_s)
    )(stage, ref)


@flow(name="ckptflow-lifecycle", flow_run_name=FLOW_RUN_NAME, log_prints=True)
def lifecycle(
    run_id: str,
    step: int,
    uri: str = "",
    root: str | None = None,
    config: str | None = None,
    scope: str = "",
    nodes: str = "",
) -> dict[str, Any]:
    """Verify, compress, promote, archive and prune one committed checkpoint.

    ``scope="node"`` (the commit event says so): saved on node-local hot roots by the nodes in
    ``nodes`` (comma-separated ids); each node's part runs on that node's queue
    (``flows/nodes.py``) and the records live on warm.
    """
    export_manifest_key()
    if scope == "node":
        from ckptflow.flows.nodes import NODE_STAGES

        cfg = load_config(config)
        if cfg.warm is None:
            raise ConfigError(
                f"{cfg.source}: {run_id} step {step} was saved on node-local hot roots; its parts "
                "are joined on the warm tier, and none is configured"
            )
        ref = CheckpointRef(cfg, run_id, int(step), records_tier="warm", nodes=tuple(n for n in nodes.split(",") if n))
        table = NODE_STAGES
    else:
        ref = CheckpointRef.of(run_id, step, config=config, root=root, uri=uri)
        table = STAGES
    try:
        with Heartbeat(ref.records_path, ref.step, owner={"flow_run_id": _flow_run_id()}):
            return _stages(ref, table)
    except LifecycleBusy as e:
        # The event's run and reconcile's can race for one checkpoint: one does the work.
        get_run_logger().info("%s step %d: %s", run_id, step, e)
        return {"run_id": run_id, "step": int(step), "status": "running elsewhere", "owner": e.owner}


def _flow_run_id() -> str | None:
    try:
        from prefect.runtime import flow_run

        return str(flow_run.id) if flow_run.id else None
    except Exception:
        return None


def _stages(ref: CheckpointRef, table: tuple[Stage, ...] = STAGES) -> dict[str, Any]:
    t0 = time.perf_counter()
    out: dict[str, Any] = {"run_id": ref.run_id, "step": ref.step, "uri": ref.uri}
    rows = []
    for stage in table:
        with machine_slot(stage.name):  # this machine's sanity / upload limit (flows/limits.py)
            rec = run_stage_task(stage, ref)
        out[stage.name] = rec.as_dict() if rec is not None else None
        rows.append(_row(stage, rec))
        if rec is None:
            continue
        if not rec.ok:
            emit(events.FAILED, ref.run_id, ref.step, {"reasons": rec.reasons, "uri": ref.uri})
            out["status"] = "quarantined"
            _artifact(ref, rows, "quarantined")
            return out
        if rec.body.get("proven") is False:  # bytes verified, the sanity step could not run: carried on, said
            out["proven"] = False
            emit(events.UNPROVEN, ref.run_id, ref.step, {"reason": rec.body.get("not_proven"), "uri": ref.uri})
        if stage.event is not None and rec.body.get("exported", True):  # no event for an export not made
            emit(stage.event, ref.run_id, ref.step, _payload(stage, rec, ref))
    out["status"] = "done"
    out["seconds"] = time.perf_counter() - t0
    _artifact(ref, rows, f"done in {out['seconds']:.1f} s")
    return out


def _payload(stage: Stage, rec: StageRecord, ref: CheckpointRef) -> dict[str, Any]:
    if "tiers" in rec.body:  # prune: what went, per tier
        return {"deleted": {t: r["deleted"] for t, r in rec.body["tiers"].items()}}
    if "index" in rec.body:  # export: where an evaluation job finds the model
        b = rec.body
        keys = ("location", "index", "cold", "dtype", "tensors", "bytes", "shards")
        return {"run_id": ref.run_id, "step": ref.step, **{k: b[k] for k in keys if k in b}}
    return {
        "uri": rec.body.get("uri", ref.uri),
        "tier": stage.tier or ref.records_tier,
        "seconds": rec.seconds,
        **({"nodes": list(ref.nodes)} if ref.nodes else {}),
    }


def _row(stage: Stage, rec: StageRecord | None) -> tuple[str, str, str, str, str]:
    if rec is None:
        return (stage.name, "not configured", "", "", "")
    b = rec.body
    if not rec.ok:
        return (stage.name, "QUARANTINED: " + "; ".join(rec.reasons)[:300], "", "", f"{rec.seconds:.2f}")
    if "tiers" in b:
        deleted = ", ".join(f"{t}: {r['deleted'] or 'none'}" for t, r in b["tiers"].items())
        return (stage.name, "deleted " + deleted, "", "", f"{rec.seconds:.2f}")
    raw, stored = b.get("bytes_raw", 0) or b.get("integrity", {}).get("bytes", 0), b.get("bytes_stored", 0)
    ratio = f"{raw / stored:.3f}x" if stored else ""
    status = "skipped (done before)" if rec.skipped else "ok"
    if b.get("proven") is False:
        status += f", NOT PROVEN: {b.get('not_proven')}"[:300]
    return (
        stage.name,
        status,
        f"{raw:,} -> {stored:,}" if stored else (f"{raw:,}" if raw else ""),
        ratio,
        f"{rec.seconds:.2f}",
    )


def _markdown(ref: CheckpointRef, rows: list[tuple[str, str, str, str, str]], verdict: str) -> str:
    lines = [
        f"# {ref.run_id} {layout.step_name(ref.step)}: {verdict}",
        "",
        "| stage | result | bytes (raw -> stored) | ratio | seconds |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows]
    return "\n".join(lines)


def _artifact(ref: CheckpointRef, rows: list, verdict: str) -> None:
    try:
        create_markdown_artifact(
            key=artifact_key("lifecycle", ref.run_id, ref.step),
            markdown=_markdown(ref, rows, verdict),
            description=f"lifecycle of {ref.run_id} step {ref.step}",
        )
    except Exception as e:  # a report must never fail the lifecycle itself
        get_run_logger().warning("could not create the lifecycle artifact: %s", e)
