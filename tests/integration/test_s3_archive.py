"""Archive to S3 (a moto server over HTTP) and back: marker-last commits, resumable uploads
that never upload an object twice, damaged or missing objects named and skipped."""

from __future__ import annotations

import filecmp
import json
import os
import pickle
import shutil

import boto3
import pytest
from torch.distributed.checkpoint.metadata import Metadata

from ckptflow.tasks.config import TierConfig
from ckptflow.tasks.storage import Tier
from ckptflow.tasks.storage.s3 import META_CODEC, META_RAW, META_STORED
from ckptflow.tasks.transfer import archive, fetch, promote, restore
from ckptflow.trainer.errors import CheckpointNotFoundError, IntegrityError, ManifestError
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.checksum import hash_file
from ckptflow.trainer.format.manifest import FileEntry, Manifest
from ckptflow.trainer.fsutil import write_durable
from ckptflow.trainer.verify import verify_checkpoint


@pytest.fixture
def hot(tiny_run, tmp_path) -> Tier:
    shutil.copytree(tiny_run, tmp_path / "hot" / "tiny")
    return Tier(TierConfig(name="hot", url=str(tmp_path / "hot")))


def cold_tier(endpoint: str, bucket: str, codec: str = "zstd", **kw) -> Tier:
    return Tier(
        TierConfig(
            name="cold",
            url=f"s3://{bucket}/archive",
            codec=codec,
            endpoint_url=endpoint,
            multipart_chunksize_mb=5,
            **kw,
        )
    )


def objects(endpoint: str, bucket: str) -> dict[str, dict]:
    """key -> {size, etag, last_modified} of everything in the bucket."""
    c = boto3.client("s3", endpoint_url=endpoint)
    return {
        o["Key"]: {"size": o["Size"], "etag": o["ETag"], "mtime": o["LastModified"]}
        for o in c.list_objects_v2(Bucket=bucket).get("Contents", [])
    }


def key(step: int, name: str) -> str:
    return f"archive/tiny/{layout.step_name(step)}/{name}"


def same_as_hot(dst: str, hot: Tier, step: int) -> bool:
    src = hot.url_for("tiny", step)
    return sorted(os.listdir(dst)) == sorted(os.listdir(src)) and all(
        filecmp.cmp(os.path.join(dst, n), os.path.join(src, n), shallow=False) for n in os.listdir(src)
    )


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_archive_then_fetch_is_byte_exact_with_policy_on_every_object(hot, s3_endpoint, s3_bucket, tmp_path, codec):
    cold = cold_tier(s3_endpoint, s3_bucket, codec, storage_class="STANDARD_IA")
    r = archive(hot, cold, "tiny", 6)
    assert (r.files, r.skipped_files, r.uri) == (2, 0, cold.url_for("tiny", 6))
    assert cold.committed_steps("tiny") == [6]
    c = boto3.client("s3", endpoint_url=s3_endpoint)
    suffix = ".zst" if codec == "zstd" else ""
    head = c.head_object(Bucket=s3_bucket, Key=key(6, "__0_0.distcp" + suffix))
    m = hot.read_manifest("tiny", 6).files["__0_0.distcp"]
    assert head["StorageClass"] == "STANDARD_IA"
    assert head["Metadata"][META_RAW] == m.checksum and head["Metadata"][META_CODEC] == codec
    tags = c.get_object_tagging(Bucket=s3_bucket, Key=key(6, "__0_0.distcp" + suffix))["TagSet"]
    assert {t["Key"]: t["Value"] for t in tags} == {"ckptflow-run": "tiny", "ckptflow-step": "6"}
    # the records stay STANDARD so the tier can always be listed and read
    assert (
        "StorageClass" not in c.head_object(Bucket=s3_bucket, Key=key(6, layout.COMMIT_MARKER))
        or c.head_object(Bucket=s3_bucket, Key=key(6, layout.COMMIT_MARKER))["StorageClass"] == "STANDARD"
    )
    f = fetch(cold, "tiny", 6, str(tmp_path / "out"), threads=2)
    assert same_as_hot(f.dst_dir, hot, 6) and verify_checkpoint(f.dst_dir).ok
    assert f.download_seconds > 0 and f.bytes_stored == r.bytes_stored


def test_archive_twice_uploads_nothing_the_second_time(hot, s3_endpoint, s3_bucket):
    cold = cold_tier(s3_endpoint, s3_bucket)
    archive(hot, cold, "tiny", 6)
    before = objects(s3_endpoint, s3_bucket)
    again = archive(hot, cold, "tiny", 6)
    assert again.already_committed and (again.files, again.skipped_files, again.bytes_moved) == (0, 2, 0)
    assert objects(s3_endpoint, s3_bucket) == before  # not one object rewritten


def test_an_interrupted_archive_is_never_committed_and_resumes_with_the_rest(hot, s3_endpoint, s3_bucket, tmp_path):
    cold = cold_tier(s3_endpoint, s3_bucket)

    def die_after_first_object(phase: str) -> None:
        if phase.startswith("archive:uploaded:"):
            raise KeyboardInterrupt("injected: killed after one object")

    with pytest.raises(KeyboardInterrupt):
        archive(hot, cold, "tiny", 6, threads=1, fault=die_after_first_object)
    partial = objects(s3_endpoint, s3_bucket)
    assert len(partial) == 1 and key(6, layout.DCP_METADATA + ".zst") in partial
    assert cold.committed_steps("tiny") == []
    with pytest.raises(CheckpointNotFoundError):
        fetch(cold, "tiny", 6, str(tmp_path / "o"))

    r = archive(hot, cold, "tiny", 6)
    assert (r.files, r.skipped_files) == (1, 1)  # only the object that was missing
    after = objects(s3_endpoint, s3_bucket)
    done = key(6, layout.DCP_METADATA + ".zst")
    assert after[done] == partial[done]  # the first upload was kept, not redone
    assert cold.committed_steps("tiny") == [6]
    assert same_as_hot(fetch(cold, "tiny", 6, str(tmp_path / "o")).dst_dir, hot, 6)


@pytest.mark.parametrize("phase", ["archive:before_index", "archive:before_marker"])
def test_a_crash_before_the_marker_leaves_it_uncommitted(hot, s3_endpoint, s3_bucket, phase):
    cold = cold_tier(s3_endpoint, s3_bucket)

    def crash(at: str) -> None:
        if at == phase:
            raise RuntimeError("injected")

    with pytest.raises(RuntimeError):
        archive(hot, cold, "tiny", 6, fault=crash)
    assert cold.committed_steps("tiny") == [] and key(6, layout.COMMIT_MARKER) not in objects(s3_endpoint, s3_bucket)
    r = archive(hot, cold, "tiny", 6)
    assert (r.files, r.skipped_files) == (0, 2) and cold.committed_steps("tiny") == [6]


def test_missing_or_corrupt_object_is_named_and_restore_falls_back(hot, s3_endpoint, s3_bucket, tmp_path):
    cold = cold_tier(s3_endpoint, s3_bucket)
    archive(hot, cold, "tiny", 4)
    archive(hot, cold, "tiny", 6)
    c = boto3.client("s3", endpoint_url=s3_endpoint)
    shard = key(6, "__0_0.distcp.zst")
    url = cold.url_for("tiny", 6, "__0_0.distcp.zst")
    # corrupt: same size, same metadata, different bytes (bit rot, a bad overwrite)
    body = bytearray(c.get_object(Bucket=s3_bucket, Key=shard)["Body"].read())
    meta = c.head_object(Bucket=s3_bucket, Key=shard)["Metadata"]
    body[len(body) // 2] ^= 0xFF
    c.put_object(Bucket=s3_bucket, Key=shard, Body=bytes(body), Metadata=meta)
    with pytest.raises(IntegrityError) as e:
        fetch(cold, "tiny", 6, str(tmp_path / "a"))
    assert url in str(e.value) and e.value.path == url
    r = restore([cold], "tiny", str(tmp_path / "b"))
    assert r.step == 4 and [(s.step, s.uri) for s in r.skipped] == [(6, cold.url_for("tiny", 6))]
    assert url in r.skipped[0].reason and same_as_hot(r.dst_dir, hot, 4)
    # missing: the marker is there, the object is not
    c.delete_object(Bucket=s3_bucket, Key=shard)
    with pytest.raises(IntegrityError, match="missing"):
        fetch(cold, "tiny", 6, str(tmp_path / "c"))
    assert not (tmp_path / "c").exists()
    # a re-run of archive notices and repairs the committed-but-incomplete checkpoint
    r2 = archive(hot, cold, "tiny", 6)
    assert (r2.files, r2.already_committed) == (1, False)
    assert same_as_hot(fetch(cold, "tiny", 6, str(tmp_path / "d")).dst_dir, hot, 6)


def test_restore_across_all_three_tiers(hot, s3_endpoint, s3_bucket, tmp_path):
    warm = Tier(TierConfig(name="warm", url=str(tmp_path / "warm"), codec="zstd"))
    cold = cold_tier(s3_endpoint, s3_bucket, codec="bytegroup")
    promote(hot, warm, "tiny", 4)
    archive(hot, cold, "tiny", 6)
    shutil.rmtree(hot.url_for("tiny"))  # the node with the hot tier is gone
    r = restore([hot, warm, cold], "tiny", str(tmp_path / "r"))
    assert (r.tier, r.step) == ("cold", 6) and verify_checkpoint(r.dst_dir).ok
    assert r.fetch.codec == "bytegroup" and r.fetch.bytes_stored < r.fetch.bytes_raw


def test_archive_from_warm_copies_stored_bytes_or_transcodes(hot, s3_endpoint, s3_bucket, tmp_path):
    warm = Tier(TierConfig(name="warm", url=str(tmp_path / "warm"), codec="zstd"))
    promote(hot, warm, "tiny", 6)
    same = cold_tier(s3_endpoint, s3_bucket, codec="zstd")
    archive(warm, same, "tiny", 6)
    w = warm.read_index("tiny", 6).files["__0_0.distcp"]
    c = same.read_index("tiny", 6).files["__0_0.distcp"]
    assert (c.stored_name, c.stored_size, c.stored_checksum) == (w.stored_name, w.stored_size, w.stored_checksum)
    other = Tier(TierConfig(name="cold2", url=f"s3://{s3_bucket}/other", codec="bytegroup", endpoint_url=s3_endpoint))
    r = archive(warm, other, "tiny", 6)  # zstd -> raw -> bytegroup, streaming through a pipe
    assert other.read_index("tiny", 6).files["__0_0.distcp"].stored_name == "__0_0.distcp.ckz"
    assert r.files == 2
    assert same_as_hot(fetch(other, "tiny", 6, str(tmp_path / "o")).dst_dir, hot, 6)


def test_a_damaged_source_is_never_archived(hot, s3_endpoint, s3_bucket):
    path = hot.url_for("tiny", 6, "__0_0.distcp")
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")
    for codec in ("none", "zstd"):
        cold = cold_tier(s3_endpoint, s3_bucket, codec)
        with pytest.raises(IntegrityError, match="__0_0.distcp"):
            archive(hot, cold, "tiny", 6)
        assert cold.committed_steps("tiny") == []


def test_archive_refuses_to_replace_a_different_archived_checkpoint(hot, s3_endpoint, s3_bucket):
    cold = cold_tier(s3_endpoint, s3_bucket)
    archive(hot, cold, "tiny", 6)
    m = hot.read_manifest("tiny", 6)
    m.training["note"] = "edited"
    os.unlink(hot.url_for("tiny", 6, layout.MANIFEST))
    write_durable(hot.url_for("tiny", 6, layout.MANIFEST), m.to_json())
    with pytest.raises(ManifestError, match="never replaced"):
        archive(hot, cold, "tiny", 6)


def test_big_files_go_multipart_and_round_trip(s3_endpoint, s3_bucket, tmp_path):
    """A 12 MiB shard with 5 MiB parts: three parts, uploaded in parallel, fetched back exact."""
    run = tmp_path / "hot" / "big"
    ck = run / layout.step_name(1)
    ck.mkdir(parents=True)
    # a DCP .metadata of no tensors: fetch parses it as `ckptflow verify` does (archive never does)
    (ck / layout.DCP_METADATA).write_bytes(pickle.dumps(Metadata(state_dict_metadata={})))
    (ck / "__0_0.distcp").write_bytes(os.urandom(12 << 20))
    files = {n: FileEntry(*reversed(hash_file(str(ck / n)))) for n in os.listdir(ck)}
    (ck / layout.MANIFEST).write_bytes(Manifest(run_id="big", step=1, world_size=1, files=files).to_json())
    hot = Tier(TierConfig(name="hot", url=str(tmp_path / "hot")))
    cold = Tier(
        TierConfig(
            name="cold",
            url=f"s3://{s3_bucket}/mp",
            codec="none",
            endpoint_url=s3_endpoint,
            multipart_chunksize_mb=5,
            max_concurrency=4,
        )
    )
    r = archive(hot, cold, "big", 1)
    etag = boto3.client("s3", endpoint_url=s3_endpoint).head_object(
        Bucket=s3_bucket, Key=f"mp/big/{layout.step_name(1)}/__0_0.distcp"
    )["ETag"]
    assert etag.strip('"').endswith("-3") and r.bytes_moved >= 12 << 20
    out = fetch(cold, "big", 1, str(tmp_path / "out"))
    assert filecmp.cmp(os.path.join(out.dst_dir, "__0_0.distcp"), str(ck / "__0_0.distcp"), shallow=False)


def test_the_tier_index_records_raw_and_stored_digests(hot, s3_endpoint, s3_bucket):
    cold = cold_tier(s3_endpoint, s3_bucket)
    archive(hot, cold, "tiny", 6)
    raw = (
        boto3.client("s3", endpoint_url=s3_endpoint)
        .get_object(Bucket=s3_bucket, Key=key(6, layout.TIER_MANIFEST))["Body"]
        .read()
    )
    d = json.loads(raw)
    assert d["format"] == "ckptflow.tier-index" and d["codec"] == "zstd"
    man = hot.read_manifest("tiny", 6)
    for name, e in d["files"].items():
        assert (e["size"], e["checksum"]) == (man.files[name].size, man.files[name].checksum)
        assert e["stored_name"] == name + ".zst"
        head = boto3.client("s3", endpoint_url=s3_endpoint).head_object(Bucket=s3_bucket, Key=key(6, e["stored_name"]))
        assert head["ContentLength"] == e["stored_size"] and head["Metadata"][META_STORED] == e["stored_checksum"]
