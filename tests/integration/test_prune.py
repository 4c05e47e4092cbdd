"""Prune on real tiers: the policy decides, protections always win, dry runs touch nothing,
failed deletes are reported and prune goes on."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from ckptflow.tasks.config import TierConfig
from ckptflow.tasks.prune import checkpoint_infos, prune
from ckptflow.tasks.retention import CheckpointInfo, KeepBestN, KeepEveryKSteps, KeepLastN, Policy
from ckptflow.tasks.storage import Tier, acquire_lease
from ckptflow.tasks.storage.leases import write_lease
from ckptflow.tasks.transfer import archive, promote
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.manifest import read_manifest
from ckptflow.trainer.fsutil import write_durable


def clone_step(run: str, src: int, dst: int, loss: float | None = None) -> None:
    """A committed copy of checkpoint ``src`` as step ``dst`` (its manifest rewritten for it)."""
    shutil.copytree(os.path.join(run, layout.step_name(src)), os.path.join(run, layout.step_name(dst)))
    m = read_manifest(os.path.join(run, layout.step_name(dst)))
    m.step = dst
    if loss is not None:
        m.training["loss"] = loss
    path = os.path.join(run, layout.step_name(dst), layout.MANIFEST)
    os.unlink(path)
    write_durable(path, m.to_json())


@pytest.fixture
def hot(tiny_run, tmp_path) -> Tier:
    """Steps 2..14 (even); latest names 6 (as if training resumed from it)."""
    run = str(tmp_path / "hot" / "tiny")
    shutil.copytree(tiny_run, run)
    for s in (8, 10, 12, 14):
        clone_step(run, 6, s)
    write_durable(os.path.join(run, layout.LATEST) + ".x", (layout.step_name(6) + "\n").encode())
    os.replace(os.path.join(run, layout.LATEST) + ".x", os.path.join(run, layout.LATEST))
    return Tier(TierConfig(name="hot", url=str(tmp_path / "hot")))


def record(tier: Tier, step: int, what: str) -> None:
    run = tier.url_for("tiny")
    os.makedirs(layout.lifecycle_dir(run, step), exist_ok=True)
    path = layout.quarantine_record(run, step) if what == "quarantined" else layout.stage_record(run, step, what)
    write_durable(path, b"{}\n")


def test_protections_win_over_the_policy_on_a_real_tier(hot):
    """keep-last-1 would keep only 12 (14 is quarantined); latest (6), pinned (4), leased (8)
    and the newest verified (10) stay too; 2 and 14 go."""
    hot.pin("tiny", 4, reason="paper")
    record(hot, 2, "verified")
    record(hot, 10, "verified")
    record(hot, 14, "quarantined")
    with acquire_lease(hot, "tiny", 8, "drill"):
        rep = prune(hot, "tiny", KeepLastN(1))
    assert rep.deleted == [2, 14] and rep.errors == {}
    assert hot.committed_steps("tiny") == [12, 10, 8, 6, 4]
    assert rep.kept == {
        4: ["pinned"],
        6: ["named by latest"],
        8: ["leased by a reader"],
        10: ["newest verified checkpoint"],
        12: ["one of the last 1"],
    }
    run = hot.url_for("tiny")
    assert not [n for n in os.listdir(run) if n.endswith(".deleting")]
    assert any("keep   step_000000004: pinned" in line for line in rep.lines())


def test_dry_run_deletes_nothing_and_reports_the_plan(hot):
    before = sorted(os.listdir(hot.url_for("tiny")))
    rep = prune(hot, "tiny", KeepLastN(2), dry_run=True)
    assert rep.dry_run and rep.deleted == [] and rep.planned == [2, 4, 8, 10]
    assert sorted(os.listdir(hot.url_for("tiny"))) == before
    assert "would delete step_000000002" in "\n".join(rep.lines())


def test_caller_protected_steps_and_expired_leases(hot):
    write_lease(hot, "tiny", 2, "long-gone drill", ttl_s=0.001)  # expired: protects nothing
    time.sleep(0.01)  # (a fast prune ran within the lease's millisecond)
    rep = prune(hot, "tiny", KeepEveryKSteps(4), protected_steps=[10])
    assert rep.deleted == [2] and 10 in rep.kept and "protected by the caller" in rep.kept[10], rep
    assert hot.committed_steps("tiny") == [14, 12, 10, 8, 6, 4]


def test_keep_best_reads_metrics_from_manifests(tiny_run, tmp_path):
    run = str(tmp_path / "hot" / "tiny")
    shutil.copytree(tiny_run, run)
    clone_step(run, 6, 8, loss=0.1)  # the best one
    clone_step(run, 6, 10, loss=9.0)
    hot = Tier(TierConfig(name="hot", url=str(tmp_path / "hot")))
    infos = {c.step: c for c in checkpoint_infos(hot, "tiny", needs_metrics=True)}
    assert infos[8].metrics["loss"] == 0.1 and infos[6].latest
    rep = prune(hot, "tiny", KeepBestN("loss", "min", 1))
    assert 8 in rep.kept and "best 1 by loss" in rep.kept[8][0]
    assert hot.committed_steps("tiny") == [10, 8, 6]  # 10: newest (none verified yet)


def test_a_lease_taken_after_planning_still_protects(hot):
    """The race prune closes: a restore leases a checkpoint between plan and delete."""

    class LeaseDuringPlanning(Policy):
        def keep(self, ckpts: list[CheckpointInfo]) -> dict[int, str]:
            write_lease(hot, "tiny", 2, "late restore", ttl_s=60)
            return {14: "test"}

    rep = prune(hot, "tiny", LeaseDuringPlanning())
    assert 2 not in rep.deleted and rep.kept[2] == ["leased by a reader (since planning)"]
    assert 2 in hot.committed_steps("tiny")


def test_a_failed_delete_is_reported_and_prune_goes_on(hot, monkeypatch):
    real = hot.delete_checkpoint

    def flaky(run_id: str, step: int) -> None:
        if step == 4:
            raise PermissionError(f"injected: cannot delete step {step}")
        real(run_id, step)

    monkeypatch.setattr(hot, "delete_checkpoint", flaky)
    rep = prune(hot, "tiny", KeepLastN(1))
    assert rep.deleted == [2, 8, 10, 12] and list(rep.errors) == [4] and "injected" in rep.errors[4]
    assert hot.committed_steps("tiny") == [14, 6, 4]


def test_prune_on_warm_and_cold_treats_tier_copies_as_verified(hot, tmp_path, s3_endpoint, s3_bucket):
    warm = Tier(TierConfig(name="warm", url=str(tmp_path / "warm"), codec="zstd"))
    cold = Tier(TierConfig(name="cold", url=f"s3://{s3_bucket}/c", codec="zstd", endpoint_url=s3_endpoint))
    for s in (2, 4, 6):
        promote(hot, warm, "tiny", s)
        archive(hot, cold, "tiny", s)
    for tier in (warm, cold):
        assert all(c.verified for c in checkpoint_infos(tier, "tiny"))
        tier.pin("tiny", 2)
        dry = prune(tier, "tiny", KeepLastN(1), dry_run=True)
        assert dry.planned == [4] and tier.committed_steps("tiny") == [6, 4, 2]
        rep = prune(tier, "tiny", KeepLastN(1))
        assert rep.deleted == [4] and tier.committed_steps("tiny") == [6, 2]
        assert rep.kept[6] == ["newest verified checkpoint", "one of the last 1"]
    keys = list(cold.fs.find(cold.url_for("tiny")))
    assert not [k for k in keys if layout.step_name(4) in k]


def test_prune_refuses_an_unsafe_run_id(hot):
    with pytest.raises(ValueError):
        prune(hot, "../tiny", KeepLastN(1))
