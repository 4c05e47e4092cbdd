"""``kill``: a real SIGKILL at a random moment of save, commit, verify, compress, promote,
archive or prune — then: does ``latest`` verify, is anything lost, does resume work, and
does re-running the interrupted work finish the job?

Two targets, chosen per trial from the seed:

* **trainer** (save and commit): the reference job, one process or two ranks under
  torchrun, trains steps 1-10 saving every 2, with ``CKPTFLOW_FAULT=<phase>@<step>[:rank<r>]``.
  After the kill: every committed checkpoint verifies, ``latest`` verifies, no commit
  that had completed is gone, ``find_resume_point`` picks the newest. Recovery: the job
  is started again; it must resume from that step, leave no ``.tmp``, commit every save
  and reproduce the uninterrupted run's loss and learning rate at every step, bit for bit.
* **stage** (verify .. prune): the lifecycle of step 6 runs in a worker process over a
  clone of the golden tiers and is killed at a phase (prune phases by the step being
  deleted). After the kill: no tier holds a committed checkpoint that does not verify,
  no stage record claims work that is not durable, steps 4 and 6 verify somewhere, resume
  and restore pick step 6. Recovery: the worker runs again and every tier must end
  exactly where a run without the fault ends.
"""

from __future__ import annotations

import os
import random
import shutil

from ckptflow.chaos import checks, procs
from ckptflow.chaos.campaign import SAVE_EVERY, TRAIN_STEPS, Campaign
from ckptflow.chaos.model import TrialPlan, TrialResult
from ckptflow.chaos.workspace import RUN_ID
from ckptflow.tasks import records, stages
from ckptflow.trainer import events
from ckptflow.trainer.format import commit, layout
from ckptflow.trainer.verify import verify_checkpoint

TRAINER_PHASES = ("step", "write", "shards", "after_shards", "after_manifest", "after_rename", "after_latest")
STAGE_PHASES = (
    "verify.integrity",
    "verify.sanity",
    "verify.before_record",
    "compress.file",
    "compress.before_index",
    "promote.verified",
    "promote.before_commit",
    "promote.committed",
    "archive.uploaded",
    "archive.before_index",
    "archive.before_marker",
    "archive.committed",
    "prune.hot.before_delete",
    "prune.hot.deleted",
    "prune.warm.before_delete",
    "prune.warm.deleted",
    "prune.cold.before_delete",
    "prune.cold.deleted",
)
PER_RANK = ("step", "write", "shards")  # reached by every rank; the others only by rank 0


def plan(rng: random.Random, camp: Campaign) -> dict:
    if rng.random() < 0.4:
        phase = rng.choice(TRAINER_PHASES)
        nproc = 2 if rng.random() < camp.opts.world2_share else 1
        step = rng.randint(3, TRAIN_STEPS) if phase == "step" else rng.choice([4, 6, 8, 10])
        rank = rng.randrange(nproc) if phase in PER_RANK else 0
        return {"target": "trainer", "phase": phase, "step": step, "rank": rank, "nproc": nproc}
    phases = [p for p in STAGE_PHASES if camp.opts.style.sanity_step or p != "verify.sanity"]
    phase = rng.choice(phases)
    return {"target": "stage", "phase": phase, "step": 2 if phase.startswith("prune.") else 6}


def run(camp: Campaign, tp: TrialPlan) -> TrialResult:
    p = tp.params
    return _trainer(camp, tp) if p["target"] == "trainer" else _stage(camp, tp)


# ---- trainer ---------------------------------------------------------------------------


def _trainer(camp: Campaign, tp: TrialPlan) -> TrialResult:
    p = tp.params
    spec = f"{p['phase']}@{p['step']}" + (f":rank{p['rank']}" if p["nproc"] > 1 else "")
    res = TrialResult(tp.index, "kill", f"SIGKILL trainer {p['phase']} (ws{p['nproc']})", p)
    baseline = camp.baseline(p["nproc"])
    sc = camp.scratch(tp.index, "kill")
    log = os.path.join(sc.dir, "train.log")
    cmd = procs.train_cmd(sc.hot, RUN_ID, nproc=p["nproc"], max_steps=TRAIN_STEPS, save_every=SAVE_EVERY)
    r1 = procs.run(cmd, env=dict(camp.env, CKPTFLOW_FAULT=spec), log_path=log, timeout=camp.opts.timeout_s)
    run_path = sc.run_path
    if not _fault_fired(r1, res, spec, "training"):
        return res

    # What the crash left: the commit protocol's promises.
    committed = commit.committed_steps(run_path)
    good = []
    for s in committed:
        v = verify_checkpoint(os.path.join(run_path, layout.step_name(s)))
        if v.ok:
            good.append(s)
        else:
            res.undetected.append(f"step {s} is committed (renamed) but does not verify: {v.problems[0]}")
    if (lp := checks.latest_problem(run_path)) is not None:
        res.undetected.append(lp)
    must = {int(x["step"]) for x in events.read_outbox(run_path) if "step" in x}
    # save(N) first waits for the previous save's commit, so every save started before the
    # one in flight had committed; a kill at the end of step k precedes save(k).
    in_flight = p["step"] if p["phase"] != "step" else p["step"] - 1 - (p["step"] - 1) % SAVE_EVERY
    must |= set(range(SAVE_EVERY, in_flight, SAVE_EVERY))
    if p["phase"] in ("after_rename", "after_latest"):
        must.add(p["step"])
    res.lost += [f"step {s} had committed before the kill and is gone" for s in sorted(must - set(good))]
    expect = max(good) if good else None
    prob, _ = checks.resume_problem(run_path, expect)
    if prob:
        res.violations.append(prob)
    res.detail.update(committed_after_kill=committed, resume_from=expect)

    # Recovery: start the job again.
    r2 = procs.run(cmd, env=camp.env, log_path=log, timeout=camp.opts.timeout_s)
    res.recovery_s = r2.seconds
    before = len(res.violations) + len(res.lost)
    if r2.rc != 0:
        res.violations.append(f"the restarted job failed (rc={r2.rc}): {r2.tail()}")
        return res
    if expect is not None and f"resumed from {os.path.join(run_path, layout.step_name(expect))}" not in r2.output:
        res.violations.append(f"the restarted job did not resume from step {expect}")
    leftover = [n for n in os.listdir(run_path) if layout.parse_tmp_step(n) is not None]
    if leftover:
        res.violations.append(f"left behind after restart: {leftover}")
    want = list(range(TRAIN_STEPS, 0, -SAVE_EVERY))
    if commit.committed_steps(run_path) != want:
        res.violations.append(f"committed after restart {commit.committed_steps(run_path)}, expected {want}")
    for s in want:
        if not verify_checkpoint(os.path.join(run_path, layout.step_name(s))).ok:
            res.violations.append(f"step {s} does not verify after the restart")
    if commit.read_latest(run_path) != TRAIN_STEPS:
        res.violations.append(f"latest names {commit.read_latest(run_path)} after the restart, not {TRAIN_STEPS}")
    got = procs.metrics(run_path)
    diff = [s for s in baseline if got.get(s) != baseline[s]]
    if diff:
        res.violations.append(f"resume is not exact: loss/lr differ from the uninterrupted run at steps {diff}")
    res.recovered = len(res.violations) + len(res.lost) == before
    return res


# ---- lifecycle stages ----------------------------------------------------------------------


def _stage(camp: Campaign, tp: TrialPlan) -> TrialResult:
    p = tp.params
    spec = f"{p['phase']}@{p['step']}"
    res = TrialResult(tp.index, "kill", f"SIGKILL stage {p['phase']}", p)
    g = camp.golden()
    sc = camp.clone_golden(tp.index, "kill")
    if p["phase"].startswith("verify."):
        shutil.rmtree(layout.lifecycle_dir(sc.run_path, 6))  # verify step 6 again, under the fault
    log = os.path.join(sc.dir, "worker.log")
    cmd = procs.worker_cmd("stages", "--config", sc.config_path, "--run-id", RUN_ID, "--step", "6")
    r1 = procs.run(cmd, env=dict(camp.env, CKPTFLOW_FAULT=spec), log_path=log, timeout=camp.opts.timeout_s)
    if not _fault_fired(r1, res, spec, "the lifecycle worker"):
        return res

    views = checks.tier_views(sc)
    res.undetected += checks.half_committed(views)
    if (lp := checks.latest_problem(sc.run_path)) is not None:
        res.undetected.append(lp)
    res.undetected += _records_ahead_of_work(sc.run_path, views)
    must = {s for steps in g.after.values() for s in steps}
    res.lost += checks.lost_steps(views, must)
    prob, _ = checks.resume_problem(sc.run_path, 6)
    if prob:
        res.violations.append(prob)
    rest = checks.restore_check(sc.tiers(), sc)
    if rest.problem or rest.step != 6:
        res.violations.append(f"restore after the kill: step {rest.step}, {rest.problem}")
    res.detail["after_kill"] = {n: v.committed for n, v in views.items()}

    # Recovery: run the interrupted lifecycle again.
    r2 = procs.run(cmd, env=camp.env, log_path=log, timeout=camp.opts.timeout_s)
    res.recovery_s = r2.seconds
    before = len(res.violations)
    if r2.rc != 0:
        res.violations.append(f"re-running the lifecycle failed (rc={r2.rc}): {r2.tail()}")
        return res
    views = checks.tier_views(sc)
    res.violations += checks.half_committed(views)
    for name, want in g.after.items():
        if views[name].good != want:
            res.violations.append(
                f"after the re-run {name} holds {views[name].good}, a run without the fault leaves {want}"
            )
    always = [s.record for s in stages.STAGES if s.wanted is None]  # the campaign exports nothing
    missing = [s for s in always if records.read_record(sc.run_path, 6, s) is None]
    if missing:
        res.violations.append(f"records missing after the re-run: {missing}")
    res.notes += [f"leftover {x}" for x in checks.leftovers(sc, camp.s3)]
    res.recovered = len(res.violations) == before
    return res


def _records_ahead_of_work(run_path: str, views: dict[str, checks.TierView]) -> list[str]:
    """A stage's record is written only after its work is durable: check that it is."""
    out = []
    rec = stages.stage_records(run_path, 6)
    if stages.PROMOTE.record in rec and 6 not in views["warm"].good:
        out.append("promoted.json exists but warm holds no verified step 6")
    if stages.ARCHIVE.record in rec and 6 not in views["cold"].good:
        out.append("archived.json exists but cold holds no verified step 6")
    if stages.VERIFY.record in rec and not verify_checkpoint(os.path.join(run_path, layout.step_name(6))).ok:
        out.append("verified.json exists for a step 6 that does not verify")
    return out


def _fault_fired(r1: procs.Ran, res: TrialResult, spec: str, what: str) -> bool:
    """Whether the SIGKILL happened; a hang or a failure without it is recorded on ``res``."""
    if r1.rc is None:
        res.violations.append(f"{what} with {spec} hung")
        return False
    if not r1.killed:
        res.notes.append(f"{spec} was never reached (rc={r1.rc})")
        if r1.rc != 0:
            res.violations.append(f"{what} failed without the fault firing: {r1.tail()}")
        return False
    res.injected = 1
    return True
