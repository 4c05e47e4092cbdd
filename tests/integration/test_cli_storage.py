"""``ckptflow ls / restore / prune / pin / unpin / advise`` on real tiers: temp folders and
moto's S3 server over HTTP. Commands run in-process through the console script's own entry
(``run_cli``), so exit codes and the one-line errors are exactly what a shell sees."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

import boto3
import pytest

from ckptflow.trainer.format import layout
from tests.helpers import PY, REPO, fake_run, flip_byte, invoke

pytestmark = pytest.mark.usefixtures("wide_tables")


def write_cfg(
    tmp_path,
    *,
    cold: str | None = None,
    endpoint: str | None = None,
    hot_keep: int = 1,
    warm_keep: int = 1,
    cold_keep: int = 5,
) -> str:
    text = f"""
[hot]
url = "{tmp_path / "hot"}"
[hot.retention]
keep_last = {hot_keep}
[warm]
url = "{tmp_path / "warm"}"
codec = "zstd"
[warm.retention]
keep_last = {warm_keep}
"""
    if cold:
        text += f"""
[cold]
url = "{cold}"
codec = "zstd"
endpoint_url = "{endpoint}"
[cold.retention]
keep_last = {cold_keep}
"""
    (tmp_path / "ckptflow.toml").write_text(text)
    return str(tmp_path / "ckptflow.toml")


@pytest.fixture
def three_tiers(tiny_run, tmp_path, s3_endpoint, s3_bucket):
    """tiny's steps 2, 4, 6 on hot; 4 and 6 also on warm (zstd) and cold (S3, zstd)."""
    from ckptflow.tasks.config import load_config
    from ckptflow.tasks.storage import Tier
    from ckptflow.tasks.transfer import archive, promote

    shutil.copytree(tiny_run, tmp_path / "hot" / "tiny")
    cfg = write_cfg(tmp_path, cold=f"s3://{s3_bucket}/ckpt", endpoint=s3_endpoint)
    c = load_config(cfg)
    hot, warm, cold = Tier(c.hot), Tier(c.warm), Tier(c.cold)
    for s in (4, 6):
        promote(hot, warm, "tiny", s)
        archive(warm, cold, "tiny", s)
    return cfg, hot, warm, cold


# ---- restore -----------------------------------------------------------------------------


def test_restore_falls_back_past_a_corrupted_newest_and_verify_accepts_the_result(
    capsys, three_tiers, tmp_path, s3_endpoint, s3_bucket
):
    cfg, hot, warm, cold = three_tiers
    flip_byte(os.path.join(hot.url_for("tiny", 6), "__0_0.distcp"))  # hot copy of 6
    flip_byte(os.path.join(warm.url_for("tiny", 6), "__0_0.distcp.zst"))  # warm copy of 6
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    key = f"ckpt/tiny/{layout.step_name(6)}/__0_0.distcp.zst"
    body = bytearray(s3.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 1
    s3.put_object(Bucket=s3_bucket, Key=key, Body=bytes(body))  # and the cold one

    dst = tmp_path / "restored"
    r = invoke(capsys, "restore", "tiny", "--to", dst, "--config", cfg, "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert (doc["step"], doc["tier"]) == (4, "hot")  # step 6 is damaged everywhere: one interval lost
    assert [(k["tier"], k["step"]) for k in doc["skipped"]] == [("hot", 6), ("warm", 6), ("cold", 6)]
    assert "__0_0.distcp" in doc["skipped"][0]["reason"] and "__0_0.distcp.zst" in doc["skipped"][2]["reason"]
    assert doc["bytes_raw"] == hot.read_manifest("tiny", 4).total_bytes and doc["seconds"] > 0
    v = invoke(capsys, "verify", dst)
    assert v.code == 0 and "step 4" in v.out

    # the same from cold only, in text form: what was skipped and why, bytes, seconds, MB/s
    r = invoke(capsys, "restore", "tiny", "--tier", "cold", "--to", tmp_path / "from-cold", "--config", cfg)
    assert r.code == 0, r.err
    assert "skipped" in r.out and key.rsplit("/", 1)[1] in r.out
    assert "restored tiny step 4 from cold" in r.out and "MB/s" in r.out
    assert invoke(capsys, "verify", tmp_path / "from-cold").code == 0


def test_restore_shows_a_progress_bar_on_a_terminal(capsys, three_tiers, tmp_path, monkeypatch):
    from ckptflow.cli import cmd_restore

    cfg, *_ = three_tiers
    monkeypatch.setattr(cmd_restore, "_stderr_is_tty", lambda: True)
    r = invoke(capsys, "restore", "tiny", "--tier", "warm", "--step", "4", "--to", tmp_path / "d", "--config", cfg)
    assert r.code == 0, r.err
    assert "restore tiny" in r.err and "1.9/1.9 MB" in r.err  # the bar, on stderr, complete
    assert "restored tiny step 4 from warm" in r.out


def test_restore_exit_codes_name_the_problem(capsys, three_tiers, tmp_path):
    cfg, hot, warm, cold = three_tiers
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    r = invoke(capsys, "restore", "tiny", "--to", busy, "--config", cfg)
    assert r.code == 2 and r.err.count("\n") == 1 and str(busy) in r.err and "empty" in r.err
    r = invoke(capsys, "restore", "tiny", "--step", "3", "--to", tmp_path / "n", "--config", cfg)
    assert r.code == 3 and r.err.count("\n") == 1 and hot.url in r.err and "ckptflow ls tiny" in r.err
    r = invoke(capsys, "restore", "tiny", "--tier", "tepid", "--to", tmp_path / "n", "--config", cfg)
    assert r.code == 2 and r.err.count("\n") == 1 and "tepid" in r.err
    for s in (2, 4, 6):  # every hot checkpoint damaged: checkpoints exist, none verifies -> 1
        flip_byte(os.path.join(hot.url_for("tiny", s), "__0_0.distcp"))
    r = invoke(capsys, "restore", "tiny", "--tier", "hot", "--to", tmp_path / "n", "--config", cfg)
    assert r.code == 1 and r.err.count("\n") == 1 and "__0_0.distcp" in r.err
    assert not (tmp_path / "n").exists()


@pytest.mark.parametrize("which", ["hot", "warm", "cold"])
def test_progress_callback_adds_up_to_progress_total(three_tiers, tmp_path, which):
    """fetch's optional progress: raw copies (hot), decoding only (warm, zstd on a local
    tier), download then decode (cold, S3): the bytes reported add up to progress_total."""
    import threading

    from ckptflow.tasks.transfer import fetch, progress_total

    cfg, hot, warm, cold = three_tiers
    tier = {"hot": hot, "warm": warm, "cold": cold}[which]
    seen, lock = [], threading.Lock()

    def cb(n: int) -> None:
        with lock:
            seen.append(n)

    res = fetch(tier, "tiny", 4, str(tmp_path / "d"), progress=cb)
    idx = tier.read_index("tiny", 4)
    assert sum(seen) == progress_total(tier, idx) > 0 and len(seen) >= 2
    want = {
        "hot": idx.total_raw_bytes,
        "warm": idx.total_raw_bytes,
        "cold": idx.total_stored_bytes + idx.total_raw_bytes,
    }[which]
    assert progress_total(tier, idx) == want and res.bytes_raw == idx.total_raw_bytes
    # no callback: the behaviour is the old one (plain copy, same result)
    assert fetch(tier, "tiny", 4, str(tmp_path / "e")).bytes_raw == res.bytes_raw


def test_restore_takes_back_the_progress_of_a_skipped_candidate(three_tiers, tmp_path):
    from ckptflow.tasks.transfer import progress_total, restore

    cfg, hot, warm, cold = three_tiers
    shard = os.path.join(hot.url_for("tiny", 6), "__0_0.distcp")
    flip_byte(shard, offset=os.path.getsize(shard) - 10)  # found after most bytes were copied
    seen: list[int] = []
    res = restore([hot, warm], "tiny", str(tmp_path / "d"), progress=seen.append)
    assert (res.tier, res.step) == ("warm", 6)
    assert any(n < 0 for n in seen)  # the damaged hot copy's bytes were taken back
    assert sum(seen) == progress_total(warm, warm.read_index("tiny", 6))


# ---- ls, pin, prune ------------------------------------------------------------------------


@pytest.fixture
def two_tiers(tiny_run, tmp_path):
    """hot (keep 1) and warm (zstd, keep 1); 2, 4, 6 verified and promoted, as after lifecycles."""
    from ckptflow.tasks import records
    from ckptflow.tasks.config import load_config
    from ckptflow.tasks.storage import Tier
    from ckptflow.tasks.transfer import promote

    shutil.copytree(tiny_run, tmp_path / "hot" / "tiny")
    cfg = write_cfg(tmp_path)
    c = load_config(cfg)
    hot, warm = Tier(c.hot), Tier(c.warm)
    run = str(tmp_path / "hot" / "tiny")
    for s in (2, 4, 6):
        promote(hot, warm, "tiny", s)
        records.write_record(run, s, "verified", {"ok": True})
        records.write_record(run, s, "promoted", {})
    return cfg, hot, warm


def test_prune_dry_run_deletes_nothing_and_pin_protects(capsys, two_tiers, tmp_path):
    cfg, hot, warm = two_tiers
    r = invoke(capsys, "prune", "tiny", "--dry-run", "--config", cfg, "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["dry_run"] and doc["runs"]["tiny"]["hot"]["planned"] == [2, 4]
    assert doc["runs"]["tiny"]["warm"]["planned"] == [2, 4]
    assert doc["runs"]["tiny"]["hot"]["deleted"] == [] and "named by latest" in doc["runs"]["tiny"]["hot"]["kept"]["6"]
    assert hot.committed_steps("tiny") == [6, 4, 2] and warm.committed_steps("tiny") == [6, 4, 2]
    text = invoke(capsys, "prune", "--dry-run", "--config", cfg)  # every run, table form
    assert "would delete" in text.out and "dry run" in text.out
    assert hot.committed_steps("tiny") == [6, 4, 2]

    p = invoke(capsys, "pin", "tiny", "2", "--reason", "paper baseline", "--config", cfg)
    assert p.code == 0 and "on hot" in p.out and "on warm" in p.out  # every tier that has it
    r = invoke(capsys, "prune", "--config", cfg, "--json")
    assert r.code == 0, r.err
    t = r.json()["runs"]["tiny"]
    assert t["hot"]["deleted"] == [4] and t["warm"]["deleted"] == [4]
    assert "pinned" in t["hot"]["kept"]["2"]
    assert hot.committed_steps("tiny") == [6, 2] and warm.committed_steps("tiny") == [6, 2]

    assert invoke(capsys, "unpin", "tiny", "2", "--config", cfg).out.startswith("unpinned tiny step 2 on hot, warm")
    again = invoke(capsys, "unpin", "tiny", "2", "--config", cfg)
    assert again.code == 0 and "was not pinned" in again.out
    # the lifecycle's protection: a hot checkpoint not yet on the furthest tier stays
    os.unlink(os.path.join(hot.url_for("tiny"), layout.LIFECYCLE_DIR, layout.step_name(2), "promoted.json"))
    t = invoke(capsys, "prune", "tiny", "--config", cfg, "--json").json()["runs"]["tiny"]
    assert t["hot"]["deleted"] == [] and "protected by the caller" in t["hot"]["kept"]["2"]
    assert t["warm"]["deleted"] == [2]


def test_pin_needs_a_committed_checkpoint_and_tier_filters(capsys, two_tiers):
    cfg, hot, warm = two_tiers
    r = invoke(capsys, "pin", "tiny", "5", "--config", cfg)
    assert r.code == 3 and r.err.count("\n") == 1 and "step 5" in r.err and hot.url in r.err
    r = invoke(capsys, "pin", "tiny", "4", "--tier", "warm", "--config", cfg, "--json")
    assert r.code == 0 and list(r.json()["pinned"]) == ["warm"]
    assert warm.pinned_steps("tiny") == {4} and hot.pinned_steps("tiny") == set()
    r = invoke(capsys, "pin", "tiny", "4", "--tier", "cold", "--config", cfg)
    assert r.code == 2 and "not configured" in r.err


def test_ls_lists_every_tier_with_sizes_stages_and_status(capsys, two_tiers, tmp_path):
    from ckptflow.tasks import records

    cfg, hot, warm = two_tiers
    hot.pin("tiny", 4, "keep")
    run = str(tmp_path / "hot" / "tiny")
    shutil.rmtree(hot.url_for("tiny", 2))  # pruned from hot, still on warm
    r = invoke(capsys, "ls", "--config", cfg, "--json")
    assert r.code == 0, r.err
    rows = {c["step"]: c for c in r.json()["checkpoints"]}
    assert set(rows) == {2, 4, 6}
    assert rows[2]["tiers"] == ["warm"] and rows[6]["tiers"] == ["hot", "warm"]
    assert rows[6]["stored_bytes"]["warm"] < rows[6]["raw_bytes"] == rows[6]["stored_bytes"]["hot"]
    assert rows[6]["codec"] == {"hot": "none", "warm": "zstd"}
    assert rows[6]["stages"] == ["verified", "promoted"] and rows[6]["verified"]
    assert rows[6]["latest"] == ["hot"] and rows[4]["pinned"] == ["hot"]
    # a quarantined checkpoint shows its reason; ROOT and RUN-dir arguments
    records.quarantine(run, 6, ["sanity: probe loss 2.1 != recorded 1.9"])
    r = invoke(capsys, "ls", tmp_path / "hot" / "tiny", "--config", cfg)
    assert r.code == 0, r.err
    quarantined = [ln for ln in r.out.splitlines() if "QUARANTINED" in ln]
    assert len(quarantined) == 1 and re.search(r"│\s+6\s+│", quarantined[0])
    assert "QUARANTINED (sanity: probe loss 2.1 != recorded 1.9)" in quarantined[0]
    r = invoke(capsys, "ls", "tiny", "--config", cfg, "--json")
    assert {c["step"] for c in r.json()["checkpoints"]} == {2, 4, 6}


def test_ls_of_an_unknown_run_or_path_is_one_line_and_exit_3(capsys, two_tiers, tmp_path):
    cfg, hot, warm = two_tiers
    r = invoke(capsys, "ls", "nosuchrun", "--config", cfg)
    assert r.code == 3 and r.err.count("\n") == 1 and "nosuchrun" in r.err and hot.url in r.err
    r = invoke(capsys, "ls", str(tmp_path / "no" / "where"), "--config", cfg)
    assert r.code == 3 and r.err.count("\n") == 1 and str(tmp_path / "no" / "where") in r.err
    r = invoke(capsys, "ls", "--config", tmp_path / "missing.toml")
    assert r.code == 3 and r.err.count("\n") == 1 and "missing.toml" in r.err


# ---- advise ------------------------------------------------------------------------------


def test_advise_from_flags_matches_the_brute_force_optimum(capsys):
    from tests.helpers import brute_exact, brute_first_order

    r = invoke(
        capsys,
        "advise",
        "--save-seconds",
        "30",
        "--restore-seconds",
        "600",
        "--step-seconds",
        "2",
        "--mtbf-hours",
        "6",
        "--current-steps",
        "100",
        "--json",
    )
    assert r.code == 0, r.err
    d = r.json()
    m = 6 * 3600.0
    assert d["recommended"]["young"]["ideal_s"] == pytest.approx(brute_first_order(30, 600, m), rel=0.01)
    assert d["recommended"]["exact"]["ideal_s"] == pytest.approx(brute_exact(30, 600, m), rel=0.01)
    assert d["recommended"]["daly"]["ideal_s"] == pytest.approx(brute_exact(30, 600, m), rel=0.01)
    assert d["recommended"]["exact"]["steps"] == round(d["recommended"]["exact"]["ideal_s"] / 2)
    assert d["inputs"]["sources"]["save_s"] == "--save-seconds"
    assert [c["label"] for c in d["comparison"]].count("current") == 1
    text = invoke(
        capsys, "advise", "--save-seconds", "30", "--restore-seconds", "600", "--step-seconds", "2", "--mtbf-hours", "6"
    )
    assert f"checkpoint every {d['recommended']['exact']['steps']:,} steps" in text.out
    assert "Young" in text.out and "Daly" in text.out and "4x optimum" in text.out


def test_advise_from_a_run_uses_its_measurements_and_flags_override(capsys, tmp_path):
    run = fake_run(str(tmp_path))
    d = invoke(capsys, "advise", "--from-run", run, "--mtbf-hours", "12", "--json").json()
    assert d["inputs"]["save_s"] == pytest.approx(2.0, abs=1e-3)
    assert d["inputs"]["step_s"] == pytest.approx(0.5, abs=1e-3)
    assert d["inputs"]["restore_s"] == pytest.approx(110.0)
    assert d["measured"]["commit_s"] == pytest.approx(3.0, abs=1e-3)
    assert next(c for c in d["comparison"] if c["label"] == "current")["steps"] == 10  # the run's interval
    d = invoke(capsys, "advise", "--from-run", run, "--mtbf-hours", "12", "--save-seconds", "9", "--json").json()
    assert d["inputs"]["save_s"] == 9 and d["inputs"]["sources"]["save_s"] == "--save-seconds"


def test_advise_errors_are_usage_errors_with_one_line(capsys, tmp_path):
    r = invoke(capsys, "advise", "--save-seconds", "30", "--step-seconds", "2", "--mtbf-hours", "6")
    assert r.code == 2 and r.err.strip() == "ckptflow: error: --restore-seconds is required"
    r = invoke(
        capsys, "advise", "--save-seconds", "0", "--restore-seconds", "1", "--step-seconds", "2", "--mtbf-hours", "6"
    )
    assert r.code == 2 and r.err.strip() == "ckptflow: error: --save-seconds 0.0 must be > 0"
    bare = tmp_path / "hot" / "bare"
    bare.mkdir(parents=True)
    r = invoke(capsys, "advise", "--from-run", bare, "--mtbf-hours", "6")
    assert r.code == 2 and r.err.count("\n") == 1 and "metrics.jsonl" in r.err
    r = invoke(capsys, "advise", "--from-run", tmp_path / "gone", "--mtbf-hours", "6")
    assert r.code == 3 and str(tmp_path / "gone") in r.err


# ---- the console script itself -------------------------------------------------------------


@pytest.mark.serial  # a 1 s bound on start-up
def test_help_is_fast_and_errors_from_the_shell_are_one_line(tmp_path):
    exe = os.path.join(os.path.dirname(PY), "ckptflow")
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "CKPTFLOW_CONFIG")}
    subprocess.run([exe, "--help"], capture_output=True, env=env, cwd=REPO, timeout=60)  # warm the caches
    t0 = time.perf_counter()
    r = subprocess.run([exe, "--help"], capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    took = time.perf_counter() - t0
    assert r.returncode == 0 and took < 1.0, took
    for cmd in ("ls", "verify", "restore", "prune", "pin", "unpin", "drill", "advise", "alerts", "serve"):
        assert f" {cmd} " in r.stdout, cmd
    r = subprocess.run(
        [exe, "restore", "tiny", "--to", str(tmp_path / "x"), "--config", str(tmp_path / "no.toml")],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(tmp_path),
        timeout=60,
    )
    assert r.returncode == 3 and r.stderr.count("\n") == 1 and "no.toml" in r.stderr, r.stderr
    r = subprocess.run(
        [exe, "alerts", "setup", "ftp://example.com/hook"],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(tmp_path),
        timeout=60,
    )
    assert r.returncode == 2 and r.stderr.startswith("ckptflow: error:") and r.stderr.count("\n") == 1
    r = subprocess.run([exe, "serve"], capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=60)
    assert r.returncode == 2 and "PREFECT_API_URL" in r.stderr


def test_an_unreachable_tier_is_named_and_the_others_still_serve(capsys, two_tiers, tmp_path, monkeypatch):
    """A dead S3 endpoint (nothing listens): ls shows hot and warm and exits 4 with a warning
    naming the tier; restore still restores from hot and lists the tier it could not read."""
    from tests.helpers import free_port

    cfg, hot, warm = two_tiers
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # fail in about a second, not after retries
    dead = write_cfg(tmp_path, cold="s3://nobucket/ckpt", endpoint=f"http://127.0.0.1:{free_port()}")
    r = invoke(capsys, "ls", "--config", dead, "--json")
    assert r.code == 4 and "tier cold could not be listed: s3://nobucket/ckpt" in r.err
    assert r.err.count("\n") == 1 and {c["step"] for c in r.json()["checkpoints"]} == {2, 4, 6}
    r = invoke(capsys, "restore", "tiny", "--to", tmp_path / "d", "--config", dead, "--json")
    assert r.code == 0, r.err
    assert (r.json()["tier"], r.json()["step"]) == ("hot", 6)
    assert [k["tier"] for k in r.json()["skipped"]] == ["cold"] and "cannot list" in r.json()["skipped"][0]["reason"]
    r = invoke(capsys, "pin", "tiny", "6", "--tier", "cold", "--config", dead)
    assert r.code == 4 and r.err.count("\n") == 1 and r.err.startswith("ckptflow: error: ")
