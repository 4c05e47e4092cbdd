"""Manifest parsing, signing and name validation (unit level, no torch jobs)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from ckptflow.trainer.errors import ConfigError, ManifestError, UnsafePathError
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.manifest import KEY_ENV, FileEntry, Manifest
from tests.helpers import REPO, forked_cli


def _m() -> Manifest:
    return Manifest(
        run_id="r", step=3, world_size=2, files={".metadata": FileEntry(10, "aa"), "__0_0.distcp": FileEntry(20, "bb")}
    )


def test_round_trip_keeps_everything():
    m = _m()
    m.extra["note"] = "kept"
    back = Manifest.from_json(m.to_json(), source="x")
    assert back.files == m.files and back.step == 3 and back.extra == {"note": "kept"}
    assert back.total_bytes == 30


def test_signed_manifest_accepted_with_key_refused_when_tampered_or_unsigned(monkeypatch):
    key = b"k" * 32
    signed = _m().to_json(key=key)
    assert Manifest.from_json(signed, source="x", key=key).step == 3
    d = json.loads(signed)
    d["files"]["__0_0.distcp"]["checksum"] = "cc"
    with pytest.raises(ManifestError, match="signature does not match"):
        Manifest.from_json(json.dumps(d).encode(), source="x", key=key)
    with pytest.raises(ManifestError, match="not signed"):
        Manifest.from_json(_m().to_json(key=b""), source="x", key=key)
    monkeypatch.setenv(KEY_ENV, "from-env")
    assert Manifest.from_json(_m().to_json(), source="x").signature is not None


@pytest.mark.parametrize("name", ["/abs", "../up", "a/../../b", "", "a//b", "./x", "s3://b/k", "C:\\x", "a\x00b"])
def test_unsafe_member_names_are_refused(name):
    with pytest.raises(UnsafePathError):
        layout.check_member_name(name)
    d = json.loads(_m().to_json(key=b""))
    d["files"][name] = {"size": 1, "checksum": "x"}
    with pytest.raises(UnsafePathError, match="manifest.json"):
        Manifest.from_json(json.dumps(d).encode(), source="/c/manifest.json", key=b"")


@pytest.mark.parametrize(
    "bad", [b"", b"[]", b'{"format": "other"}', b'{"format": "ckptflow.manifest", "format_version": 99}']
)
def test_not_a_manifest(bad):
    with pytest.raises(ManifestError):
        Manifest.from_json(bad, source="/c/manifest.json", key=b"")


def test_layout_names():
    assert layout.step_name(5) == "step_000000005" and layout.parse_step("step_000000005") == 5
    assert layout.parse_step("step_000000005.tmp") is None and layout.parse_tmp_step("step_000000005.tmp") == 5
    assert layout.join("s3://b/p/", "run", "step_1") == "s3://b/p/run/step_1"
    for bad in ("../x", "", "a b", "_x", "x" * 200):
        with pytest.raises(ConfigError):
            layout.check_run_id(bad)


def test_symlink_out_of_checkpoint_is_refused(tiny_run, tmp_path):
    from ckptflow.trainer.verify import verify_checkpoint

    run = tmp_path / "r"
    shutil.copytree(tiny_run, run)
    d = run / layout.step_name(6)
    shard = sorted(p for p in os.listdir(d) if p.endswith(".distcp"))[0]
    outside = tmp_path / "outside"
    os.rename(d / shard, outside)
    os.symlink(outside, d / shard)
    res = verify_checkpoint(str(d))
    assert not res.ok and "outside the checkpoint" in res.problems[0].what


def test_cli_verify_exit_codes(tiny_run, tmp_path):
    ok = forked_cli(["verify", os.path.join(tiny_run, layout.step_name(6))], cwd=REPO)
    assert ok.code == 0 and ok.out.startswith("OK ")
    run = tmp_path / "r"
    shutil.copytree(tiny_run, run)
    d = run / layout.step_name(6)
    shard = sorted(p for p in os.listdir(d) if p.endswith(".distcp"))[0]
    (d / shard).write_bytes(b"x")
    bad = forked_cli(["verify", str(d)], cwd=REPO)
    assert bad.code == 1 and shard in bad.err and "size" in bad.err
    js = forked_cli(["verify", "--json", str(d)], cwd=REPO)
    assert json.loads(js.out)["ok"] is False


def test_sanity_builder_must_be_allowed(monkeypatch):
    from ckptflow.tasks.sanity import BUILDERS_ENV, resolve_builder
    from ckptflow.trainer.errors import ConfigError

    assert callable(resolve_builder("ckptflow.trainer.reference.build:build"))
    with pytest.raises(ConfigError, match="not allowed"):
        resolve_builder("os:system")
    monkeypatch.setenv(BUILDERS_ENV, "ckptflow.trainer.reference.model:count_parameters, other:fn")
    assert callable(resolve_builder("ckptflow.trainer.reference.model:count_parameters"))
