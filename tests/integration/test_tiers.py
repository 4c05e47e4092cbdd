"""The Tier interface on a local folder and on S3 (moto over HTTP): names, listing, trust,
pins, leases, deletes. Real file systems and a real S3 server; no mocks."""

from __future__ import annotations

import json
import os
import shutil
import time

import boto3
import pytest

from ckptflow.tasks.config import TierConfig
from ckptflow.tasks.storage import StoredFile, Tier, TierIndex, acquire_lease, active_leases, leased_steps
from ckptflow.tasks.storage.index import marker_json
from ckptflow.tasks.storage.leases import write_lease
from ckptflow.tasks.transfer import archive, fetch
from ckptflow.trainer.errors import CheckpointNotFoundError, ConfigError, ManifestError, UnsafePathError
from ckptflow.trainer.format import commit, layout


@pytest.fixture
def hot(tiny_run, tmp_path) -> Tier:
    """A writable copy of the session's tiny run (steps 2, 4, 6; latest = 6)."""
    shutil.copytree(tiny_run, tmp_path / "hot" / "tiny")
    return Tier(TierConfig(name="hot", url=str(tmp_path / "hot")))


@pytest.fixture
def cold(s3_endpoint, s3_bucket) -> Tier:
    return Tier(TierConfig(name="cold", url=f"s3://{s3_bucket}/ckpt", endpoint_url=s3_endpoint))


def s3(endpoint):
    return boto3.client("s3", endpoint_url=endpoint)


# ---- names --------------------------------------------------------------------------


def test_urls_and_listing_on_a_local_tier(hot):
    assert hot.url_for("tiny") == os.path.join(hot.url, "tiny")
    assert hot.url_for("tiny", 6, "__0_0.distcp").endswith("/tiny/step_000000006/__0_0.distcp")
    assert hot.list_runs() == ["tiny"]
    assert hot.committed_steps("tiny") == [6, 4, 2] and hot.latest_step("tiny") == 6
    run = hot.url_for("tiny")
    os.makedirs(os.path.join(run, layout.tmp_name(8)))  # a crashed save
    os.makedirs(os.path.join(run, layout.step_name(12) + ".deleting"))
    os.makedirs(os.path.join(hot.url, "not a run id"))
    assert hot.committed_steps("tiny") == [6, 4, 2] and hot.list_runs() == ["tiny"]
    # One definition of committed (trainer.atomicity): the rename is the commit point, so a
    # step dir without its manifest is a committed checkpoint that is damaged — listed, and
    # reported as damage by whoever opens it, never silently invisible.
    os.makedirs(os.path.join(run, layout.step_name(10)))
    assert hot.committed_steps("tiny") == [10, 6, 4, 2] == commit.committed_steps(run)
    with pytest.raises(ManifestError, match="manifest.json: missing"):
        hot.open_checkpoint("tiny", 10)
    assert hot.committed_steps("no-such-run") == []


@pytest.mark.parametrize(
    "run_id, name", [("../up", None), ("tiny", "../x"), ("tiny", "/etc/passwd"), ("tiny", "s3://b/k"), ("", None)]
)
def test_unsafe_names_are_refused(hot, run_id, name):
    with pytest.raises((UnsafePathError, ConfigError)):
        hot.url_for(run_id, 2, name)


def test_urls_on_s3_keep_the_scheme(cold):
    assert cold.url_for("r1", 6, "tier.json").startswith("s3://") and "//r1" not in cold.url_for("r1")
    assert cold.rule.kind == "marker" and cold.list_runs() == [] and cold.committed_steps("r1") == []


# ---- trust --------------------------------------------------------------------------


def test_manifest_is_authenticated_and_bound_to_its_step(hot):
    m = hot.read_manifest("tiny", 4)
    assert m.step == 4 and layout.DCP_METADATA in m.files
    idx = hot.read_index("tiny", 4)  # hot has no tier.json: derived from the manifest
    assert idx.codec == "none" and idx.files["__0_0.distcp"].stored_name == "__0_0.distcp"
    run = hot.url_for("tiny")
    # a manifest copied into another step's dir is refused
    shutil.copy(
        os.path.join(run, layout.step_name(2), layout.MANIFEST), os.path.join(run, layout.step_name(4), layout.MANIFEST)
    )
    with pytest.raises(ManifestError, match="not tiny step 4"):
        hot.read_manifest("tiny", 4)
    with pytest.raises(CheckpointNotFoundError):
        hot.read_manifest("tiny", 8)


def test_unsafe_names_in_a_manifest_or_tier_index_are_refused(hot):
    ck = os.path.join(hot.url_for("tiny"), layout.step_name(6))
    mpath = os.path.join(ck, layout.MANIFEST)
    d = json.loads(open(mpath, "rb").read())
    d["files"]["../../escape"] = d["files"].pop("__0_0.distcp")
    with open(mpath, "w") as f:
        json.dump(d, f)
    with pytest.raises(UnsafePathError, match="escape"):
        hot.open_checkpoint("tiny", 6)
    # a tier index may not point a stored name outside, or at the checkpoint's own records
    good = hot.read_index("tiny", 4)
    for bad in ("../../../x.zst", layout.MANIFEST):
        f = good.files["__0_0.distcp"]
        idx = TierIndex(
            run_id="tiny",
            step=4,
            codec="none",
            level=None,
            manifest_checksum=good.manifest_checksum,
            files={**good.files, "__0_0.distcp": StoredFile(f.size, f.checksum, bad, f.stored_size, f.stored_checksum)},
        )
        with open(os.path.join(hot.url_for("tiny"), layout.step_name(4), layout.TIER_MANIFEST), "wb") as fh:
            fh.write(idx.to_json())
        with pytest.raises(UnsafePathError):
            hot.open_checkpoint("tiny", 4)


def test_objects_without_a_marker_are_not_committed(hot, cold, s3_endpoint, s3_bucket):
    """Every object of a checkpoint but the marker: not listed, not fetched."""
    archive(hot, cold, "tiny", 4)
    key = f"ckpt/tiny/{layout.step_name(4)}/{layout.COMMIT_MARKER}"
    s3(s3_endpoint).delete_object(Bucket=s3_bucket, Key=key)
    assert cold.committed_steps("tiny") == [] and cold.list_runs() == ["tiny"]
    with pytest.raises(CheckpointNotFoundError, match="no commit marker"):
        cold.open_checkpoint("tiny", 4)


def test_a_marker_for_another_index_is_not_trusted(hot, cold, s3_endpoint, s3_bucket):
    archive(hot, cold, "tiny", 4)
    key = f"ckpt/tiny/{layout.step_name(4)}/{layout.COMMIT_MARKER}"
    s3(s3_endpoint).put_object(Bucket=s3_bucket, Key=key, Body=marker_json(b"another index"))
    with pytest.raises(ManifestError, match="digest differs"):
        cold.open_checkpoint("tiny", 4)


def test_unsafe_stored_name_in_a_cold_index_is_refused(hot, cold, s3_endpoint, s3_bucket, tmp_path):
    """An attacker who rewrites tier.json *and* its marker still cannot make fetch write
    outside the destination."""
    archive(hot, cold, "tiny", 4)
    c = s3(s3_endpoint)
    pre = f"ckpt/tiny/{layout.step_name(4)}/"
    d = json.loads(c.get_object(Bucket=s3_bucket, Key=pre + layout.TIER_MANIFEST)["Body"].read())
    d["files"]["__0_0.distcp"]["stored_name"] = "../../../../tmp/owned"
    body = (json.dumps(d) + "\n").encode()
    c.put_object(Bucket=s3_bucket, Key=pre + layout.TIER_MANIFEST, Body=body)
    c.put_object(Bucket=s3_bucket, Key=pre + layout.COMMIT_MARKER, Body=marker_json(body))
    with pytest.raises(UnsafePathError):
        fetch(cold, "tiny", 4, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


# ---- pins and leases ------------------------------------------------------------------


@pytest.mark.parametrize("which", ["hot", "cold"])
def test_pins(which, request):
    tier = request.getfixturevalue(which)
    tier.pin("tiny", 4, reason="paper figure 3")
    tier.pin("tiny", 6)
    assert tier.pinned_steps("tiny") == {4, 6}
    tier.unpin("tiny", 6)
    assert tier.pinned_steps("tiny") == {4}
    tier.unpin("tiny", 6)  # idempotent


@pytest.mark.parametrize("which", ["hot", "cold"])
def test_leases_are_held_for_the_block_and_expire(which, request):
    tier = request.getfixturevalue(which)
    with acquire_lease(tier, "tiny", 4, "drill-1", ttl_s=60) as lease:
        got = active_leases(tier, "tiny")
        assert [(x.step, x.holder, x.lease_id) for x in got] == [(4, "drill-1", lease.lease_id)]
        assert leased_steps(tier, "tiny") == {4}
        assert active_leases(tier, "tiny", now=time.time() + 120) == []  # expired by then
    assert active_leases(tier, "tiny") == []
    write_lease(tier, "tiny", 2, "crashed-reader", ttl_s=0.05)  # never released
    time.sleep(0.1)
    assert leased_steps(tier, "tiny") == set()


def test_an_unreadable_lease_counts_as_active(hot):
    d = os.path.join(hot.url_for("tiny"), layout.LEASES_DIR)
    os.makedirs(d)
    with open(os.path.join(d, layout.step_name(2) + ".abc123.json"), "w") as f:
        f.write("{torn")
    assert leased_steps(hot, "tiny") == {2}


# ---- deletes ----------------------------------------------------------------------


def test_local_delete_renames_first_and_leaves_nothing(hot):
    hot.delete_checkpoint("tiny", 2)
    assert hot.committed_steps("tiny") == [6, 4]
    assert not [n for n in os.listdir(hot.url_for("tiny")) if "000000002" in n]
    hot.delete_checkpoint("tiny", 2)  # already gone: no error


def test_cold_delete_withdraws_the_marker_first(hot, cold, s3_endpoint, s3_bucket, monkeypatch):
    """If deleting the objects fails half-way, the checkpoint is already untrusted."""
    archive(hot, cold, "tiny", 4)
    archive(hot, cold, "tiny", 6)

    def broken_rm(*a, **k):
        raise PermissionError("injected: object delete denied")

    monkeypatch.setattr(cold.fs, "rm", broken_rm)
    with pytest.raises(OSError):
        cold.delete_checkpoint("tiny", 4)
    assert cold.committed_steps("tiny") == [6]  # marker gone, objects still there
    monkeypatch.undo()
    cold.delete_checkpoint("tiny", 4)
    keys = [o["Key"] for o in s3(s3_endpoint).list_objects_v2(Bucket=s3_bucket).get("Contents", [])]
    assert not [k for k in keys if layout.step_name(4) in k]
    assert any(layout.step_name(6) in k for k in keys)


def test_check_inside_refuses_paths_outside_the_run(hot):
    with pytest.raises(UnsafePathError):
        hot.check_inside(hot.url_for("tiny") + "/../other/step_000000002", "tiny")
    with pytest.raises(UnsafePathError):
        hot.check_inside(hot.url, "tiny")


def test_clean_stale_removes_old_tmp_and_deleting_dirs_only(hot):
    run = hot.url_for("tiny")
    old, young = os.path.join(run, layout.tmp_name(8)), os.path.join(run, layout.tmp_name(10))
    gone = os.path.join(run, layout.step_name(2) + ".deleting")
    for d in (old, young, gone):
        os.makedirs(d)
    past = time.time() - 7200
    os.utime(old, (past, past))
    os.utime(gone, (past, past))
    assert sorted(hot.clean_stale("tiny", older_than_s=3600)) == sorted([old, gone])
    assert os.path.isdir(young) and hot.committed_steps("tiny") == [6, 4, 2]
