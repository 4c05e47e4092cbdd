"""Hostile and clumsy inputs, one defect at a time: each test names what lost or exposed data, hung, or
said the wrong thing, and fails where that still happens.

Commands run as a user runs them: the console script's own entry, in a forked child with a time limit
(``forked_cli``: a hang fails the test, never the suite), or as a real process where signals, privileges or
a race with another process are the point. The generated trees are in ``test_hostile_trees.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Iterator

import pytest

from ckptflow.trainer.format import layout
from ckptflow.trainer.format.checksum import hash_file
from tests.helpers import PY, REPO, flip_byte, forked_cli, make_run, pickle_bomb, step_dir, torchrun_env

ROOT = os.geteuid() == 0


def _copy_run(src: str, root) -> str:
    dst = os.path.join(str(root), os.path.basename(src))
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _config(tmp_path, *, warm: str | None = None, keep: int = 1, codec: str = "none") -> str:
    warm = warm if warm is not None else str(tmp_path / "warm")
    text = (
        f'[hot]\nurl = "{tmp_path / "hot"}"\n[hot.retention]\nkeep_last = {keep}\n'
        f'[warm]\nurl = "{warm}"\ncodec = "{codec}"\n[warm.retention]\nkeep_last = {keep}\n'
    )
    (tmp_path / "ckptflow.toml").write_text(text)
    return str(tmp_path / "ckptflow.toml")


def _rewrite_manifest(step: str, name: str) -> None:
    """An attacker who knows the format puts ``name``'s new digest into an unsigned manifest."""
    mpath = os.path.join(step, layout.MANIFEST)
    d = json.loads(open(mpath).read())
    digest, size = hash_file(os.path.join(step, name))
    d["files"][name] = {"size": size, "checksum": digest}
    with open(mpath, "w") as f:
        json.dump(d, f)


def _mkfifo(path: str) -> None:
    if os.path.lexists(path):
        os.unlink(path)
    os.mkfifo(path)


class _Mkdir:
    """Unpickling this creates ``path``: proof that a pickle ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


# ---- 1. a damaged step is never kept over its own good re-save -----------------------------------


def test_a_damaged_or_quarantined_step_is_set_aside_and_its_resave_commits(tmp_path):
    """The job restarts over a damaged newest step (a byte flipped), a step the lifecycle quarantined and a
    FIFO where ``latest`` was: it ignores ``latest``, passes both steps over, resumes from the one before,
    trains them again and saves them: those saves commit (the old copies set aside, kept, never named by
    ``latest``; the quarantined one's records with it, so its re-save starts its own lifecycle)."""
    from ckptflow.tasks import records
    from ckptflow.trainer.verify import verify_checkpoint

    run = make_run(tmp_path, "r1", max_steps=6, save_every=2)
    flip_byte(os.path.join(step_dir(run, 6), "__0_0.distcp"))
    records.quarantine(run, 4, ["sanity: probe loss differs"])
    _mkfifo(os.path.join(run, layout.LATEST))
    make_run(tmp_path, "r1", max_steps=6, save_every=2)  # resumes from 2, saves 4 and 6 again

    for s in (4, 6):
        assert verify_checkpoint(step_dir(run, s)).ok, f"the re-saved step {s} is the committed one"
    assert open(os.path.join(run, layout.LATEST)).read().strip() == layout.step_name(6)
    aside = {layout.parse_set_aside(n): n for n in os.listdir(os.path.join(run, layout.DAMAGED_DIR))}
    assert sorted(aside) == [4, 6]
    notes = {
        s: json.loads(open(os.path.join(run, layout.DAMAGED_DIR, n, layout.SET_ASIDE_NOTE)).read())
        for s, n in aside.items()
    }
    assert notes[6]["found_by"] == "resume" and "checksum" in " ".join(notes[6]["reasons"])
    assert "quarantined" in " ".join(notes[4]["reasons"])
    assert not verify_checkpoint(os.path.join(run, layout.DAMAGED_DIR, aside[6])).ok  # kept as it was found
    assert os.path.exists(os.path.join(run, layout.DAMAGED_DIR, aside[4], layout.LIFECYCLE_DIR, "quarantined.json"))
    assert records.read_record(run, 4, records.QUARANTINED) is None, "the new step 4 starts its own lifecycle"
    commits = [r["step"] for r in map(json.loads, open(os.path.join(run, layout.OUTBOX)))]
    assert commits == [2, 4, 6, 4, 6]  # every save was committed, none dropped as "already committed"


@pytest.mark.parametrize(
    ("failure", "set_aside"),
    [("bytes", True), ("structure", False), ("untrusted", False)],
)
def test_resume_sets_aside_only_what_is_damaged(tiny_run, tmp_path, monkeypatch, failure, set_aside):
    """A newest step whose load fails for its bytes is set aside; one that fails for the loop's own reason
    (another model structure, a resource) or that this process cannot trust (another signing key) is passed
    over and left where it is: nothing is wrong with it."""
    from ckptflow.trainer.config import Provenance
    from ckptflow.trainer.distenv import DistEnv
    from ckptflow.trainer.errors import IntegrityError, LoadError
    from ckptflow.trainer.format.manifest import KEY_ENV
    from ckptflow.trainer.nodes.topology import single
    from ckptflow.trainer.restore import Resume, _resume_shared

    run = _copy_run(tiny_run, tmp_path / "hot")
    if failure == "untrusted":  # step 6 signed with a key this process does not have
        from ckptflow.trainer.format.manifest import read_manifest

        m = read_manifest(step_dir(run, 6))
        with open(os.path.join(step_dir(run, 6), layout.MANIFEST), "wb") as f:
            f.write(m.to_json(key=b"another key"))
        monkeypatch.setenv(KEY_ENV, "this process's key")
        for s in (2, 4):  # the older ones signed with this process's key
            ms = read_manifest(step_dir(run, s), key=b"")
            with open(os.path.join(step_dir(run, s), layout.MANIFEST), "wb") as f:
                f.write(ms.to_json(key=b"this process's key"))

    def load(path: str, manifest) -> None:
        if manifest.step == 6:
            raise (IntegrityError if failure == "bytes" else LoadError)(f"{path}: could not load it ({failure})")

    env = DistEnv(0, 1, 0, 1, 0, None)  # type: ignore[arg-type]
    r = Resume(run, env, single(), Provenance(config={}, data_fingerprint=""), False, True)
    got = _resume_shared(r, load)
    assert got.step == 4
    assert os.path.isdir(step_dir(run, 6)) is not set_aside
    assert bool(os.path.isdir(os.path.join(run, layout.DAMAGED_DIR))) is set_aside


def test_promote_sets_a_damaged_warm_copy_aside_and_promotes_again(tiny_run, tmp_path):
    """The same rule on a tier: warm's committed copy of a step, its manifest damaged, is set aside and the
    step promoted again (it used to fail for good on "already committed")."""
    from ckptflow.tasks.config import load_config
    from ckptflow.tasks.storage import Tier
    from ckptflow.tasks.transfer import fetch, promote

    _copy_run(tiny_run, tmp_path / "hot")
    cfg = load_config(_config(tmp_path, codec="zstd"))
    hot, warm = Tier(cfg.hot), Tier(cfg.warm)
    promote(hot, warm, "tiny", 6)
    with open(os.path.join(warm.url_for("tiny", 6), layout.MANIFEST), "r+b") as f:
        f.truncate(100)
    res = promote(hot, warm, "tiny", 6)
    assert not res.already_committed and res.files > 0
    fetch(warm, "tiny", 6, str(tmp_path / "back"))  # every byte checked
    assert len(warm.set_aside_names("tiny")) == 1


# ---- 2. two tiers that are one folder ----------------------------------------------------------


def test_prune_refuses_a_warm_tier_that_is_the_hot_folder_under_another_spelling(tiny_run, tmp_path):
    _copy_run(tiny_run, tmp_path / "hot")
    os.symlink(tmp_path / "hot", tmp_path / "alias")
    before = sorted(os.listdir(tmp_path / "hot" / "tiny"))
    for warm in (f"file://{tmp_path / 'hot'}", f"{tmp_path / 'hot'}/", str(tmp_path / "alias")):
        cfg = _config(tmp_path, warm=warm)
        r = forked_cli(["prune", "tiny", "--config", cfg])
        assert r.code == 4, r.err
        assert "the same place" in r.one_line_error()
        assert sorted(os.listdir(tmp_path / "hot" / "tiny")) == before, "nothing was deleted"


# ---- 3 and 4. adoption copies every file it checked, and only those ------------------------------


def _hf_folder(path, blobs) -> None:
    """A Hugging Face ``checkpoint-N/`` whose files are symlinks into a blob store (the Hub cache's layout)."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(blobs, exist_ok=True)
    os.makedirs(path)
    save_file({"w": torch.arange(6, dtype=torch.float32)}, os.path.join(blobs, "b1"))
    torch.save({"state": {}, "param_groups": []}, os.path.join(blobs, "b2"))
    with open(os.path.join(blobs, "b3"), "w") as f:
        json.dump({"global_step": 5, "log_history": []}, f)
    for name, blob in (("model.safetensors", "b1"), ("optimizer.pt", "b2"), ("trainer_state.json", "b3")):
        os.symlink(os.path.join(blobs, blob), os.path.join(path, name))


def test_adopt_copies_the_content_of_symlinked_files(tiny_run, tmp_path):
    from ckptflow.tasks.adopt import parse_check
    from ckptflow.trainer.dcp.planner import restricted_load  # noqa: F401 - parse_check's loader, warm
    from ckptflow.trainer.format.manifest import read_manifest

    hf = tmp_path / "src" / "checkpoint-5"
    _hf_folder(str(hf), str(tmp_path / "blobs"))
    r = forked_cli(["adopt", str(hf), "--run-id", "hf", "--root", str(tmp_path / "hot")])
    assert r.code == 0, r.err
    step = str(tmp_path / "hot" / "hf" / layout.step_name(5))
    m = read_manifest(step)
    assert sorted(m.files) == ["model.safetensors", "optimizer.pt", "trainer_state.json"]
    assert all(not os.path.islink(os.path.join(step, n)) for n in m.files)
    v = forked_cli(["verify", step])
    assert v.code == 0 and "3 files" in v.out, v.out + v.err
    assert parse_check(step, m)["ok"]

    # A DCP folder whose .metadata is a symlink (deduplicated): adopted whole, readable.
    dcp = tmp_path / "src" / "step-6"
    os.makedirs(dcp)
    shutil.copy(os.path.join(tiny_run, layout.step_name(6), "__0_0.distcp"), dcp)
    shutil.copy(os.path.join(tiny_run, layout.step_name(6), layout.DCP_METADATA), tmp_path / "blobs" / "md")
    os.symlink(tmp_path / "blobs" / "md", dcp / layout.DCP_METADATA)
    r = forked_cli(["adopt", str(dcp), "--run-id", "dcp", "--root", str(tmp_path / "hot")])
    assert r.code == 0, r.err
    v = forked_cli(["verify", str(tmp_path / "hot" / "dcp" / layout.step_name(6))])
    assert v.code == 0 and "2 files" in v.out, v.out + v.err


@pytest.mark.skipif(not ROOT, reason="the swap needs a root-only file to leak")
def test_adopt_copies_the_file_it_checked_never_a_swapped_in_one_and_never_widens_a_mode(tiny_run, tmp_path):
    """Held after its first copy (a fault point), adopt's second file is swapped for a symlink to a 0600
    file: the adoption is refused and nothing is committed. A 0600 source file lands as 0600."""
    src = tmp_path / "step-30"
    shutil.copytree(os.path.join(tiny_run, layout.step_name(6)), src)
    os.unlink(src / layout.MANIFEST)
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(64))
    os.chmod(secret, 0o600)
    marks = tmp_path / "marks"
    marks.mkdir()
    env = dict(torchrun_env(), CKPTFLOW_FAULT="adopt.copy@30:sleep4", CKPTFLOW_FAULT_MARKS=str(marks))
    cmd = [PY, "-m", "ckptflow.cli.main", "adopt", str(src), "--run-id", "t", "--root", str(tmp_path / "hot")]
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not os.listdir(marks) and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.05)
    assert os.listdir(marks), "adopt never reached its first copy"
    # files are copied in name order: ".metadata" first, "__0_0.distcp" second
    os.unlink(src / "__0_0.distcp")
    os.symlink(secret, src / "__0_0.distcp")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2, out + err
    assert "changed since it was checked" in err or "symlink" in err
    run = tmp_path / "hot" / "t"
    assert not any(layout.parse_step(n) is not None for n in os.listdir(run)), "nothing committed"

    os.unlink(src / "__0_0.distcp")
    shutil.copy(os.path.join(tiny_run, layout.step_name(6), "__0_0.distcp"), src)
    os.chmod(src / "__0_0.distcp", 0o600)
    r = forked_cli(["adopt", str(src), "--run-id", "t", "--root", str(tmp_path / "hot")])
    assert r.code == 0, r.err
    assert stat.S_IMODE(os.stat(run / layout.step_name(30) / "__0_0.distcp").st_mode) == 0o600


# ---- 5. FIFOs and devices where files belong ---------------------------------------------------


def test_fifos_and_devices_never_hang_a_reader(tiny_run, tmp_path):
    hot = tmp_path / "hot"
    run = _copy_run(tiny_run, hot)
    cfg = _config(tmp_path)
    _mkfifo(os.path.join(step_dir(run, 6), layout.MANIFEST))
    _mkfifo(os.path.join(run, layout.LATEST))
    env = {"CKPTFLOW_CONFIG": cfg}
    v = forked_cli(["verify", step_dir(run, 6)], env=env, timeout=30)
    assert v.code == 1 and "FIFO" in v.out + v.err, v.out + v.err
    ls = forked_cli(["ls", "tiny", "--json"], env=env, timeout=30)
    assert ls.code == 0, ls.err
    row6 = next(r for r in json.loads(ls.out)["checkpoints"] if r["step"] == 6)
    assert "FIFO" in row6["problems"]["hot"]
    r = forked_cli(["restore", "tiny", "--to", str(tmp_path / "back"), "--json"], env=env, timeout=30)
    assert r.code == 0 and json.loads(r.out)["step"] == 4, r.err
    p = forked_cli(["prune", "tiny", "--dry-run"], env=env, timeout=30)
    assert p.code == 0, p.err

    # The trainer's resume: a FIFO `latest` is ignored, the FIFO manifest skipped (a real job restarts over a
    # FIFO `latest` in test_a_damaged_or_quarantined_step_is_set_aside_and_its_resave_commits)
    from ckptflow.trainer.resume import find_resume_point

    assert find_resume_point(run).chosen.step == 4

    # Adopting: a FIFO trainer_state.json, one that is /dev/zero.
    hf = tmp_path / "src" / "checkpoint-7"
    _hf_folder(str(hf), str(tmp_path / "blobs"))
    _mkfifo(str(hf / "trainer_state.json"))
    a = forked_cli(["adopt", str(hf), "--run-id", "hf", "--root", str(hot)], timeout=30)
    assert a.code == 2 and "FIFO" in a.one_line_error()
    os.unlink(hf / "trainer_state.json")
    os.symlink("/dev/zero", hf / "trainer_state.json")
    a = forked_cli(["adopt", str(hf), "--run-id", "hf", "--root", str(hot)], timeout=30)
    assert a.code == 2 and "character device" in a.one_line_error()


def test_adopt_watch_over_a_fifo_stops_on_sigterm(tmp_path):
    hf = tmp_path / "watched" / "checkpoint-7"
    _hf_folder(str(hf), str(tmp_path / "blobs"))
    _mkfifo(str(hf / "trainer_state.json"))
    cmd = [PY, "-m", "ckptflow.cli.main", "adopt", "--watch", str(tmp_path / "watched"), "--run-id", "hf",
           "--root", str(tmp_path / "hot"), "--poll-s", "0.2"]  # fmt: skip
    err_path = tmp_path / "watch.err"
    with open(err_path, "w") as err:
        p = subprocess.Popen(cmd, cwd=REPO, env=torchrun_env(), stdout=subprocess.DEVNULL, stderr=err, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "not adopted" not in err_path.read_text() and p.poll() is None:
            time.sleep(0.1)  # the watcher has looked at the checkpoint and said why it refuses it
        time.sleep(0.5)  # a few more polls: the refused checkpoint is not looked at (or waited on) again
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=10)
    finally:
        p.kill()
    err = err_path.read_text()
    assert p.returncode == 0, err
    assert err.count("FIFO") == 1, err  # reported once, not waited on


# ---- 6. a pickle bomb in .metadata ------------------------------------------------------------


def test_a_metadata_bomb_is_refused_within_its_bounds(tiny_run, tmp_path):
    """A few hundred bytes of allow-listed callables that would run for ever: adopt refuses them within the
    parse's CPU bound (exit 2), and so does verify of a hot copy whose unsigned manifest vouches for them."""
    src = tmp_path / "step-8"
    shutil.copytree(os.path.join(tiny_run, layout.step_name(6)), src)
    os.unlink(src / layout.MANIFEST)
    (src / layout.DCP_METADATA).write_bytes(pickle_bomb())
    a = forked_cli(["adopt", str(src), "--run-id", "b", "--root", str(tmp_path / "hot")], timeout=60)
    assert a.code == 2 and "pickle bomb" in a.one_line_error() and a.seconds < 30

    run = _copy_run(tiny_run, tmp_path / "hot2")
    with open(os.path.join(step_dir(run, 6), layout.DCP_METADATA), "wb") as f:
        f.write(pickle_bomb())
    _rewrite_manifest(step_dir(run, 6), layout.DCP_METADATA)
    v = forked_cli(["verify", step_dir(run, 6)], timeout=60)
    assert v.code == 1 and "pickle bomb" in v.out + v.err and v.seconds < 30

    from ckptflow.trainer.resume import find_resume_point

    assert find_resume_point(run, deep=True).chosen.step == 4


# ---- 7 and 8. restore checks what verify checks, and blames the destination for its own errors -----


def test_restore_skips_a_code_running_metadata_that_its_forged_manifest_vouches_for(tiny_run, tmp_path):
    run = _copy_run(tiny_run, tmp_path / "hot")
    marker = tmp_path / "pwned"
    with open(os.path.join(step_dir(run, 6), layout.DCP_METADATA), "wb") as f:
        f.write(pickle.dumps(_Mkdir(str(marker))))
    _rewrite_manifest(step_dir(run, 6), layout.DCP_METADATA)
    cfg = _config(tmp_path)
    r = forked_cli(["restore", "tiny", "--to", str(tmp_path / "back"), "--json", "--config", cfg])
    assert r.code == 0, r.err
    got = json.loads(r.out)
    assert got["step"] == 4 and got["skipped"][0]["step"] == 6 and "metadata" in got["skipped"][0]["reason"]
    assert not marker.exists()
    assert forked_cli(["verify", str(tmp_path / "back")]).code == 0


def test_restore_stops_at_once_on_a_destination_it_cannot_write(tiny_run, tmp_path):
    _copy_run(tiny_run, tmp_path / "hot")
    cfg = _config(tmp_path)
    (tmp_path / "empty").mkdir()
    os.symlink(tmp_path / "empty", tmp_path / "link")
    r = forked_cli(["restore", "tiny", "--to", str(tmp_path / "link"), "--config", cfg])
    assert r.code == 4 and str(tmp_path / "link") in r.one_line_error() and "symbolic link" in r.err
    assert os.listdir(tmp_path / "empty") == []

    # the restored folder is readable by the user who trains from it (not 0700)
    r = forked_cli(["restore", "tiny", "--to", str(tmp_path / "ok"), "--config", cfg])
    assert r.code == 0 and stat.S_IMODE(os.stat(tmp_path / "ok").st_mode) & 0o055 == 0o055 & ~_umask()

    with _small_disk(tmp_path / "full", "256k") as full:
        r = forked_cli(["restore", "tiny", "--to", str(full / "x"), "--config", cfg])
        assert r.code == 4, r.err
        err = r.one_line_error()
        assert str(full / "x") in err and "No space left" in err
        assert os.listdir(full) == [], "nothing half-written is left"


@contextlib.contextmanager
def _small_disk(path, size: str) -> Iterator:
    """A real full disk: a tmpfs of ``size`` mounted at ``path`` (root only: the test is skipped otherwise)."""
    if not ROOT:
        pytest.skip("a full disk is a small tmpfs here, which needs root")
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "ckptflow-test", str(path)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)])


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


# ---- 9. malformed safetensors headers are quarantined with the reason ------------------------------


@pytest.mark.parametrize(
    "header",
    [
        '"a string"',
        "[1, 2]",
        '{"w": "not an object"}',
        '{"w": {"dtype": "F32", "shape": [2]}}',
        '{"w": {"dtype": "F32", "shape": [1000000000], "data_offsets": [0, 8]}}',
        '{"w": {"dtype": 3, "shape": [2], "data_offsets": [0, 8]}}',
        '{"__metadata__": [1], "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}',
    ],
)
def test_the_verify_stage_quarantines_a_malformed_safetensors_header_with_the_reason(tmp_path, header):
    from ckptflow.tasks.adopt import adopt
    from ckptflow.tasks.checkpoint import CheckpointRef
    from ckptflow.tasks.config import load_config
    from ckptflow.tasks.verify import verify

    hf = tmp_path / "checkpoint-3"
    hf.mkdir()
    body = header.encode()
    (hf / "model.safetensors").write_bytes(len(body).to_bytes(8, "little") + body + b"\0" * 8)
    (hf / "trainer_state.json").write_text("{}")
    adopt(str(hf), run_id="hf", root=str(tmp_path / "hot"), step=3)
    ref = CheckpointRef(load_config(_config(tmp_path)), "hf", 3)
    out = verify(ref, expectations=False)
    assert not out.ok
    assert any("model.safetensors" in r for r in out.reasons), out.reasons


def test_safetensors_of_rare_or_newer_dtypes_are_not_called_malformed(tmp_path):
    import torch
    from safetensors.torch import save_file

    from ckptflow.tasks.adopt import _safetensors_problem

    p = tmp_path / "f8.safetensors"
    save_file({"a": torch.zeros(4, dtype=torch.float8_e5m2fnuz), "b": torch.zeros(3, dtype=torch.float8_e4m3fnuz)}, p)
    assert _safetensors_problem(str(p), "f8.safetensors") is None
    header = b'{"w": {"dtype": "F2_FUTURE", "shape": [3], "data_offsets": [0, 1]}}'
    (tmp_path / "new.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0")
    assert _safetensors_problem(str(tmp_path / "new.safetensors"), "new.safetensors") is None


# ---- 10. the smaller ones: each a clear error, nothing lost ----------------------------------------


def test_config_run_ids_and_the_signing_key_refuse_what_would_silently_misbehave(tiny_run, tmp_path):
    from ckptflow.tasks.config import parse_config
    from ckptflow.trainer.errors import ConfigError
    from ckptflow.trainer.format.layout import check_run_id

    with pytest.raises(ConfigError, match="url is empty"):
        parse_config({"hot": {"url": ""}}, source=str(tmp_path / "c.toml"))
    for bad in ("latest", "step_000000001", "step_000000001.tmp", "metrics.jsonl"):
        with pytest.raises(ConfigError, match="uses inside a run"):
            check_run_id(bad)
    for fine in ("step_2_ablation", "latest-run", "steps"):
        check_run_id(fine)
    run = _copy_run(tiny_run, tmp_path / "hot")
    r = forked_cli(["verify", step_dir(run, 6)], env={"CKPTFLOW_MANIFEST_KEY": ""})
    assert r.code == 4 and "set but empty" in r.one_line_error()


def test_export_and_restore_never_write_into_a_checkpoint_or_a_tier_run_folder(tiny_run, tmp_path):
    run = _copy_run(tiny_run, tmp_path / "hot")
    cfg = _config(tmp_path)
    before = sorted(os.listdir(step_dir(run, 6)))
    e = forked_cli(["export", step_dir(run, 6), os.path.join(step_dir(run, 6), "exp"), "--config", cfg])
    assert e.code in (2, 4) and "inside" in e.one_line_error()
    assert sorted(os.listdir(step_dir(run, 6))) == before
    e = forked_cli(["export", step_dir(run, 6), step_dir(run, 99), "--config", cfg])
    assert e.code in (2, 4) and "inside tier hot" in e.one_line_error()
    r = forked_cli(["restore", "tiny", "--to", step_dir(run, 99), "--config", cfg])
    assert r.code == 2 and "inside tier hot" in r.one_line_error()
    assert not os.path.exists(step_dir(run, 99))
    # the step's own folder is the way a checkpoint is put back by hand, and stays allowed
    shutil.rmtree(step_dir(run, 6))
    r = forked_cli(["restore", "tiny", "--step", "6", "--tier", "warm", "--to", step_dir(run, 6), "--config", cfg])
    assert r.code == 3  # warm holds nothing: refused for that reason, not for the folder


def test_compress_and_decompress_leave_nothing_on_failure_and_never_follow_a_member_out(tiny_run, tmp_path):
    src = step_dir(tiny_run, 6)
    c = forked_cli(["compress", src, str(tmp_path / "z"), "--codec", "zstd"])
    assert c.code == 0, c.err
    # a stored member swapped for a symlink to an outside file of the same bytes
    index = json.loads((tmp_path / "z" / "ckptflow-codec.json").read_text())
    member = next(f["stored_name"] for f in index["files"] if f["name"].endswith(".distcp"))
    shutil.copy(tmp_path / "z" / member, tmp_path / "outside")
    os.unlink(tmp_path / "z" / member)
    os.symlink(tmp_path / "outside", tmp_path / "z" / member)
    d = forked_cli(["decompress", str(tmp_path / "z"), str(tmp_path / "out")])
    assert d.code == 1 and "outside the checkpoint" in d.one_line_error()
    assert not os.path.exists(tmp_path / "out")

    with _small_disk(tmp_path / "full", "512k") as full:
        c = forked_cli(["compress", src, str(full / "z"), "--codec", "none"])
        assert c.code == 4 and "No space left" in c.one_line_error()
        assert os.listdir(full) == [], "nothing half-written is left"
        subprocess.run(["mount", "-o", "remount,size=8m", str(full)], check=True)
        assert forked_cli(["compress", src, str(full / "z"), "--codec", "none"]).code == 0  # the rerun works


def test_a_prune_that_finds_its_step_already_gone_succeeds(tiny_run, tmp_path, monkeypatch):
    """Two prunes at once: between one's look (the step is there) and its rename, the other deletes the step.
    Gone is what the first was asked for: no error, exit 0 (the interleaving is forced, not hoped for)."""
    from ckptflow.tasks.config import parse_config
    from ckptflow.tasks.prune import prune_run
    from ckptflow.trainer.format import atomicity
    from ckptflow.trainer.fsutil import remove_tree

    run = _copy_run(tiny_run, tmp_path / "hot")
    cfg = parse_config({"hot": {"url": str(tmp_path / "hot"), "retention": {"keep_last": 1}}}, source="t.toml")
    real = atomicity.rename_durable

    def the_other_prune_wins(src, dst):
        remove_tree(src)  # the concurrent prune took it first
        return real(src, dst)

    monkeypatch.setattr(atomicity, "rename_durable", the_other_prune_wins)
    rep = prune_run(cfg, "tiny")["hot"]
    assert rep.errors == {} and rep.deleted == [2, 4]
    assert sorted(n for n in os.listdir(run) if layout.parse_step(n) is not None) == [layout.step_name(6)]


def test_adopt_refuses_unsafe_names_as_usage_and_never_moves_latest_backwards(tiny_run, tmp_path):
    import torch  # noqa: F401 - the metadata's classes

    from ckptflow.trainer.format.dcpmeta import read_dcp_metadata

    hot = str(tmp_path / "hot")
    for s in (30, 20):
        src = tmp_path / f"step-{s}"
        shutil.copytree(os.path.join(tiny_run, layout.step_name(6)), src)
        os.unlink(src / layout.MANIFEST)
        assert forked_cli(["adopt", str(src), "--run-id", "t", "--root", hot]).code == 0
    assert open(os.path.join(hot, "t", layout.LATEST)).read().strip() == layout.step_name(30)

    src = tmp_path / "step-40"
    shutil.copytree(os.path.join(tiny_run, layout.step_name(6)), src)
    os.unlink(src / layout.MANIFEST)
    md = read_dcp_metadata(str(src))
    for info in md.storage_data.values():
        info.relative_path = "a\\b.distcp"
    (src / layout.DCP_METADATA).write_bytes(pickle.dumps(md))
    r = forked_cli(["adopt", str(src), "--run-id", "t", "--root", hot])
    assert r.code == 2 and "not a plain relative name" in r.one_line_error()


# ---- as an unprivileged user: what root's reads and writes hide -----------------------------------


def _as_nobody(argv: list[str], home: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``argv`` as the unprivileged user ``nobody`` (real uid and gid dropped, no groups)."""
    env = dict(torchrun_env(), HOME=home, PYTHONDONTWRITEBYTECODE="1")
    cmd = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--", *argv]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(not ROOT or shutil.which("setpriv") is None, reason="needs root to become another user")
def test_permission_cases_as_an_unprivileged_user(tiny_run, tmp_path):
    """Root reads a 0600 file and writes a read-only folder; a trainer or operator who is not root does not.
    Each case ends in one clear line (exit 4), deletes or commits nothing, and a folder root restores is one
    the non-root trainer resumes from."""
    import tempfile

    base = tempfile.mkdtemp(prefix="ckptflow-nobody-")  # under /tmp, not pytest's 0700 folder
    try:
        os.chmod(base, 0o755)
        home = os.path.join(base, "home")
        os.makedirs(home)
        shutil.chown(home, "nobody", "nogroup")
        hot = os.path.join(base, "hot")
        run = _copy_run(tiny_run, hot)
        for d, dirs, files in os.walk(base):
            for n in dirs:
                os.chmod(os.path.join(d, n), 0o755)
            for n in files:
                os.chmod(os.path.join(d, n), 0o644)
        cli = [PY, "-m", "ckptflow.cli.main"]

        # verify: a member only root may read
        os.chmod(os.path.join(step_dir(run, 4), "__0_0.distcp"), 0o600)
        r = _as_nobody([*cli, "verify", step_dir(run, 4)], home)
        assert r.returncode == 4 and "permission denied" in r.stderr and r.stderr.count("\n") == 1, r.stderr

        # prune: a tier the user may read but not change
        cfg = os.path.join(base, "ckptflow.toml")
        with open(cfg, "w") as f:
            f.write(f'[hot]\nurl = "{hot}"\n[hot.retention]\nkeep_last = 1\n')
        before = sorted(os.listdir(run))
        r = _as_nobody([*cli, "prune", "tiny", "--config", cfg], home)
        assert r.returncode == 4 and "Permission denied" in r.stdout + r.stderr, r.stdout + r.stderr
        assert sorted(os.listdir(run)) == before

        # restore: into a folder the user may not write: the destination is named, no candidate blamed
        os.makedirs(os.path.join(base, "ro"))
        r = _as_nobody([*cli, "restore", "tiny", "--to", os.path.join(base, "ro", "x"), "--config", cfg], home)
        assert r.returncode == 4 and os.path.join(base, "ro", "x") in r.stderr, r.stderr
        assert "verifies" not in r.stderr

        # adopt: a source with a file the user may not read: nothing committed
        src = os.path.join(base, "step-9")
        shutil.copytree(step_dir(tiny_run, 6), src)
        os.unlink(os.path.join(src, layout.MANIFEST))
        os.chmod(src, 0o755)
        os.chmod(os.path.join(src, layout.DCP_METADATA), 0o644)
        os.chmod(os.path.join(src, "__0_0.distcp"), 0o600)
        mine = os.path.join(base, "mine")
        os.makedirs(mine)
        shutil.chown(mine, "nobody", "nogroup")
        r = _as_nobody([*cli, "adopt", src, "--run-id", "t", "--root", mine], home)
        assert r.returncode == 4 and "permission denied" in r.stderr, r.stderr
        t_run = os.path.join(mine, "t")
        assert not os.path.isdir(t_run) or not any(layout.parse_step(n) is not None for n in os.listdir(t_run))

        # root restores a checkpoint into the trainer's root; the trainer (not root) resumes from it
        r = forked_cli(["restore", "tiny", "--step", "6", "--to", os.path.join(mine, "tiny", layout.step_name(6)),
                        "--config", cfg])  # fmt: skip
        assert r.code == 0, r.err
        shutil.chown(os.path.join(mine, "tiny"), "nobody", "nogroup")
        job = [PY, "-m", "ckptflow.trainer.train", "--parallel", "none", "--ckpt-root", mine, "--run-id", "tiny",
               "--max-steps", "8", "--save-every", "2", "--model", "tiny"]  # fmt: skip
        r = _as_nobody(job, home)
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"resumed from {os.path.join(mine, 'tiny', layout.step_name(6))}" in r.stderr
    finally:
        shutil.rmtree(base, ignore_errors=True)
