"""Compress, promote, fetch and restore between local tiers: byte-exact round trips,
idempotence, a crash injected at every phase, damaged copies detected and skipped."""

from __future__ import annotations

import fcntl
import filecmp
import os
import shutil

import pytest

from ckptflow.tasks.config import TierConfig
from ckptflow.tasks.storage import Tier, acquire_lease, active_leases
from ckptflow.tasks.transfer import compress, fetch, promote, restore
from ckptflow.trainer.errors import CheckpointNotFoundError, ConfigError, IntegrityError, StorageError
from ckptflow.trainer.format import layout
from ckptflow.trainer.fsutil import write_durable
from ckptflow.trainer.verify import verify_checkpoint


@pytest.fixture
def hot(tiny_run, tmp_path) -> Tier:
    shutil.copytree(tiny_run, tmp_path / "hot" / "tiny")
    return Tier(TierConfig(name="hot", url=str(tmp_path / "hot")))


def warm_tier(tmp_path, codec: str = "zstd", **kw) -> Tier:
    return Tier(TierConfig(name="warm", url=str(tmp_path / f"warm-{codec}"), codec=codec, **kw))


def flip(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


def same_files(a: str, b: str) -> bool:
    names = sorted(n for n in os.listdir(a) if n != layout.TIER_MANIFEST)
    return names == sorted(os.listdir(b)) and all(
        filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False) for n in names
    )


@pytest.mark.parametrize("codec", ["none", "zstd", "bytegroup"])
def test_promote_then_fetch_is_byte_exact(hot, tmp_path, codec):
    warm = warm_tier(tmp_path, codec)
    r = promote(hot, warm, "tiny", 6)
    assert (r.files, r.skipped_files, r.already_committed) == (2, 0, False)
    assert r.bytes_raw == hot.read_manifest("tiny", 6).total_bytes
    assert warm.committed_steps("tiny") == [6]
    stored = sorted(os.listdir(warm.url_for("tiny", 6)))
    suffix = {"none": "", "zstd": ".zst", "bytegroup": ".ckz"}[codec]
    assert stored == sorted(
        [layout.DCP_METADATA + suffix, "__0_0.distcp" + suffix, layout.MANIFEST, layout.TIER_MANIFEST]
    )
    idx = warm.read_index("tiny", 6)
    assert idx.codec == codec and idx.total_stored_bytes == r.bytes_stored
    if codec != "none":
        assert r.bytes_stored < r.bytes_raw
    f = fetch(warm, "tiny", 6, str(tmp_path / "out"), threads=2)
    assert (f.files, f.bytes_raw, f.codec) == (2, r.bytes_raw, codec)
    assert same_files(f.dst_dir, hot.url_for("tiny", 6))
    assert verify_checkpoint(f.dst_dir).ok  # a plain DCP dir the trainer's loader accepts


def test_promote_twice_writes_nothing_the_second_time(hot, tmp_path):
    warm = warm_tier(tmp_path)
    promote(hot, warm, "tiny", 4)
    before = {
        n: os.stat(os.path.join(warm.url_for("tiny", 4), n)).st_mtime_ns for n in os.listdir(warm.url_for("tiny", 4))
    }
    again = promote(hot, warm, "tiny", 4)
    assert again.already_committed and (again.files, again.skipped_files) == (0, 2)
    assert before == {
        n: os.stat(os.path.join(warm.url_for("tiny", 4), n)).st_mtime_ns for n in os.listdir(warm.url_for("tiny", 4))
    }


def test_compress_stage_then_promote_reuses_the_staging(hot, tmp_path):
    warm = warm_tier(tmp_path)
    c = compress(hot, warm, "tiny", 6)
    assert c.files == 2 and warm.committed_steps("tiny") == []  # staged, not committed
    assert compress(hot, warm, "tiny", 6).skipped_files == 2  # idempotent
    p = promote(hot, warm, "tiny", 6)
    assert (p.files, p.skipped_files) == (0, 2) and warm.committed_steps("tiny") == [6]


@pytest.mark.parametrize(
    "phase", ["compress:file:__0_0.distcp", "compress:before_index", "promote:verified", "promote:before_commit"]
)
def test_a_crash_at_any_phase_leaves_nothing_committed_and_a_rerun_completes(hot, tmp_path, phase):
    warm = warm_tier(tmp_path)

    def crash(at: str) -> None:
        if at == phase:
            raise RuntimeError(f"injected crash at {at}")

    with pytest.raises(RuntimeError, match="injected"):
        promote(hot, warm, "tiny", 6, threads=1, fault=crash)
    assert warm.committed_steps("tiny") == []
    assert os.path.isdir(warm.tmp_url("tiny", 6))  # the crashed attempt's leftovers
    r = promote(hot, warm, "tiny", 6)
    assert warm.committed_steps("tiny") == [6] and not os.path.exists(warm.tmp_url("tiny", 6))
    # staging survives a crash after tier.json: the re-run only verifies and commits
    assert r.skipped_files == (2 if phase.startswith("promote:") else 0)
    assert same_files(fetch(warm, "tiny", 6, str(tmp_path / "o")).dst_dir, hot.url_for("tiny", 6))


def test_a_torn_staging_is_redone_not_trusted(hot, tmp_path):
    warm = warm_tier(tmp_path)
    compress(hot, warm, "tiny", 6)
    tmp = warm.tmp_url("tiny", 6)
    with open(os.path.join(tmp, layout.TIER_MANIFEST), "r+b") as f:
        f.truncate(40)  # torn by a crash mid-write
    flip(os.path.join(tmp, "__0_0.distcp.zst"))
    r = promote(hot, warm, "tiny", 6)
    assert r.files == 2 and warm.committed_steps("tiny") == [6]


def test_a_complete_staging_that_no_longer_verifies_is_staged_again(hot, tmp_path):
    """A staging left by an earlier compress call is re-checked, never committed blindly,
    and a bad one does not make promote fail forever."""
    warm = warm_tier(tmp_path)
    compress(hot, warm, "tiny", 6)
    flip(os.path.join(warm.tmp_url("tiny", 6), "__0_0.distcp.zst"))
    r = promote(hot, warm, "tiny", 6)
    assert r.files == 2 and warm.committed_steps("tiny") == [6]
    assert same_files(fetch(warm, "tiny", 6, str(tmp_path / "o")).dst_dir, hot.url_for("tiny", 6))


def test_a_damaged_source_is_never_promoted(hot, tmp_path):
    flip(hot.url_for("tiny", 6, "__0_0.distcp"))
    for codec in ("none", "zstd"):
        warm = warm_tier(tmp_path, codec)
        with pytest.raises(IntegrityError, match="__0_0.distcp"):
            promote(hot, warm, "tiny", 6)
        assert warm.committed_steps("tiny") == []


def test_a_corrupted_copy_is_caught_by_deep_verify(hot, tmp_path):
    warm = warm_tier(tmp_path)

    def corrupt_after_index(at: str) -> None:
        if at == "compress:before_index":
            flip(os.path.join(warm.tmp_url("tiny", 6), "__0_0.distcp.zst"))

    with pytest.raises(IntegrityError, match="reads back"):
        promote(hot, warm, "tiny", 6, deep_verify=True, fault=corrupt_after_index)
    assert warm.committed_steps("tiny") == []


def test_a_concurrent_promote_of_the_same_step_fails_fast(hot, tmp_path):
    warm = warm_tier(tmp_path)
    tmp = warm.tmp_url("tiny", 6)
    os.makedirs(tmp)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(StorageError, match="in progress"):
            promote(hot, warm, "tiny", 6)
    finally:
        os.close(fd)
    assert promote(hot, warm, "tiny", 6).files == 2


def test_promote_refuses_to_replace_a_different_committed_checkpoint(hot, tmp_path):
    warm = warm_tier(tmp_path)
    promote(hot, warm, "tiny", 6)
    m = hot.read_manifest("tiny", 6)
    m.training["note"] = "re-run"
    write_durable(hot.url_for("tiny", 6, layout.MANIFEST) + ".new", m.to_json())
    os.replace(hot.url_for("tiny", 6, layout.MANIFEST) + ".new", hot.url_for("tiny", 6, layout.MANIFEST))
    with pytest.raises(IntegrityError, match="never replaced"):
        promote(hot, warm, "tiny", 6)


def test_promote_needs_a_file_system_destination(hot, tmp_path):
    s3 = Tier(TierConfig(name="cold", url="s3://bucket/x", endpoint_url="http://127.0.0.1:1"))
    with pytest.raises(ConfigError, match="use archive"):
        promote(hot, s3, "tiny", 6)


# ---- fetch and restore ----------------------------------------------------------------


def test_fetch_names_the_damaged_or_missing_object_and_leaves_no_dir(hot, tmp_path):
    warm = warm_tier(tmp_path)
    promote(hot, warm, "tiny", 6)
    bad = warm.url_for("tiny", 6, "__0_0.distcp.zst")
    flip(bad)
    with pytest.raises(IntegrityError) as e:
        fetch(warm, "tiny", 6, str(tmp_path / "out"))
    assert bad in str(e.value) and e.value.path == bad
    os.unlink(bad)
    with pytest.raises(IntegrityError, match="missing"):
        fetch(warm, "tiny", 6, str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == sorted(["hot", "warm-zstd"])  # no partial output
    with pytest.raises(ConfigError, match="not an empty"):
        fetch(hot, "tiny", 6, str(tmp_path / "hot"))


def test_restore_takes_the_newest_and_prefers_the_hotter_tier(hot, tmp_path):
    warm = warm_tier(tmp_path)
    promote(hot, warm, "tiny", 6)
    r = restore([hot, warm], "tiny", str(tmp_path / "r1"))
    assert (r.tier, r.step, r.skipped) == ("hot", 6, [])
    assert active_leases(hot, "tiny") == []  # released after the read


def test_restore_falls_back_to_the_same_step_on_a_colder_tier_then_older_steps(hot, tmp_path):
    warm = warm_tier(tmp_path)
    promote(hot, warm, "tiny", 6)
    flip(hot.url_for("tiny", 6, "__0_0.distcp"))
    r = restore([hot, warm], "tiny", str(tmp_path / "r1"))
    assert (r.tier, r.step) == ("warm", 6)
    assert [(s.tier, s.step) for s in r.skipped] == [("hot", 6)] and "__0_0.distcp" in r.skipped[0].reason
    assert same_files(r.dst_dir, hot.url_for("tiny", 4)) is False and verify_checkpoint(r.dst_dir).ok
    flip(warm.url_for("tiny", 6, "__0_0.distcp.zst"))
    r2 = restore([hot, warm], "tiny", str(tmp_path / "r2"))
    assert (r2.tier, r2.step) == ("hot", 4) and len(r2.skipped) == 2
    assert same_files(r2.dst_dir, hot.url_for("tiny", 4))


def test_restore_skips_quarantined_and_reports_when_nothing_verifies(hot, tmp_path):
    run = hot.url_for("tiny")
    os.makedirs(layout.lifecycle_dir(run, 6))
    write_durable(layout.quarantine_record(run, 6), b'{"reason": "test"}\n')
    r = restore([hot], "tiny", str(tmp_path / "r"))
    assert r.step == 4 and r.skipped[0].reason.startswith("quarantined")
    for s in (2, 4):
        flip(hot.url_for("tiny", s, "__0_0.distcp"))
    with pytest.raises(CheckpointNotFoundError, match="step_000000002"):
        restore([hot], "tiny", str(tmp_path / "r2"))
    with pytest.raises(CheckpointNotFoundError, match="step 8"):
        restore([hot], "tiny", str(tmp_path / "r3"), step=8)


def test_restore_holds_a_lease_while_it_reads(hot, tmp_path, monkeypatch):
    seen = []
    import ckptflow.tasks.transfer._restore as mod

    real = mod.fetch

    def watching_fetch(tier, run_id, step, dst, **kw):
        seen.append([(x.step, x.holder) for x in active_leases(tier, run_id)])
        return real(tier, run_id, step, dst, **kw)

    monkeypatch.setattr(mod, "fetch", watching_fetch)
    with acquire_lease(hot, "tiny", 2, "someone-else"):
        restore([hot], "tiny", str(tmp_path / "r"), holder="drill-7")
    assert seen == [[(2, "someone-else"), (6, "drill-7")]]
