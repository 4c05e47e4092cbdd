"""``restore_drill``: every night, prove the cold copies restore — and say so loudly if not.

Deployed on a cron schedule (``deployments/prefect.yaml``, or ``flows.serve``) and
runnable on demand (``ckptflow drill RUN``). For each run (or the one given): the
newest committed cold checkpoint and, by policy, one random older one are restored
into scratch, verified and loaded by a fresh torchrun job at another world size. The
result, timings and bytes go to a history file, a keyed markdown artifact and a PNG
plot; ``ckptflow.drill.completed`` or ``ckptflow.drill.failed`` is emitted, and a
failed drill fails the flow run.
"""

from __future__ import annotations

import os
import time
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from ckptflow.flows.alerts import notify_on_failure
from ckptflow.flows.emit import artifact_key, emit
from ckptflow.flows.secrets import export_manifest_key
from ckptflow.tasks.config import CkptflowConfig, load_config
from ckptflow.tasks.drill import append_history, drill_one, pick_steps, read_history
from ckptflow.tasks.report import drill_markdown, plot_drill, read_metrics
from ckptflow.tasks.storage import Tier
from ckptflow.trainer import events
from ckptflow.trainer.errors import CkptflowError, ConfigError
from ckptflow.trainer.format import layout


def drill_tier(cfg: CkptflowConfig) -> Tier:
    """Drills restore from the coldest tier: that is the copy of last resort."""
    return Tier(cfg.cold or cfg.warm or cfg.hot)


def default_history_dir(cfg: CkptflowConfig) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(cfg.hot.url)), "drills")


@task(name="restore", task_run_name="restore-{run_id}-{step}", retries=0)
def restore_task(
    cfg: CkptflowConfig, run_id: str, step: int, world_size: int | None, scratch_root: str | None
) -> dict[str, Any]:
    """Download, decompress, verify, sanity step at another world size; timed."""
    res = drill_one(drill_tier(cfg), run_id, step, world_size=world_size, scratch_root=scratch_root)
    log = get_run_logger()
    if res.ok:
        log.info(
            "%s step %d restored from %s in %.1f s (probe %s at world size %s)",
            run_id,
            step,
            res.tier,
            res.recovery_seconds,
            res.probe_match,
            res.world_size,
        )
    else:
        log.error("%s step %d: drill FAILED: %s", run_id, step, res.failure)
    return res.to_dict()


@flow(
    name="ckptflow-restore-drill",
    flow_run_name="drill-{run_id}",
    log_prints=True,
    on_failure=[notify_on_failure],
    on_crashed=[notify_on_failure],
)
def restore_drill(
    run_id: str | None = None,
    config: str | None = None,
    step: int | None = None,
    world_size: int | None = None,
    random_older: bool | None = None,
    history_dir: str | None = None,
    scratch_dir: str | None = None,
    seed: int | None = None,
) -> dict[str, Any]:
    """Restore cold checkpoints into scratch and prove them; fail the run if any does not."""
    export_manifest_key()
    cfg = load_config(config)
    tier = drill_tier(cfg)
    history_dir = history_dir or default_history_dir(cfg)
    runs = [layout.check_run_id(run_id)] if run_id else tier.list_runs()
    if not runs:
        raise ConfigError(f"no runs on the {tier.name} tier ({tier.url}): nothing to drill")
    out: dict[str, Any] = {"tier": tier.name, "runs": {}}
    failures = []
    for rid in runs:
        steps = (
            [step]
            if step is not None
            else pick_steps(
                tier, rid, random_older=cfg.drill.random_older if random_older is None else random_older, seed=seed
            )
        )
        if not steps:
            failures.append(f"{rid}: no committed checkpoint on the {tier.name} tier ({tier.url})")
            emit(events.DRILL_FAILED, rid, -1, {"reason": failures[-1], "drill_id": _drill_id()}, key=_drill_id())
            continue
        earlier = read_history(history_dir, rid)
        results = [restore_task(cfg, rid, s, world_size or cfg.drill.world_size, scratch_dir) for s in steps]
        for r in results:
            append_history(history_dir, _as_result(r))
        plot = _plot(cfg, rid, tier, results, history_dir)
        md = drill_markdown(rid, results, earlier, plot)
        _artifact(rid, md)
        for r in results:
            payload = {
                "run_id": rid,
                "step": r["step"],
                "uri": r["uri"],
                "ok": r["ok"],
                "recovery_seconds": r["recovery_seconds"],
                "failure": r["failure"],
                "drill_id": _drill_id(),
            }
            if r["ok"]:
                emit(events.DRILL_COMPLETED, rid, r["step"], payload, key=payload["drill_id"])
            else:
                failures.append(f"{rid} {layout.step_name(r['step'])} ({r['uri']}): {r['failure']}")
                emit(events.DRILL_FAILED, rid, r["step"], payload, key=payload["drill_id"])
        out["runs"][rid] = {"results": results, "plot": plot}
    out["ok"] = not failures
    if failures:
        # Failing the run makes the drill red in the UI; the alert itself comes from the
        # automation on ckptflow.drill.failed (one notification per failed drill).
        raise DrillFailed("restore drill failed: " + " | ".join(failures))
    return out


class DrillFailed(CkptflowError, RuntimeError):
    """A drill found a checkpoint that does not restore (the message names it)."""


def _drill_id() -> str:
    """One id per flow run, so the drill events of two nights are distinct."""
    try:
        from prefect.runtime import flow_run

        return str(flow_run.id or time.time())
    except Exception:
        return str(time.time())


def _as_result(d: dict[str, Any]):
    from ckptflow.tasks.drill import DrillResult

    keep = {k: v for k, v in d.items() if k in DrillResult.__dataclass_fields__}
    return DrillResult(**keep)


def _plot(cfg: CkptflowConfig, run_id: str, tier: Tier, results: list[dict], history_dir: str) -> str | None:
    try:
        rows = read_metrics(layout.run_dir(cfg.hot.url, run_id))  # read-only
        path = os.path.join(history_dir, f"{run_id}-drill-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.png")
        return plot_drill(path, run_id=run_id, rows=rows, checkpoint_steps=tier.committed_steps(run_id), drills=results)
    except Exception as e:  # a missing plot must not hide the drill's verdict
        get_run_logger().warning("drill plot failed: %s", e)
        return None


def _artifact(run_id: str, md: str) -> None:
    try:
        create_markdown_artifact(
            key=artifact_key("drill", run_id), markdown=md, description=f"restore drill of {run_id}"
        )
    except Exception as e:
        get_run_logger().warning("could not create the drill artifact: %s", e)
