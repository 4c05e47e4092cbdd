"""Run a campaign: plan every trial from the seed, run them one by one, total the results.

Trials are planned before any runs (kind by round-robin over the requested kinds in a
seeded order, parameters from a per-trial RNG), so trial *i* of seed *s* is the same
trial whatever else the campaign does; ``--trials 1 --seed s`` reruns the first.
A trial whose own harness fails is recorded as an error and the campaign goes on.

After every trial its logs and result are searched for the campaign's secrets (the
throwaway S3 secret key and manifest signing key): finding one there is a violation —
the same promise ``tests/integration/test_security.py`` checks with canaries.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptflow.chaos.campaign import Campaign, Options
from ckptflow.chaos.kinds import module
from ckptflow.chaos.model import KINDS, TrialPlan, TrialResult, campaign_ok, summarize
from ckptflow.trainer.format.manifest import KEY_ENV


@dataclass(slots=True)
class CampaignReport:
    seed: int
    options: dict[str, Any]
    results: list[TrialResult] = field(default_factory=list)
    seconds: float = 0.0
    workdir: str | None = None

    @property
    def ok(self) -> bool:
        return campaign_ok(self.results)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "seed": self.seed,
            "options": self.options,
            "seconds": round(self.seconds, 1),
            "workdir": self.workdir,
            "summary": {k: v.to_dict() for k, v in summarize(self.results).items()},
            "trials": [r.to_dict() for r in self.results],
        }


def plan_trials(opts: Options, camp: Campaign | None) -> list[TrialPlan]:
    kinds = [k for k in KINDS if k in opts.kinds]
    random.Random(opts.seed).shuffle(kinds)
    # one round: each kind once, then the extra turns of weighted kinds, interleaved
    rounds = max(opts.weights.get(k, 1) for k in kinds)
    order = [k for r in range(rounds) for k in kinds if r < opts.weights.get(k, 1)]
    plans = []
    for i in range(opts.trials):
        kind = order[i % len(order)]
        seed = (opts.seed * 1_000_003 + i) & 0x7FFFFFFF
        plans.append(TrialPlan(i, kind, seed, module(kind).plan(random.Random(seed), camp)))
    return plans


def run_campaign(
    opts: Options, *, say: Callable[[str], None] = print, on_result: Callable[[TrialResult], None] | None = None
) -> CampaignReport:
    t0 = time.monotonic()
    camp = Campaign(opts, say)
    rep = CampaignReport(opts.seed, _public(opts), workdir=camp.workdir)
    secrets = [v for k in ("AWS_SECRET_ACCESS_KEY", KEY_ENV) if (v := os.environ.get(k))]
    try:
        for tp in plan_trials(opts, camp):
            res = _run_one(camp, tp)
            _secret_check(res, camp.trial_dir(tp.index, tp.kind), secrets)
            tdir = camp.trial_dir(tp.index, tp.kind)
            if res.ok and not opts.keep:
                shutil.rmtree(tdir, ignore_errors=True)
            elif os.path.isdir(tdir):
                res.workdir = tdir
            rep.results.append(res)
            if on_result is not None:
                on_result(res)
    finally:
        camp.close()
        rep.seconds = time.monotonic() - t0
        if rep.ok and not opts.keep and camp.owns_workdir:
            shutil.rmtree(camp.workdir, ignore_errors=True)
            rep.workdir = None
        else:  # kept for a post-mortem: the whole report next to the trials
            with open(os.path.join(camp.workdir, "report.json"), "w") as f:
                json.dump(rep.to_dict(), f, indent=1, default=str)
    return rep


def _run_one(camp: Campaign, tp: TrialPlan) -> TrialResult:
    t0 = time.monotonic()
    camp.quiet_logs()
    try:
        res = module(tp.kind).run(camp, tp)
    except Exception as e:  # noqa: BLE001 - the harness failing is recorded, the campaign goes on
        res = TrialResult(
            tp.index,
            tp.kind,
            f"{tp.kind} (harness error)",
            tp.params,
            error=f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}",
        )
    res.seconds = time.monotonic() - t0
    return res


def _secret_check(res: TrialResult, tdir: str, secrets: list[str]) -> None:
    if not secrets:
        return
    texts = [repr(res.to_dict())]
    for dirpath, _, files in os.walk(tdir):
        for n in files:
            if n.endswith((".log", ".json", ".jsonl", ".md")):
                try:
                    with open(os.path.join(dirpath, n), errors="replace") as f:
                        texts.append(f.read())
                except OSError:
                    continue
    if any(s in t for s in secrets for t in texts):
        res.violations.append("a credential or the signing key appears in this trial's logs or results")


def _public(opts: Options) -> dict[str, Any]:
    return {
        "trials": opts.trials,
        "kinds": list(opts.kinds),
        "weights": opts.weights,
        "seed": opts.seed,
        "sign": opts.sign,
        "s3_share": opts.s3_share,
        "prefect_share": opts.prefect_share,
        "world2_share": opts.world2_share,
        "style": opts.style.source,
    }
