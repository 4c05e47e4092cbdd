"""The way back: a job whose hot copy is damaged or gone resumes from warm, or from cold when warm is gone too,
started exactly as before (the same command, the config found through $CKPTFLOW_CONFIG), with the steps after
the resume bitwise those of an uninterrupted run; it never starts over at step 0 by accident."""

from __future__ import annotations

import os
import shutil
import subprocess

from ckptflow.harness import reference_job
from ckptflow.tasks.config import load_config
from ckptflow.tasks.storage import open_tiers
from ckptflow.tasks.transfer import archive, promote
from ckptflow.trainer.format import layout
from tests.helpers import REPO, flip_byte, last_per_step, make_run, metrics, step_dir, torchrun_env, write_config

RUN = "wb"


def _job(hot, *, max_steps, cfg, nproc=2, extra=()):
    cmd = reference_job(str(hot), RUN, max_steps=max_steps, save_every=2, nproc=nproc, extra=list(extra))
    env = torchrun_env({"CKPTFLOW_CONFIG": cfg})
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


def test_the_way_back_from_warm_and_cold_and_never_over_by_accident(golden, tmp_path, s3_endpoint, s3_bucket):
    # Steps 2-6 on hot (2 ranks, the golden run's job); step 6 promoted to warm (zstd), archived to cold (S3)
    hot = tmp_path / "hot"
    cfg = write_config(tmp_path, hot, s3_endpoint, s3_bucket, hot_keep=5)
    run = make_run(str(hot), RUN, max_steps=6, save_every=2, nproc=2, env={"CKPTFLOW_CONFIG": cfg})
    before = len(metrics(run))
    h, warm, cold = open_tiers(load_config(cfg))
    promote(h, warm, RUN, 6)
    archive(warm, cold, RUN, 6)
    with open(os.path.join(step_dir(run, 6), layout.MANIFEST), "rb") as f:
        manifest = f.read()
    # Hot's newest copy rots: it passes the cheap checks and fails its load
    run_path = hot / RUN / layout.step_name(6)
    flip_byte(next(str(p) for p in run_path.iterdir() if p.suffix == ".distcp"))

    # A fresh start on purpose under this run id would write a second history: refused at start
    never = _job(hot, max_steps=8, nproc=1, cfg=cfg, extra=["--resume", "never", "--parallel", "fsdp"])
    assert never.returncode != 0
    assert "resume='never' but run wb already has checkpoints" in never.stderr, never.stderr[-3000:]
    assert "new run id" in never.stderr

    # Cold's endpoint down and warm empty: whether they hold a good step 6 is unknown, so no going on from 4
    dead = tmp_path / "dead.toml"
    text = open(cfg).read()
    port = text.split('endpoint_url = "')[1].split('"')[0].rsplit(":", 1)[1]
    dead.write_text(text.replace(f":{port}", ":9").replace(str(tmp_path / "warm"), str(tmp_path / "empty")))
    gone = _job(hot, max_steps=8, nproc=1, cfg=str(dead), extra=["--tiers-wait-s", "1", "--parallel", "fsdp"])
    assert gone.returncode != 0
    assert "the cold tier" in gone.stderr and "Not resuming" in gone.stderr, gone.stderr[-3000:]
    assert len(metrics(run)) == before and os.path.isdir(run_path), "no step trained, nothing moved"

    # The same command as before: the damaged step 6 is replaced by warm's copy, and steps 7-8 are the
    # uninterrupted run's
    back = _job(hot, max_steps=8, cfg=cfg)
    assert back.returncode == 0, back.stderr[-3000:]
    assert "brought back from the warm tier" in back.stderr, back.stderr[-3000:]
    rows = last_per_step(metrics(run)[before:])
    assert sorted(rows) == [7, 8], "resumed at step 6"
    for s in (7, 8):  # bitwise the uninterrupted run's (dropout on: every RNG stream came back too)
        assert (rows[s]["loss"], rows[s]["lr"]) == golden[s], f"step {s}: {rows[s]} vs {golden[s]}"
    with open(os.path.join(step_dir(run, 6), layout.MANIFEST), "rb") as f:
        assert f.read() == manifest, "committed on hot under the very manifest the tiers hold"
    assert any(n.startswith(layout.step_name(6)) for n in os.listdir(os.path.join(run, layout.DAMAGED_DIR)))

    # Hot's own 'latest' is good: the resume makes no call to the tiers (the dead endpoint costs nothing)
    fine = _job(hot, max_steps=8, nproc=1, cfg=str(dead), extra=["--parallel", "fsdp"])
    assert fine.returncode == 0, fine.stderr[-3000:]
    assert f"resumed from {step_dir(run, 8)}" in fine.stderr and "cannot list" not in fine.stderr

    # The cluster is replaced (an empty NVMe) and warm is gone too; the job comes back on one rank: cold,
    # at another world size
    shutil.rmtree(run)
    shutil.rmtree(warm.url_for(RUN))
    one = _job(hot, max_steps=7, nproc=1, cfg=cfg, extra=["--parallel", "fsdp"])
    assert one.returncode == 0, one.stderr[-3000:]
    assert "brought back from the cold tier" in one.stderr, one.stderr[-3000:]
    assert [m["step"] for m in metrics(run)] == [7], "resumed at step 6: only step 7 was trained"
