"""``s3``: archive, restore and prune through a proxy that breaks a share of S3 requests.

The cold tier of a clone of ``final`` is pointed at a fresh, empty prefix behind a
:class:`~flows.chaos.s3proxy.FaultProxy` (HTTP 500, 503 SlowDown, connection resets
before or after the request took effect, stalls). Most trials break the campaign's
``--s3-fault-share`` of requests; one in four is a storm (60 %), where failing is fine
as long as it is clean. Steps, all through the proxy:

1. archive step 6 from warm (as the lifecycle does);
2. restore from cold alone (as a drill does);
3. prune cold down to one checkpoint (step 4 was copied in first).

Each must complete through retries or raise a ckptflow error that names the object
(anything else — a bare ``AttributeError`` out of a retry path — is a violation). After
each, the truth is read straight from moto, past the proxy: no step may be marked
committed unless every object is there and verifies. Recovery: faults off, re-run
what failed; it must finish, and no data object may have been uploaded to completion
twice (the re-run skips what is already there).
"""

from __future__ import annotations

import random
import time

from ckptflow.chaos import checks
from ckptflow.chaos.campaign import Campaign
from ckptflow.chaos.model import TrialPlan, TrialResult
from ckptflow.chaos.s3proxy import MODES, FaultProxy
from ckptflow.chaos.workspace import copy_prefix
from ckptflow.tasks.config import RetentionConfig, TierConfig
from ckptflow.tasks.prune import prune
from ckptflow.tasks.retention import build_policy
from ckptflow.tasks.storage import Tier
from ckptflow.tasks.transfer import archive
from ckptflow.trainer.errors import CkptflowError
from ckptflow.trainer.format import layout

STORM = 0.6


def plan(rng: random.Random, camp: Campaign) -> dict:
    storm = rng.random() < 0.25
    return {"share": STORM if storm else camp.opts.s3_share, "storm": storm, "proxy_seed": rng.randrange(1 << 30)}


def run(camp: Campaign, tp: TrialPlan) -> TrialResult:
    p = tp.params
    res = TrialResult(tp.index, "s3", f"s3 faults {'storm ' if p['storm'] else ''}{p['share']:.0%}", p)
    sc = camp.clone_golden(tp.index, "s3", final=True)
    # A cold prefix that holds only step 4: step 6 is archived under faults.
    sc.prefix = f"trials/{tp.index:04d}-s3"
    copy_prefix(
        camp.s3,
        camp.bucket,
        f"final/{sc.run_id}/{layout.step_name(4)}",
        f"{sc.prefix}/{sc.run_id}/{layout.step_name(4)}",
    )
    with FaultProxy(camp.moto.url, share=p["share"], modes=MODES, seed=p["proxy_seed"]) as px:
        sc.point_cold_at(px.url)
        warm, cold = sc.tier("warm"), sc.tier("cold")
        truth = Tier(TierConfig(**{**_fields(cold.config), "endpoint_url": camp.moto.url}))
        t0 = time.monotonic()
        archived = _clean(res, "archive", lambda: archive(warm, cold, sc.run_id, 6))
        _truth(res, sc, truth, "after archive")
        restored = None
        if archived is not None:
            out = _clean(res, "restore", lambda: checks.restore_check([cold], sc))
            if out is not None:
                if out.problem and "CheckpointNotFoundError" not in out.problem:
                    res.violations.append(f"restore through faults: {out.problem}")
                restored = out.step if not out.problem else None
        _clean(res, "prune", lambda: _prune_one(cold, sc.run_id, res))
        _truth(res, sc, truth, "after prune")
        res.injected = sum(px.stats.faults.values())

        # Recovery: the network heals; whatever did not finish is run again.
        px.set_faults(share=0.0)
        if archived is None:
            archived = _clean(res, "archive re-run", lambda: archive(warm, cold, sc.run_id, 6))
        if restored != 6:
            out = checks.restore_check([cold], sc)
            restored = out.step if not out.problem else None
        res.recovery_s = time.monotonic() - t0
        res.recovered = archived is not None and restored == 6
        if not res.recovered:
            res.violations.append(
                f"after the faults stopped: archived={archived is not None}, restored step {restored}"
            )
        _truth(res, sc, truth, "at the end")
        dup = {
            k: n
            for k, n in px.stats.duplicate_uploads().items()
            if k.rsplit("/", 1)[-1] not in (layout.MANIFEST, layout.TIER_MANIFEST, layout.COMMIT_MARKER)
            and f"/{layout.LEASES_DIR}/" not in k
        }
        if dup:
            res.violations.append(f"data objects uploaded to completion more than once: {dup}")
        res.detail["proxy"] = px.stats.to_dict()
    return res


def _fields(cfg: TierConfig) -> dict:
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


def _clean(res: TrialResult, what: str, fn):
    """Run ``fn``; a ckptflow error (or OSError) is a clean failure, anything else is not."""
    try:
        return fn()
    except (CkptflowError, OSError) as e:
        res.notes.append(f"{what} failed cleanly: {type(e).__name__}: {str(e)[:200]}")
        return None
    except Exception as e:  # noqa: BLE001 - exactly what this check is about
        res.violations.append(f"{what} failed uncleanly: {type(e).__name__}: {e}")
        return None


def _prune_one(cold: Tier, run_id: str, res: TrialResult):
    rep = prune(cold, run_id, build_policy(RetentionConfig(keep_last=1)))
    for s, e in rep.errors.items():
        res.notes.append(f"prune of step {s} failed cleanly (retried at the next prune): {e[:200]}")
    return rep


def _truth(res: TrialResult, sc, truth: Tier, when: str) -> None:
    """Read cold past the proxy: nothing marked committed may be partial."""
    view = checks.tier_view(truth, sc)
    res.undetected += [f"{when}: {x}" for x in checks.half_committed({"cold": view})]
