"""``enospc``: the hot tier's disk fills up while the job saves.

A real full disk, not a mocked ``write``: the trial mounts a small tmpfs (``mount -t tmpfs
-o size=…``) as the hot root, sized from the seed so that one to four checkpoints fit
and a later save hits ENOSPC — while DCP writes shards, or later, at the manifest,
``latest`` or the outbox. Where tmpfs cannot be mounted, a loop-mounted ext4 image is
tried; both need root (CAP_SYS_ADMIN), otherwise the trial is skipped and says so.

Checks: the job's error names ENOSPC and the run's path; with ``--on-save-error
continue`` training goes on to the last step, with ``raise`` it stops with a SaveError;
every committed checkpoint verifies and ``latest`` names one; no ``step_*.tmp`` is left
behind. Recovery: the disk grows (tmpfs remount), the job is started again, resumes from
the newest committed checkpoint, commits every save and reproduces the uninterrupted
run's loss and learning rate at every step.
"""

from __future__ import annotations

import os
import random
import subprocess

from ckptflow.chaos import checks, procs
from ckptflow.chaos.campaign import SAVE_EVERY, TRAIN_STEPS, Campaign
from ckptflow.chaos.model import TrialPlan, TrialResult
from ckptflow.chaos.workspace import RUN_ID
from ckptflow.trainer.format import commit, layout
from ckptflow.trainer.verify import verify_checkpoint

KiB = 1024
NOSPACE = "No space left on device"


def plan(rng: random.Random, camp: Campaign) -> dict:
    nproc = 2 if rng.random() < camp.opts.world2_share else 1
    # one tiny checkpoint is ~1.9 MB; between 1 and 4 of the 5 saves fit
    return {"nproc": nproc, "policy": rng.choice(["raise", "continue"]), "size_kib": rng.randrange(2300, 8600, 4)}


def run(camp: Campaign, tp: TrialPlan) -> TrialResult:
    p = tp.params
    res = TrialResult(tp.index, "enospc", f"ENOSPC policy={p['policy']} (ws{p['nproc']})", p)
    sc = camp.scratch(tp.index, "enospc")
    os.makedirs(sc.hot, exist_ok=True)
    how = _mount(sc.hot, p["size_kib"] * KiB, os.path.join(sc.dir, "disk.img"))
    if how is None:
        res.notes.append("skipped: cannot mount a small file system here (needs root: tmpfs or a loop device)")
        res.detail["skipped"] = True
        return res
    res.detail["fs"] = how
    try:
        _trial(camp, sc, p, res, how)
    finally:
        subprocess.run(["umount", "-l", sc.hot], capture_output=True)
    return res


def _trial(camp: Campaign, sc, p: dict, res: TrialResult, how: str) -> None:
    baseline = camp.baseline(p["nproc"])
    log = os.path.join(sc.dir, "train.log")
    cmd = procs.train_cmd(
        sc.hot,
        RUN_ID,
        nproc=p["nproc"],
        max_steps=TRAIN_STEPS,
        save_every=SAVE_EVERY,
        extra=["--on-save-error", p["policy"]],
    )
    r1 = procs.run(cmd, env=camp.env, log_path=log, timeout=camp.opts.timeout_s)
    run_path = sc.run_path
    if r1.rc is None:
        res.violations.append("training hung on a full disk")
        return
    failed = [ln for ln in r1.output.splitlines() if "was not committed" in ln]
    if not failed:  # on this small file system nothing else makes a save fail
        res.notes.append(f"the disk never filled up (rc={r1.rc})")
        if r1.rc != 0:
            res.violations.append(f"training failed without a failed save: {r1.tail()}")
        return
    res.injected = 1
    named = [ln for ln in failed if run_path in ln]
    res.detail["error"] = _short((named or failed)[0])
    if not named:
        res.violations.append(f"the failed save's error does not name the run's path {run_path}: {_short(failed[0])}")
    if not any(x in r1.output for x in (NOSPACE, "Errno 28", "ENOSPC", "disk is full")):
        # torch's zip writer reports a short write as "unexpected pos N vs M"
        res.findings.append(
            "the failed save's error does not say the disk is full (torch reports "
            "'unexpected pos N vs M'); see docs/reliability.md"
        )
    if p["policy"] == "raise" and (r1.rc == 0 or "SaveError" not in r1.output):
        res.violations.append(f"on_save_error=raise but the job did not stop with a SaveError (rc={r1.rc})")
    if p["policy"] == "continue":
        if r1.rc != 0:
            res.violations.append(f"on_save_error=continue but training stopped (rc={r1.rc}): {r1.tail(600)}")
        elif max(procs.metrics(run_path), default=0) != TRAIN_STEPS:
            res.violations.append("on_save_error=continue but training did not reach the last step")

    committed = commit.committed_steps(run_path)
    for s in committed:
        v = verify_checkpoint(os.path.join(run_path, layout.step_name(s)))
        if not v.ok:
            res.undetected.append(f"step {s} is committed but does not verify: {v.problems[0]}")
    if (lp := checks.latest_problem(run_path)) is not None:
        res.undetected.append(lp)
    tmp = [n for n in os.listdir(run_path) if layout.parse_tmp_step(n) is not None]
    if tmp:
        res.violations.append(f"a failed save left {tmp} behind on the full disk")
    res.detail["committed_on_full_disk"] = committed

    # Recovery: more space, then start the job again.
    _grow(sc.hot, how, os.path.join(sc.dir, "disk.img"))
    r2 = procs.run(
        procs.train_cmd(sc.hot, RUN_ID, nproc=p["nproc"], max_steps=TRAIN_STEPS, save_every=SAVE_EVERY),
        env=camp.env,
        log_path=log,
        timeout=camp.opts.timeout_s,
    )
    res.recovery_s = r2.seconds
    before = len(res.violations)
    if r2.rc != 0:
        res.violations.append(f"the restarted job failed (rc={r2.rc}): {r2.tail()}")
        return
    newest = max(committed) if committed else None
    if (
        newest is not None
        and newest < TRAIN_STEPS
        and f"resumed from {os.path.join(run_path, layout.step_name(newest))}" not in r2.output
    ):
        res.violations.append(f"the restarted job did not resume from step {newest}")
    want = list(range(TRAIN_STEPS, 0, -SAVE_EVERY))
    got = commit.committed_steps(run_path)
    if got != want or not all(verify_checkpoint(os.path.join(run_path, layout.step_name(s))).ok for s in want):
        res.violations.append(f"after recovery committed {got}, expected {want}, all verifying")
    m = procs.metrics(run_path)
    diff = [s for s in baseline if m.get(s) != baseline[s]]
    if diff:
        res.violations.append(f"loss/lr differ from the uninterrupted run at steps {diff}")
    res.recovered = len(res.violations) == before


def _mount(path: str, size: int, image: str) -> str | None:
    """Mount a ``size``-byte file system at ``path``; returns "tmpfs", "ext4-loop" or None."""
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "ckptflow-chaos", path], capture_output=True
    )
    if r.returncode == 0:
        return "tmpfs"
    try:
        with open(image, "wb") as f:
            f.truncate(size)
        if (
            subprocess.run(["mkfs.ext4", "-q", "-F", image], capture_output=True).returncode == 0
            and subprocess.run(["mount", "-o", "loop", image, path], capture_output=True).returncode == 0
        ):
            return "ext4-loop"
    except OSError:
        pass
    return None


def _grow(path: str, how: str, image: str) -> None:
    """The operator's fix: give the file system room (256 MiB)."""
    if how == "tmpfs":
        subprocess.run(["mount", "-o", "remount,size=256m", path], check=True, capture_output=True)
        return
    subprocess.run(["umount", path], check=True, capture_output=True)
    with open(image, "r+b") as f:
        f.truncate(256 << 20)
    subprocess.run(["e2fsck", "-fy", image], capture_output=True)
    subprocess.run(["resize2fs", image], check=True, capture_output=True)
    subprocess.run(["mount", "-o", "loop", image, path], check=True, capture_output=True)


def _short(line: str) -> str:
    import re

    return re.sub(r"<FrameSummary[^>]*>,? ?", "", line)[-500:]
