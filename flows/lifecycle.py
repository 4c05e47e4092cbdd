"""``lifecycle(run_id, step, uri)``: what happens to every committed checkpoint.

    verify -> compress -> promote (warm) -> archive (cold, S3) -> prune (every tier)

Triggered by ``ckptflow.checkpoint.committed`` (see ``deployments/prefect.yaml``) or by
the reconcile flow for commits whose event was lost. Every stage is idempotent and
writes its write-once record (``<hot run>/_lifecycle/step_N/<stage>.json``) only after
its work is durable, so a second run — or one after a crash half-way — skips what is
done and finishes the rest. A checkpoint that fails verification is quarantined and
goes no further.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from ckptflow.flows import events as fev
from ckptflow.flows.stages import archive_stage, compress_stage, promote_stage, prune_stage
from ckptflow.tasks import records
from ckptflow.tasks.config import CkptflowConfig, load_config
from ckptflow.tasks.verify import verify_stage
from ckptflow.trainer import layout


def hot_root_for(cfg: CkptflowConfig, uri: str, root: str | None) -> str:
    """The trainer's root for this checkpoint: the event's, else derived from the uri."""
    if root:
        return os.path.abspath(root)
    if uri and not uri.startswith(("s3://", "gs://")):
        return os.path.dirname(os.path.dirname(os.path.abspath(uri)))
    return cfg.hot.url


def with_hot_root(cfg: CkptflowConfig, root: str) -> CkptflowConfig:
    if os.path.abspath(cfg.hot.url) == root:
        return cfg
    return dataclasses.replace(cfg, hot=dataclasses.replace(cfg.hot, url=root))


@task(name="verify", retries=1, retry_delay_seconds=5, task_run_name="verify-{run_id}-{step}")
def verify_task(run_path: str, run_id: str, step: int, cfg: CkptflowConfig) -> dict[str, Any]:
    """Integrity, restore sanity step and expectations; quarantine on failure."""
    lc = cfg.lifecycle
    out = verify_stage(run_path, step, sanity_step=lc.sanity_step, expectations=lc.expectations,
                       max_norm_change=lc.max_norm_change)
    log = get_run_logger()
    if out.ok:
        log.info("step %d verified%s (%.1f s)", step, " (record existed)" if out.skipped else "", out.seconds)
    else:
        log.error("step %d QUARANTINED: %s", step, "; ".join(out.reasons))
    return out.to_dict()


def _markdown(run_id: str, step: int, rows: list[tuple[str, str, str, str, str]], verdict: str) -> str:
    lines = [f"# {run_id} {layout.step_name(step)}: {verdict}", "",
             "| stage | result | bytes (raw -> stored) | ratio | seconds |", "|---|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows]
    return "\n".join(lines)


def _row(stage: str, res: dict[str, Any] | None) -> tuple[str, str, str, str, str]:
    if res is None:
        return (stage, "not configured", "", "", "")
    raw, stored = res.get("bytes_raw", 0), res.get("bytes_stored", 0)
    ratio = f"{raw / stored:.3f}x" if stored else ""
    status = "skipped (done before)" if res.get("skipped") else res.get("status", "done")
    return (stage, status, f"{raw:,} -> {stored:,}" if raw else "", ratio, f"{res.get('seconds', 0):.2f}")


@flow(name="ckptflow-lifecycle", flow_run_name="lifecycle-{run_id}-step{step}", log_prints=True)
def lifecycle(run_id: str, step: int, uri: str = "", root: str | None = None,
              config: str | None = None) -> dict[str, Any]:
    """Verify, compress, promote, archive and prune one committed checkpoint."""
    t0 = time.perf_counter()
    layout.check_run_id(run_id)
    base = load_config(config)
    cfg = with_hot_root(base, hot_root_for(base, uri, root))
    run_path = layout.run_dir(cfg.hot.url, run_id)
    with records.Heartbeat(run_path, step, owner={"flow_run_id": _flow_run_id()}):
        return _stages(cfg, run_path, run_id, step, uri, t0)


def _flow_run_id() -> str | None:
    try:
        from prefect.runtime import flow_run

        return str(flow_run.id) if flow_run.id else None
    except Exception:
        return None


def _stages(cfg: CkptflowConfig, run_path: str, run_id: str, step: int, uri: str, t0: float) -> dict[str, Any]:
    out: dict[str, Any] = {"run_id": run_id, "step": step, "uri": uri or layout.join(run_path, layout.step_name(step))}

    v = verify_task(run_path, run_id, step, cfg)
    out["verify"] = v
    rows = [("verify", "ok" if v["ok"] else "QUARANTINED: " + "; ".join(v["reasons"])[:300],
             f"{v.get('integrity', {}).get('bytes', 0):,}", "", f"{v.get('seconds', 0):.2f}")]
    if not v["ok"]:
        fev.emit(fev.FAILED, run_id, step, {"reasons": v["reasons"], "uri": out["uri"]})
        out["status"] = "quarantined"
        _artifact(run_id, step, rows, "quarantined")
        return out
    fev.emit(fev.VERIFIED, run_id, step, {"uri": out["uri"], "seconds": v.get("seconds")})

    out["compress"] = compress_stage(cfg, run_path, run_id, step)
    rows.append(_row("compress", out["compress"]))
    out["promote"] = promote_stage(cfg, run_path, run_id, step)
    rows.append(_row("promote", out["promote"]))
    if out["promote"] is not None:
        fev.emit(fev.PROMOTED, run_id, step, {"uri": out["promote"]["uri"], "tier": "warm"})
    out["archive"] = archive_stage(cfg, run_path, run_id, step)
    rows.append(_row("archive", out["archive"]))
    if out["archive"] is not None:
        fev.emit(fev.ARCHIVED, run_id, step, {"uri": out["archive"]["uri"], "tier": "cold"})
    out["prune"] = prune_stage(cfg, run_path, run_id, step)
    deleted = {t: r["deleted"] for t, r in out["prune"]["tiers"].items()}
    rows.append(("prune", "deleted " + ", ".join(f"{t}: {d or 'none'}" for t, d in deleted.items()),
                 "", "", f"{out['prune'].get('seconds', 0):.2f}"))
    fev.emit(fev.PRUNED, run_id, step, {"deleted": deleted})
    out["status"] = "done"
    out["seconds"] = time.perf_counter() - t0
    _artifact(run_id, step, rows, f"done in {out['seconds']:.1f} s")
    return out


def _artifact(run_id: str, step: int, rows: list, verdict: str) -> None:
    key = f"lifecycle-{run_id}-{step}".lower().replace("_", "-").replace(".", "-")
    try:
        create_markdown_artifact(key=key, markdown=_markdown(run_id, step, rows, verdict),
                                 description=f"lifecycle of {run_id} step {step}")
    except Exception as e:  # a report must never fail the lifecycle itself
        get_run_logger().warning("could not create the lifecycle artifact: %s", e)


def stage_status(run_path: str, step: int) -> dict[str, Any]:
    """Records present for a step (for ``ckptflow ls`` and reconcile)."""
    return records.status(run_path, step)
