"""One restore drill: prove a cold checkpoint restores, and measure how long it takes.

download (parallel) -> decompress -> verify every file -> restore sanity step in a
fresh torchrun job at a *different* world size than the checkpoint was saved with ->
compare the probe loss and learning rate with the recorded ones. Each phase is timed;
their sum is the recovery time a cluster would sit idle after a failure (minus
scheduling). The tiers are only read; a lease on the checkpoint keeps prune away,
and the scratch folder is removed afterwards whatever happens.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ckptflow.tasks.adopt import DCP, is_adopted, parse_check
from ckptflow.tasks.storage import Tier, acquire_lease
from ckptflow.tasks.transfer import fetch
from ckptflow.tasks.verify import run_sanity
from ckptflow.trainer.errors import CkptflowError
from ckptflow.trainer.format import layout
from ckptflow.trainer.verify import verify_checkpoint


@dataclass(slots=True)
class DrillResult:
    run_id: str
    step: int
    tier: str
    uri: str
    ok: bool = False
    failure: str | None = None
    """What failed, naming the object or check (None when ok)."""
    saved_world_size: int | None = None
    world_size: int | None = None
    bytes_stored: int = 0
    bytes_raw: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    """download, decompress, verify, load, sanity (the torchrun job), total."""
    probe_loss_recorded: float | None = None
    probe_loss_restored: float | None = None
    probe_match: str | None = None
    lr_recorded: float | None = None
    lr_restored: float | None = None
    started_at: float = field(default_factory=time.time)

    @property
    def recovery_seconds(self) -> float:
        return self.seconds.get("total", 0.0)

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), recovery_seconds=self.recovery_seconds)


def pick_steps(tier: Tier, run_id: str, *, random_older: bool, seed: int | None = None) -> list[int]:
    """The newest committed checkpoint, and by policy one random older one."""
    steps = sorted(tier.committed_steps(run_id), reverse=True)
    if not steps:
        return []
    picked = [steps[0]]
    if random_older and len(steps) > 1:
        picked.append(random.Random(seed).choice(steps[1:]))
    return picked


def other_world_size(saved: int, preferred: int | None) -> int:
    """A world size different from the one the checkpoint was saved with (proves resharding)."""
    if preferred and preferred != saved:
        return preferred
    return 1 if saved != 1 else 2


def drill_one(
    tier: Tier,
    run_id: str,
    step: int,
    *,
    world_size: int | None = None,
    scratch_root: str | None = None,
    threads: int | None = None,
) -> DrillResult:
    """Restore ``run_id``/``step`` from ``tier`` into scratch and prove it. Never raises for a
    bad checkpoint: the result says what failed."""
    res = DrillResult(run_id=run_id, step=step, tier=tier.name, uri=tier.url_for(run_id, step))
    t0 = time.perf_counter()
    if scratch_root:
        os.makedirs(scratch_root, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=f"ckptflow-drill-{run_id}-{step}-", dir=scratch_root)
    ckpt_dir = os.path.join(scratch, layout.step_name(step))
    try:
        with acquire_lease(tier, run_id, step, holder=f"drill:{os.getpid()}", ttl_s=6 * 3600):
            fr = fetch(tier, run_id, step, ckpt_dir, threads=threads)
        res.bytes_stored, res.bytes_raw = fr.bytes_stored, fr.bytes_raw
        res.seconds.update(download=fr.download_seconds, decompress=fr.decompress_seconds)
        tv = time.perf_counter()
        v = verify_checkpoint(ckpt_dir)
        res.seconds["verify"] = time.perf_counter() - tv
        if not v.ok:
            res.failure = f"verify: {v.problems[0]}"
            return res
        assert v.manifest is not None  # ok implies the manifest was read
        res.saved_world_size = v.manifest.world_size
        res.world_size = other_world_size(v.manifest.world_size, world_size)
        ts = time.perf_counter()
        if is_adopted(v.manifest):  # no recorded probe to replay: every file parses, pickle-free,
            san = parse_check(ckpt_dir, v.manifest)
            if san["ok"] and san["format"] == DCP:  # and DCP's restores whole at another world size
                san = {**run_sanity(ckpt_dir, nproc=res.world_size, stats=False), "parse": san}
            else:
                res.world_size = v.manifest.world_size
        else:
            san = run_sanity(ckpt_dir, nproc=res.world_size, stats=False)
        res.seconds["sanity"] = time.perf_counter() - ts
        took = san.get("seconds")  # the parse check's is one figure, a restore's has its phases
        res.seconds["load"] = float(took.get("load", 0.0) if isinstance(took, dict) else took or 0.0)
        res.probe_loss_recorded = san.get("probe_loss_recorded")
        res.probe_loss_restored = san.get("probe_loss_restored")
        res.probe_match = san.get("probe_match")
        res.lr_recorded, res.lr_restored = san.get("lr_recorded"), san.get("lr_restored")
        if not san.get("ok"):
            why = san.get("problems") or [
                f"probe loss {res.probe_loss_restored} vs recorded "
                f"{res.probe_loss_recorded} ({res.probe_match}); lr "
                f"{res.lr_restored} vs {res.lr_recorded}"
            ]
            res.failure = f"sanity step at world size {res.world_size}: {why[0]}"[:2000]
            return res
        res.ok = True
        return res
    except (CkptflowError, OSError) as e:
        # The message names the object (IntegrityError/StorageError carry the URI).
        res.failure = f"restore from {tier.name}: {e}"
        return res
    finally:
        res.seconds["total"] = time.perf_counter() - t0
        shutil.rmtree(scratch, ignore_errors=True)


# ---- history ---------------------------------------------------------------------------


def history_path(history_dir: str, run_id: str) -> str:
    return os.path.join(history_dir, f"{layout.check_run_id(run_id)}.jsonl")


def append_history(history_dir: str, result: DrillResult) -> None:
    from ckptflow.trainer.fsutil import append_durable

    os.makedirs(history_dir, exist_ok=True)
    append_durable(history_path(history_dir, result.run_id), json.dumps(result.to_dict(), sort_keys=True))


def read_history(history_dir: str, run_id: str) -> list[dict[str, Any]]:
    try:
        with open(history_path(history_dir, run_id)) as f:
            return [json.loads(x) for x in f if x.strip()]
    except FileNotFoundError:
        return []
