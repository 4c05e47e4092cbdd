"""Hostile input: nothing from storage is unpickled before it verifies, signing is refused
everywhere, names cannot escape, prune cannot delete outside its run, secrets never leak.

Every reader is the real one: the trainer's resume (in-process and a real job), ``ckptflow
verify``, the restore sanity step, the lifecycle's verify stage, promote and archive
source reads, fetch and restore, a restore drill, the codec tool. A checkpoint's
``.metadata`` is replaced by a pickle whose ``__reduce__`` would create a marker directory:
the marker must never appear.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import subprocess
import uuid

import boto3
import pytest

from ckptflow.tasks.config import TierConfig
from ckptflow.tasks.storage import Tier
from ckptflow.trainer.errors import CheckpointNotFoundError, CkptflowError, IntegrityError, UnsafePathError
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.checksum import hash_file
from ckptflow.trainer.format.manifest import KEY_BLOCK_ENV, KEY_ENV
from tests.helpers import PY, REPO, free_port, make_run, step_dir, torchrun_env

KEY = "ckptflow-test-signing-key-0123456789"


class _Mkdir:
    """Unpickling this creates ``path``: proof that a pickle ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


@pytest.fixture(scope="module")
def signed_run(tmp_path_factory):
    """Steps 2, 4, 6 of the tiny model, manifests signed with KEY (read-only: copy it)."""
    return make_run(tmp_path_factory.mktemp("signed"), "signed", env={KEY_ENV: KEY})


def _copy(src: str, tmp_path) -> str:
    dst = os.path.join(tmp_path, "hot", os.path.basename(src))
    shutil.copytree(src, dst)
    return dst


def _evil_metadata(run: str, marker: str, *, update_manifest: bool) -> None:
    path = os.path.join(step_dir(run, 6), layout.DCP_METADATA)
    with open(path, "wb") as f:
        f.write(pickle.dumps(_Mkdir(marker)))
    if update_manifest:  # an attacker who knows the format; without the key they cannot re-sign
        mpath = os.path.join(step_dir(run, 6), layout.MANIFEST)
        d = json.loads(open(mpath).read())
        digest, size = hash_file(path)
        d["files"][layout.DCP_METADATA] = {"size": size, "checksum": digest}
        with open(mpath, "w") as f:
            json.dump(d, f)


def _edit_training_meta(run: str) -> None:
    mpath = os.path.join(step_dir(run, 6), layout.MANIFEST)
    d = json.loads(open(mpath).read())
    d["training"]["loss"] = 0.001
    with open(mpath, "w") as f:
        json.dump(d, f)


def _every_reader(run: str, tmp_path, cold: Tier | None) -> dict[str, object]:
    """Run each code path that reads checkpoint 6 of ``run``; what each returned or raised."""
    from ckptflow.tasks.checkpoint import CheckpointRef
    from ckptflow.tasks.codec.tool import compress_dir
    from ckptflow.tasks.config import CkptflowConfig
    from ckptflow.tasks.drill import drill_one
    from ckptflow.tasks.stages import VERIFY, run_stage
    from ckptflow.tasks.transfer import archive, fetch, promote, restore
    from ckptflow.trainer.resume import find_resume_point

    root, run_id = os.path.dirname(run), os.path.basename(run)
    hot = Tier(TierConfig(name="hot", url=root))
    warm = Tier(TierConfig(name="warm", url=str(tmp_path / "warm"), codec="bytegroup"))
    out: dict[str, object] = {}

    def attempt(name, fn):
        try:
            out[name] = fn()
        except (CkptflowError, OSError, ValueError) as e:
            out[name] = e

    attempt("resume", lambda: find_resume_point(run))
    attempt(
        "verify_cli",
        lambda: subprocess.run(
            [PY, "-m", "ckptflow.cli.main", "verify", step_dir(run, 6)],
            cwd=REPO,
            env=torchrun_env(),
            capture_output=True,
            text=True,
            timeout=120,
        ),
    )
    attempt(
        "sanity",
        lambda: subprocess.run(
            [PY, "-m", "ckptflow.tasks.sanity", step_dir(run, 6)],
            cwd=REPO,
            env=torchrun_env(),
            capture_output=True,
            text=True,
            timeout=300,
        ),
    )
    attempt("promote", lambda: promote(hot, warm, run_id, 6))
    if cold is not None:
        attempt("archive", lambda: archive(hot, cold, run_id, 6))
    attempt("fetch", lambda: fetch(hot, run_id, 6, str(tmp_path / "fetched")))
    attempt("restore", lambda: restore([hot], run_id, str(tmp_path / "restored")))
    attempt("drill", lambda: drill_one(hot, run_id, 6, scratch_root=str(tmp_path / "drill")))
    attempt("codec_tool", lambda: compress_dir(step_dir(run, 6), str(tmp_path / "compressed")))
    # last but one: a failed verify stage quarantines step 6, which restore then skips for that reason
    ref = CheckpointRef(CkptflowConfig(hot=TierConfig(name="hot", url=root)), run_id, 6)
    attempt("lifecycle_verify", lambda: run_stage(VERIFY, ref))
    attempt(
        "training_resume",
        lambda: subprocess.run(
            [
                PY,
                "-m",
                "ckptflow.trainer.train",
                "--parallel",
                "none",
                "--ckpt-root",
                root,
                "--run-id",
                run_id,
                "--model",
                "tiny",
                "--max-steps",
                "8",
                "--save-every",
                "2",
            ],
            cwd=REPO,
            env=torchrun_env(),
            capture_output=True,
            text=True,
            timeout=300,
        ),
    )
    return out


def _assert_step6_refused(
    out: dict[str, object], run: str, why: str, *, fallback: int | None, fetch_why: str | None = None
) -> None:
    """Every reader refused step 6 (naming ``why``; readers that fetch name ``fetch_why``, the
    damaged file) and, where it falls back, fell back."""
    fetch_why = fetch_why or why
    rep = out["resume"]
    assert (rep.chosen.step if rep.chosen else None) == fallback
    assert any(p == step_dir(run, 6) and why in w for p, w in rep.skipped), rep.skipped
    assert out["verify_cli"].returncode == 1 and why in out["verify_cli"].stderr
    assert out["sanity"].returncode == 1 and why in out["sanity"].stdout
    lv = out["lifecycle_verify"]
    assert not lv.ok and lv.record == "quarantined" and lv.reasons[0].startswith("integrity")
    assert why in lv.reasons[0] and not lv.body["sanity"]
    for name in ("promote", "archive", "fetch"):
        if name in out:
            assert isinstance(out[name], IntegrityError), (name, out[name])
    if fallback is None:
        assert isinstance(out["restore"], CheckpointNotFoundError)
    else:
        assert out["restore"].step == fallback and any(fetch_why in s.reason for s in out["restore"].skipped)
    assert not out["drill"].ok and fetch_why in out["drill"].failure
    train = out["training_resume"]
    if fallback is None:
        assert train.returncode != 0 and "no committed checkpoint under" in train.stderr
    else:
        assert train.returncode == 0 and f"resumed from {step_dir(run, fallback)}" in train.stderr


# ---- nothing is unpickled before it verifies ------------------------------------------------


def test_a_malicious_metadata_never_runs_while_the_manifest_is_intact(
    tiny_run, tmp_path, monkeypatch, s3_endpoint, s3_bucket
):
    monkeypatch.delenv(KEY_ENV, raising=False)
    run = _copy(tiny_run, tmp_path)
    marker = str(tmp_path / "PWNED")
    _evil_metadata(run, marker, update_manifest=False)
    cold = Tier(TierConfig(name="cold", url=f"s3://{s3_bucket}/c", codec="bytegroup", endpoint_url=s3_endpoint))
    out = _every_reader(run, tmp_path, cold)
    assert not os.path.exists(marker), "a pickle from storage ran"
    _assert_step6_refused(out, run, os.path.join(step_dir(run, 6), layout.DCP_METADATA), fallback=4)
    # the codec tool checks .metadata against the manifest before parsing it
    assert isinstance(out["codec_tool"], IntegrityError)
    assert layout.DCP_METADATA in str(out["codec_tool"]) and "refusing to parse" in str(out["codec_tool"])


def test_a_malicious_metadata_with_a_forged_unsigned_manifest_never_runs_and_resume_falls_back(
    tiny_run, tmp_path, monkeypatch
):
    """No signing key: the attacker replaces .metadata with a pickle whose __reduce__ runs code and
    rewrites its size and checksum in the manifest. Every byte matches, yet nothing unpickles it:
    verify reports it, the sanity step and the lifecycle refuse it, and resume falls back to step 4."""
    monkeypatch.delenv(KEY_ENV, raising=False)
    run = _copy(tiny_run, tmp_path)
    marker = str(tmp_path / "PWNED")
    _evil_metadata(run, marker, update_manifest=True)
    out = _every_reader(run, tmp_path, None)
    assert not os.path.exists(marker), "a pickle from storage ran"
    why = "which DCP never writes there"
    assert out["verify_cli"].returncode == 1 and why in out["verify_cli"].stderr
    assert out["sanity"].returncode == 1 and why in out["sanity"].stdout
    lv = out["lifecycle_verify"]
    assert not lv.ok and lv.record == "quarantined" and why in lv.reasons[0]
    rep = out["resume"]
    assert rep.chosen.step == 4 and any(p == step_dir(run, 6) and why in w for p, w in rep.skipped), rep.skipped
    train = out["training_resume"]
    assert train.returncode == 0 and f"resumed from {step_dir(run, 4)}" in train.stderr, train.stderr[-2000:]
    # and on its own (no quarantine record yet): the load's reader refuses it, the job falls back
    other = tmp_path / "other"
    os.makedirs(other)
    run2 = _copy(tiny_run, other)
    _evil_metadata(run2, marker, update_manifest=True)
    r = subprocess.run(
        [
            PY,
            "-m",
            "ckptflow.trainer.train",
            "--parallel",
            "none",
            "--ckpt-root",
            os.path.dirname(run2),
            "--run-id",
            "tiny",
            "--model",
            "tiny",
            "--max-steps",
            "8",
            "--save-every",
            "2",
        ],
        cwd=REPO,
        env=torchrun_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and f"resumed from {step_dir(run2, 4)}" in r.stderr, r.stderr[-2000:]
    assert why in r.stderr and not os.path.exists(marker)


def test_a_malicious_metadata_with_a_forged_manifest_is_refused_when_signing_is_on(
    signed_run, tmp_path, monkeypatch, s3_endpoint, s3_bucket
):
    """The attacker recomputes the checksum into the manifest but cannot sign it."""
    monkeypatch.setenv(KEY_ENV, KEY)
    run = _copy(signed_run, tmp_path)
    marker = str(tmp_path / "PWNED")
    _evil_metadata(run, marker, update_manifest=True)
    cold = Tier(TierConfig(name="cold", url=f"s3://{s3_bucket}/c", codec="bytegroup", endpoint_url=s3_endpoint))
    out = _every_reader(run, tmp_path, cold)
    assert not os.path.exists(marker), "a pickle from storage ran"
    _assert_step6_refused(out, run, "signature does not match", fallback=4)
    for name in ("promote", "archive", "fetch"):
        assert "signature does not match" in str(out[name])
    assert isinstance(out["codec_tool"], IntegrityError)


@pytest.mark.parametrize("case", ["unsigned", "tampered"])
def test_with_a_key_configured_unsigned_or_tampered_manifests_are_refused_everywhere(
    case, tiny_run, signed_run, tmp_path, monkeypatch
):
    monkeypatch.setenv(KEY_ENV, KEY)
    if case == "unsigned":  # every checkpoint of the run: nothing to fall back to
        run = _copy(tiny_run, tmp_path)
        why, fallback = "not signed", None
    else:  # one value changed after signing
        run = _copy(signed_run, tmp_path)
        _edit_training_meta(run)
        why, fallback = "signature does not match", 4
    out = _every_reader(run, tmp_path, None)
    _assert_step6_refused(out, run, why, fallback=fallback)


def test_the_key_can_come_from_a_prefect_secret_block(prefect_api, signed_run, tiny_run, tmp_path, monkeypatch):
    """Flows read the block; a process without prefect (the trainer) fails closed, never open."""
    from prefect.blocks.system import Secret

    from ckptflow.flows.lifecycle import lifecycle

    name = f"ckptflow-manifest-key-{uuid.uuid4().hex[:8]}"
    Secret(value=KEY).save(name, overwrite=True)
    # resolving the block exports the key into os.environ: setenv first so that teardown removes it
    monkeypatch.setenv(KEY_ENV, "")
    monkeypatch.delenv(KEY_ENV)
    monkeypatch.setenv(KEY_BLOCK_ENV, name)
    env = dict(torchrun_env(), **{KEY_BLOCK_ENV: name})
    env.pop(KEY_ENV, None)
    code = f"from ckptflow.trainer.verify import verify_checkpoint; verify_checkpoint({step_dir(signed_run, 6)!r})"
    r = subprocess.run([PY, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and KEY_ENV in r.stderr and "ConfigError" in r.stderr

    for src, expect in ((signed_run, "done"), (tiny_run, "quarantined")):
        hot = tmp_path / f"hot-{expect}"
        shutil.copytree(src, hot / os.path.basename(src))
        cfg = tmp_path / f"{expect}.toml"
        cfg.write_text(
            f'[hot]\nurl = "{hot}"\n[hot.retention]\nkeep_last = 5\n[warm]\nurl = "{tmp_path / expect}"\n'
            'codec = "zstd"\n[lifecycle]\nsanity_step = true\n'
        )
        os.environ.pop(KEY_ENV, None)  # resolve from the block afresh for each flow run
        out = lifecycle(run_id=os.path.basename(src), step=6, config=str(cfg))
        assert out["status"] == expect, out
        if expect == "done":  # the sanity step's own process got the key too
            assert out["verify"]["sanity"]["probe_match"] == "bitwise"
        else:
            assert "not signed" in out["verify"]["reasons"][0]


# ---- names, symlinks, keys outside the run ----------------------------------------------------


def test_manifest_names_that_escape_are_refused_by_every_local_reader(tiny_run, tmp_path):
    from ckptflow.trainer.verify import verify_checkpoint

    hot_root = tmp_path / "hot"
    run = _copy(tiny_run, tmp_path)
    hot = Tier(TierConfig(name="hot", url=str(hot_root)))
    for bad in ("/etc/passwd", "../../../etc/passwd", "a/../../x"):
        d = json.loads(open(os.path.join(step_dir(run, 6), layout.MANIFEST)).read())
        d["files"][bad] = {"size": 1, "checksum": "0" * 32}
        with open(os.path.join(step_dir(run, 4), layout.MANIFEST), "w") as f:  # damage step 4 with it
            json.dump(dict(d, step=4), f)
        assert "unsafe file name" in str(verify_checkpoint(step_dir(run, 4)).problems[0])
        with pytest.raises(UnsafePathError):
            hot.open_checkpoint("tiny", 4)


def test_a_symlink_out_of_a_checkpoint_is_refused_by_verify_and_resume(tiny_run, tmp_path):
    from ckptflow.trainer.resume import find_resume_point
    from ckptflow.trainer.verify import verify_checkpoint

    run = _copy(tiny_run, tmp_path)
    d = step_dir(run, 6)
    shard = sorted(n for n in os.listdir(d) if n.endswith(".distcp"))[0]
    outside = tmp_path / "outside.distcp"
    shutil.move(os.path.join(d, shard), outside)
    os.symlink(outside, os.path.join(d, shard))  # same bytes, outside the checkpoint
    assert "resolves outside the checkpoint" in str(verify_checkpoint(d).problems[0])
    assert find_resume_point(run).chosen.step == 4


def test_tier_reads_refuse_a_symlink_out_of_a_checkpoint(tiny_run, tmp_path):
    from ckptflow.tasks.transfer import fetch, promote

    run = _copy(tiny_run, tmp_path)
    d = step_dir(run, 6)
    shard = sorted(n for n in os.listdir(d) if n.endswith(".distcp"))[0]
    shutil.move(os.path.join(d, shard), tmp_path / "outside.distcp")
    os.symlink(tmp_path / "outside.distcp", os.path.join(d, shard))
    hot = Tier(TierConfig(name="hot", url=str(tmp_path / "hot")))
    warm = Tier(TierConfig(name="warm", url=str(tmp_path / "warm"), codec="zstd"))
    with pytest.raises(UnsafePathError):
        fetch(hot, "tiny", 6, str(tmp_path / "out"))
    with pytest.raises(UnsafePathError):
        promote(hot, warm, "tiny", 6)


def test_a_hot_checkpoint_copied_under_another_run_or_step_is_refused_by_the_verify_stage(tiny_run, tmp_path):
    from ckptflow.tasks.checkpoint import CheckpointRef
    from ckptflow.tasks.config import CkptflowConfig
    from ckptflow.tasks.verify import verify

    run = _copy(tiny_run, tmp_path)
    other = tmp_path / "hot" / "other"
    shutil.copytree(run, other)
    cfg = CkptflowConfig(hot=TierConfig(name="hot", url=str(tmp_path / "hot")))
    out = verify(CheckpointRef(cfg, "other", 6), sanity_step=False, expectations=False)
    assert not out.ok and "manifest is for tiny step 6, not other step 6" in out.reasons[0]
    os.rename(step_dir(run, 6), step_dir(run, 8))
    assert "not tiny step 8" in verify(CheckpointRef(cfg, "tiny", 8), sanity_step=False, expectations=False).reasons[0]


def test_a_cold_checkpoint_copied_under_another_run_is_refused(tiny_run, tmp_path, s3_endpoint, s3_bucket):
    """Objects put under run B's prefix carry run A's manifest: names outside the run's prefix."""
    from ckptflow.tasks.transfer import archive, fetch

    _copy(tiny_run, tmp_path)
    hot = Tier(TierConfig(name="hot", url=str(tmp_path / "hot")))
    cold = Tier(TierConfig(name="cold", url=f"s3://{s3_bucket}/c", codec="zstd", endpoint_url=s3_endpoint))
    archive(hot, cold, "tiny", 6)
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    src = f"c/tiny/{layout.step_name(6)}/"
    for o in s3.list_objects_v2(Bucket=s3_bucket, Prefix=src)["Contents"]:
        s3.copy_object(
            Bucket=s3_bucket,
            Key=o["Key"].replace("/tiny/", "/other/"),
            CopySource={"Bucket": s3_bucket, "Key": o["Key"]},
        )
    assert cold.committed_steps("other") == [6]  # listed (it has a marker) ...
    with pytest.raises(IntegrityError, match="not other step 6"):  # ... but never trusted
        fetch(cold, "other", 6, str(tmp_path / "out"))


def test_prune_never_deletes_outside_its_tier_and_run(tiny_run, tmp_path, s3_endpoint, s3_bucket, monkeypatch):
    from ckptflow.tasks.config import RetentionConfig
    from ckptflow.tasks.prune import prune
    from ckptflow.tasks.retention import build_policy
    from ckptflow.tasks.transfer import archive

    run = _copy(tiny_run, tmp_path)
    hot = Tier(TierConfig(name="hot", url=str(tmp_path / "hot")))
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    # a symlink inside a step dir, and a step dir that is itself a symlink to the victim
    os.symlink(victim / "precious", os.path.join(step_dir(run, 2), "link-out"))
    shutil.copy(os.path.join(step_dir(run, 4), layout.MANIFEST), victim / layout.MANIFEST)
    shutil.rmtree(step_dir(run, 4))
    os.symlink(victim, step_dir(run, 4))
    rep = prune(hot, "tiny", build_policy(RetentionConfig(keep_last=1)), verified_steps=[2, 4, 6])
    assert (victim / "precious").read_text() == "keep me" and (victim / layout.MANIFEST).exists()
    assert 2 in rep.deleted and not os.path.exists(step_dir(run, 2))
    with pytest.raises(CkptflowError):
        prune(hot, "../tiny", build_policy(RetentionConfig(keep_last=1)))

    # on S3: a listing that strays outside the step's prefix is refused before any delete
    cold = Tier(TierConfig(name="cold", url=f"s3://{s3_bucket}/c", codec="zstd", endpoint_url=s3_endpoint))
    archive(hot, cold, "tiny", 6)
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.put_object(Bucket=s3_bucket, Key="c/other-run/precious", Body=b"keep me")
    real_find = cold.fs.find
    monkeypatch.setattr(cold.fs, "find", lambda uri, **k: real_find(uri, **k) + [f"{s3_bucket}/c/other-run/precious"])
    with pytest.raises(UnsafePathError):
        cold.delete_checkpoint("tiny", 6)
    assert s3.get_object(Bucket=s3_bucket, Key="c/other-run/precious")["Body"].read() == b"keep me"
    assert s3.list_objects_v2(Bucket=s3_bucket, Prefix="c/tiny/")["KeyCount"] > 0  # nothing deleted either


# ---- secrets never leak -----------------------------------------------------------------------


def test_no_credential_or_webhook_token_in_logs_artifacts_events_or_errors(
    prefect_api, tiny_run, tmp_path, s3_endpoint, s3_bucket, monkeypatch, caplog, capfd
):
    import s3fs

    from ckptflow.flows.alerts import notify_on_failure
    from ckptflow.flows.drill import DrillFailed, restore_drill
    from ckptflow.flows.lifecycle import lifecycle
    from ckptflow.tasks.transfer import archive, restore

    tag = uuid.uuid4().hex[:12]
    secret, key_id, token = f"ckptflow-canary-{tag}", f"CKPTFLOWCANARY{tag.upper()}", f"ckptflow-canary-tok-{tag}"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_SESSION_TOKEN", f"ckptflow-canary-session-{tag}")
    monkeypatch.delenv(KEY_ENV, raising=False)
    s3fs.S3FileSystem.clear_instance_cache()  # new file systems pick the canary credentials up
    hook = f"http://127.0.0.1:{free_port()}/hook?token={token}"
    monkeypatch.setenv("CKPTFLOW_WEBHOOK_URL", hook)
    hot = tmp_path / "hot"
    shutil.copytree(tiny_run, hot / "tiny")
    cfg = tmp_path / "ckptflow.toml"
    cfg.write_text(
        f'[hot]\nurl = "{hot}"\n[hot.retention]\nkeep_last = 5\n[warm]\nurl = "{tmp_path / "warm"}"\n'
        f'codec = "zstd"\n[cold]\nurl = "s3://{s3_bucket}/ckpt"\ncodec = "zstd"\n'
        f'endpoint_url = "{s3_endpoint}"\n[cold.retention]\nkeep_last = 5\n'
        f'[lifecycle]\nsanity_step = false\n[drill]\nwebhook_url = "{hook}"\nrandom_older = false\n'
    )
    for name in ("trainer", "tasks", "flows", "prefect"):  # ours and Prefect's, every level
        caplog.set_level(logging.DEBUG, logger=name)
    errors: list[str] = []

    assert lifecycle(run_id="tiny", step=6, config=str(cfg))["status"] == "done"
    assert restore_drill(run_id="tiny", config=str(cfg), history_dir=str(tmp_path / "d"))["ok"]
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    key = sorted(
        o["Key"] for o in s3.list_objects_v2(Bucket=s3_bucket, Prefix="ckpt/tiny/")["Contents"] if "/__" in o["Key"]
    )[0]
    s3.put_object(Bucket=s3_bucket, Key=key, Body=b"damaged")
    with pytest.raises(DrillFailed) as ei:
        restore_drill(run_id="tiny", config=str(cfg), history_dir=str(tmp_path / "d"))
    errors.append(str(ei.value))
    hot_tier = Tier(TierConfig(name="hot", url=str(hot)))
    for url, endpoint in (
        (f"s3://no-such-bucket-{tag}/x", s3_endpoint),
        (f"s3://{s3_bucket}/y", f"http://127.0.0.1:{free_port()}"),
    ):
        # any exception type: whether each is a clean ckptflow error is test_chaos's business
        for attempt in (
            lambda: archive(hot_tier, Tier(TierConfig(name="cold", url=url, endpoint_url=endpoint)), "tiny", 6),
            lambda: restore(
                [Tier(TierConfig(name="cold", url=url, endpoint_url=endpoint))], "tiny", str(tmp_path / "r")
            ),
        ):
            try:
                attempt()
            except Exception as e:  # noqa: BLE001
                errors.append(f"{type(e).__name__}: {e}")
    assert len(errors) >= 3
    # the direct-webhook path (API unreachable): the POST fails, and says so without the URL
    monkeypatch.setattr("ckptflow.flows.alerts._api_reachable", lambda: False)
    from types import SimpleNamespace as NS

    notify_on_failure(NS(name="ckptflow-restore-drill"), NS(name="drill-tiny"), NS(name="Failed", message="x"))

    # Libraries keep their default levels: botocore's own DEBUG output prints signed request
    # headers (key id, session token) and ckptflow never turns it on.
    texts = [caplog.text, *capfd.readouterr(), *errors, *_read_back(prefect_api)]
    for canary in (secret, token, key_id, f"ckptflow-canary-session-{tag}"):
        hits = [
            f"[text {i}] " + t[max(0, t.find(canary) - 600) : t.find(canary) + 100]
            for i, t in enumerate(texts)
            if canary in t
        ]
        assert not hits, f"{canary[:24]}… leaked: {hits[:1]}"


def _read_back(api: str) -> list[str]:
    """Everything the Prefect server kept: flow-run logs and states, artifacts, events."""
    import asyncio

    from prefect.client.orchestration import get_client

    async def dump() -> list[str]:
        out = []
        async with get_client() as c:
            for read in (c.read_logs, c.read_artifacts, c.read_flow_runs, c.read_task_runs):
                offset = 0
                while batch := await read(limit=200, offset=offset):
                    out.append(json.dumps([x.model_dump(mode="json") for x in batch]))
                    offset += len(batch)
            page = (await c._client.post("/events/filter", json={"limit": 50})).json()
            while True:
                out.append(json.dumps(page["events"]))
                if not page.get("next_page"):
                    break
                page = (await c._client.get(page["next_page"])).json()
        return out

    return asyncio.run(dump())
