"""The lifecycle as a table of stages: one path (``run_stage``) with one set of rules,
whoever calls it — the flow, reconcile's age moves, the chaos worker."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from ckptflow.flows.reconcile import Action, FlowRun, decide
from ckptflow.tasks import records
from ckptflow.tasks.checkpoint import CheckpointRef, hot_root_for
from ckptflow.tasks.config import load_config
from ckptflow.tasks.stages import ARCHIVE, PROMOTE, VERIFY, finished, run_stage
from ckptflow.tasks.storage import Tier
from tests.helpers import flip_byte, step_dir


def _config(tmp_path, hot: str, *, move_after_hours: float | None = None) -> str:
    move = f"move_after_hours = {move_after_hours}\n" if move_after_hours is not None else ""
    p = tmp_path / "ckptflow.toml"
    p.write_text(
        f'[hot]\nurl = "{hot}"\n{move}[hot.retention]\nkeep_last = 5\n'
        f'[warm]\nurl = "{tmp_path / "warm"}"\n[warm.retention]\nkeep_last = 5\n'
        "[lifecycle]\nsanity_step = false\nexpectations = false\n"
    )
    return str(p)


@pytest.fixture
def ref(tiny_run, tmp_path):
    hot = tmp_path / "hot"
    shutil.copytree(tiny_run, hot / "tiny")
    return CheckpointRef(load_config(_config(tmp_path, str(hot))), "tiny", 6)


def test_a_record_short_circuits_and_is_written_only_after_the_work(ref):
    first = run_stage(VERIFY, ref)
    assert first.ok and not first.skipped and first.record == "verified"
    assert records.read_record(ref.run_path, 6, "verified")["step"] == 6
    again = run_stage(VERIFY, ref)
    assert again.skipped and again.body == first.body
    p = run_stage(PROMOTE, ref)
    assert p.ok and not p.skipped and ref.tier("warm").is_committed("tiny", 6)
    assert p.body["tier"] == "warm" and p.body["bytes_raw"] > 0
    assert not finished(ref.run_path, 6)


def test_a_quarantined_checkpoint_goes_no_further_whoever_asks(ref):
    flip_byte(os.path.join(step_dir(ref.run_path, 6), "__0_0.distcp"))
    v = run_stage(VERIFY, ref)
    assert not v.ok and v.record == "quarantined" and "checksum" in v.reasons[0]
    p = run_stage(PROMOTE, ref)  # e.g. reconcile's age move, later
    assert not p.ok and p.skipped and p.record == "quarantined"
    assert not ref.tier("warm").is_committed("tiny", 6) and finished(ref.run_path, 6)


def test_a_stage_for_an_unconfigured_tier_is_skipped(ref):
    assert not ref.has("cold") and run_stage(ARCHIVE, ref) is None


def test_the_hot_root_comes_from_the_event():
    cfg = load_config(None)
    assert hot_root_for(cfg, "/x/run/step_000000002", "/nvme/ckpt") == "/nvme/ckpt"
    assert hot_root_for(cfg, "/x/run/step_000000002", None) == "/x"
    assert hot_root_for(cfg, "s3://b/run/step_000000002", None) == cfg.hot.url


@pytest.mark.parametrize(
    "runs,beat,want",
    [
        ([], False, Action.RUN),
        ([FlowRun("a", "SCHEDULED", 5.0)], False, Action.LEAVE_QUEUED),
        ([FlowRun("a", "PENDING", 700.0)], False, Action.TAKE_OVER),  # queued past the grace
        ([FlowRun("a", "RUNNING", 5.0)], True, Action.LEAVE_RUNNING),
        ([FlowRun("a", "RUNNING", 5.0)], False, Action.TAKE_OVER),  # its process died
        ([FlowRun("a", "RUNNING", 900.0), FlowRun("b", "SCHEDULED", 1.0)], False, Action.LEAVE_QUEUED),
        ([FlowRun("a", "RUNNING", 900.0), FlowRun("b", "RUNNING", 1.0)], False, Action.TAKE_OVER),
        ([], True, Action.LEAVE_RUNNING),  # a lifecycle the server does not list holds the heartbeat
    ],
)
def test_what_reconcile_does_with_an_unfinished_step(runs, beat, want):
    """A queued run is its worker's; a live one is left alone; a dead one is taken over."""
    assert decide(runs, beat, queued_grace_s=600.0) is want


def test_a_commit_of_moments_ago_is_left_to_its_event():
    assert decide([], False, 600.0, commit_age_s=3.0, fresh_grace_s=20.0) is Action.LEAVE_FRESH
    assert decide([], False, 600.0, commit_age_s=30.0, fresh_grace_s=20.0) is Action.RUN


def test_of_two_lifecycles_of_one_checkpoint_only_one_holds_it(tmp_path):
    import os

    from ckptflow.tasks.heartbeat import HEARTBEAT, Heartbeat, LifecycleBusy
    from ckptflow.trainer.format import layout

    with Heartbeat(str(tmp_path), 4, owner={"flow_run_id": "a"}):
        with pytest.raises(LifecycleBusy, match="another lifecycle is running"):
            with Heartbeat(str(tmp_path), 4, owner={"flow_run_id": "b"}):
                pass
    path = os.path.join(layout.lifecycle_dir(str(tmp_path), 4), HEARTBEAT)
    assert not os.path.exists(path)  # released
    # a dead holder's beat (a pid that is not running) is taken over
    import json
    import socket

    with open(path, "w") as f:
        json.dump({"host": socket.gethostname(), "pid": 999999999, "proc_start": "1", "updated_at": 0}, f)
    with Heartbeat(str(tmp_path), 4, owner={"flow_run_id": "c"}):
        with open(path) as f:
            assert json.load(f)["flow_run_id"] == "c"


def test_age_moves_take_the_stage_path_lease_and_record(prefect_api, tiny_run, tmp_path):
    """An aged checkpoint the lifecycle never promoted is promoted by reconcile once — with the
    record (so it is never moved twice) and the lease the lifecycle's promote takes."""
    from ckptflow.flows.reconcile import age_moves
    from ckptflow.tasks.storage.leases import active_leases

    hot = tmp_path / "hot"
    shutil.copytree(tiny_run, hot / "tiny")
    cfg = load_config(_config(tmp_path, str(hot), move_after_hours=0))
    moved = age_moves(cfg, "tiny", time.time())
    assert sorted(m["step"] for m in moved) == [2, 4, 6] and all(m["stage"] == "promote" for m in moved)
    warm = Tier(cfg.warm)
    assert warm.committed_steps("tiny") == [6, 4, 2]
    assert all(records.read_record(str(hot / "tiny"), s, PROMOTE.record) for s in (2, 4, 6))
    assert active_leases(Tier(cfg.hot), "tiny") == []  # taken while copying, released after
    warm.delete_checkpoint("tiny", 4)  # retention took it from warm: the move is not repeated
    assert age_moves(cfg, "tiny", time.time()) == []
