"""The lifecycle's storage stages as Prefect tasks: record-checked, retried, leased.

Each stage: if its record exists, return it (idempotent re-run); else do the storage
action (itself idempotent: a re-run after a crash uploads or copies nothing twice),
then write the record. I/O stages retry with growing delays — transient S3 or NFS
errors are the common case, and every action is safe to repeat.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from prefect import get_run_logger, task

from ckptflow.tasks import records
from ckptflow.tasks.config import CkptflowConfig
from ckptflow.tasks.prune import prune_run, unsafe_on_hot  # noqa: F401 - unsafe_on_hot: moved there, kept importable
from ckptflow.tasks.storage import Tier, acquire_lease
from ckptflow.tasks.transfer import archive, compress, promote

IO_RETRIES = dict(retries=3, retry_delay_seconds=[1, 5, 15])


def fault_hook(step: int):
    """Route the transfer's phase callbacks to ``CKPTFLOW_FAULT`` (chaos drills, tests).

    A phase such as ``archive:uploaded:__0_0.distcp`` becomes ``archive.uploaded``, so
    ``CKPTFLOW_FAULT=archive.uploaded@4`` kills the process after step 4's first upload.
    """
    from ckptflow.trainer import faults

    def hook(phase: str) -> None:
        faults.maybe_crash(".".join(phase.split(":")[:2]), step)

    return hook


def _result(res: Any, **extra: Any) -> dict[str, Any]:
    d = dataclasses.asdict(res) if dataclasses.is_dataclass(res) else dict(res)
    if hasattr(res, "ratio"):
        d["ratio"] = res.ratio
    d.update(extra)
    return d


def _recorded(run_path: str, step: int, stage: str) -> dict[str, Any] | None:
    rec = records.read_record(run_path, step, stage)
    return dict(rec, skipped=True) if rec is not None else None


@task(name="compress", task_run_name="compress-{run_id}-{step}", **IO_RETRIES)
def _compress(cfg: CkptflowConfig, run_path: str, run_id: str, step: int) -> dict[str, Any]:
    if (rec := _recorded(run_path, step, "compressed")) is not None:
        return rec
    res = compress(Tier(cfg.hot), Tier(cfg.warm), run_id, step, threads=cfg.warm.codec_threads,
                   fault=fault_hook(step))
    return records.write_record(run_path, step, "compressed", _result(res, tier="warm"))


def compress_stage(cfg: CkptflowConfig, run_path: str, run_id: str, step: int) -> dict[str, Any] | None:
    """Stage the checkpoint in the warm tier's stored form (its codec); None: no warm tier."""
    if cfg.warm is None:
        return None
    return _compress(cfg, run_path, run_id, step)


@task(name="promote", task_run_name="promote-{run_id}-{step}", **IO_RETRIES)
def _promote(cfg: CkptflowConfig, run_path: str, run_id: str, step: int) -> dict[str, Any]:
    if (rec := _recorded(run_path, step, "promoted")) is not None:
        return rec
    hot = Tier(cfg.hot)
    with acquire_lease(hot, run_id, step, holder="promote", ttl_s=3600):
        res = promote(hot, Tier(cfg.warm), run_id, step, threads=cfg.warm.codec_threads,
                      fault=fault_hook(step))
    return records.write_record(run_path, step, "promoted", _result(res, tier="warm"))


def promote_stage(cfg: CkptflowConfig, run_path: str, run_id: str, step: int) -> dict[str, Any] | None:
    """Copy hot -> warm, verify every stored byte, commit by rename; None: no warm tier."""
    if cfg.warm is None:
        return None
    return _promote(cfg, run_path, run_id, step)


@task(name="archive", task_run_name="archive-{run_id}-{step}", **IO_RETRIES)
def _archive(cfg: CkptflowConfig, run_path: str, run_id: str, step: int) -> dict[str, Any]:
    if (rec := _recorded(run_path, step, "archived")) is not None:
        return rec
    # From warm when it has the checkpoint (its stored form is reused as-is when the
    # codecs match, and the hot NVMe is left to training), else straight from hot.
    src = Tier(cfg.warm) if cfg.warm is not None and Tier(cfg.warm).is_committed(run_id, step) else Tier(cfg.hot)
    with acquire_lease(src, run_id, step, holder="archive", ttl_s=6 * 3600):
        res = archive(src, Tier(cfg.cold), run_id, step, fault=fault_hook(step))
    return records.write_record(run_path, step, "archived", _result(res, tier="cold", source=src.name))


def archive_stage(cfg: CkptflowConfig, run_path: str, run_id: str, step: int) -> dict[str, Any] | None:
    """Upload to the S3 tier, marker last; None: no cold tier."""
    if cfg.cold is None:
        return None
    return _archive(cfg, run_path, run_id, step)


@task(name="prune", task_run_name="prune-{run_id}-{step}", retries=1, retry_delay_seconds=5)
def _prune(cfg: CkptflowConfig, run_path: str, run_id: str, step: int, dry_run: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    log = get_run_logger()
    out: dict[str, Any] = {"tiers": {}, "dry_run": dry_run}
    for name, rep in prune_run(cfg, run_id, dry_run=dry_run).items():
        for line in rep.lines():
            log.info(line)
        out["tiers"][name] = {"kept": {str(k): v for k, v in rep.kept.items()}, "deleted": rep.deleted,
                              "planned": rep.planned, "errors": {str(k): v for k, v in rep.errors.items()}}
    out["seconds"] = time.perf_counter() - t0
    if not dry_run:
        records.write_record(run_path, step, "pruned", out)
    return out


def prune_stage(cfg: CkptflowConfig, run_path: str, run_id: str, step: int, *, dry_run: bool = False) -> dict[str, Any]:
    """Apply each tier's retention policy to the run (after this step's lifecycle)."""
    return _prune(cfg, run_path, run_id, step, dry_run)
