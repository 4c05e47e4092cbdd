"""`ckptflow demo` end to end in a shorter setting, as a user starts it: checks what it did, not
just its exit code."""

from __future__ import annotations

import json
import os
import subprocess

from tests.helpers import PY, REPO


def _procs_with_env(needle: str) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if needle.encode() in f.read():
                        out.append(int(d))
            except OSError:
                continue
    return out


def _demo(wd, *args: str) -> subprocess.CompletedProcess:
    """``ckptflow demo`` in a shell with nothing of ours or Prefect's set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "AWS_", "CKPTFLOW_"))}
    return subprocess.run(
        [PY, "-m", "ckptflow.cli.main", "demo", "--workdir", str(wd), "--model", "tiny", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_demo_end_to_end(tmp_path):
    """``ckptflow demo`` as a user starts it: a Prefect server, ``ckptflow serve``, a 2-rank job
    whose commit events trigger the lifecycles; a worker SIGKILLed mid-run; every checkpoint
    verified (probe bitwise, expectations met), compressed onto warm and cold, hot pruned by
    policy, and exported as safetensors; a checkpoint another tool wrote is adopted into the same
    lifecycle; the drill restores the newest at another world size; with hot and warm wiped the job
    comes back from cold by itself."""
    wd = tmp_path / "demo"
    r = _demo(wd, "--steps", "40", "--save-every", "10", "--kill-at", "15")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    s = json.loads((wd / "summary.json").read_text())
    assert s["ok"] and s["problems"] == []
    assert s["killed_at_step"] >= 15 and s["resumed_from"] == 10  # killed mid-run, resumed from 10
    same, total = s["replay_identical"]
    assert total >= 5 and same == total  # replayed steps bit-identical
    assert [c["step"] for c in s["checkpoints"]] == [10, 20, 30, 40]
    for c in s["checkpoints"]:
        assert c["verified"] and c["probe"] == "bitwise" and c["expectations"] is True
        assert {"warm", "cold"} <= set(c["tiers"]) and c["stored"]["cold"] < c["raw"]  # compressed
    # prune by the demo's policy: hot keeps the newest 3, warm 4, cold 10
    assert [c["step"] for c in s["checkpoints"] if "hot" in c["tiers"]] == [20, 30, 40]
    assert set(s["lifecycle_states"].values()) == {"COMPLETED"}
    assert s["drill"]["ok"] and os.path.getsize(s["drill"]["plot"]) > 10_000
    res = s["drill"]["results"][0]
    assert res["step"] == 40 and res["probe_match"] == "bitwise" and res["world_size"] != res["saved_world_size"]
    # A checkpoint another tool wrote, adopted by `ckptflow adopt`: its event started the same
    # deployed lifecycle, which verified it by the parse check and took it to warm and cold.
    a = s["adopted"]
    assert a["record"]["adopted"] == "dcp" and a["verified"] and a["check"] == "parse", a
    assert {"warm", "cold"} <= set(a["tiers"]), a
    assert s["lifecycle_states"]["lifecycle-other-tool-step100"] == "COMPLETED"
    # every verified checkpoint exported beside it on warm and cold, and safetensors reads it
    from safetensors.torch import load_file

    for c in s["checkpoints"]:
        e = c["export"]
        assert e and e["location"].startswith(str(wd / "warm")) and e["cold"].startswith("s3://"), c
        got = {k: v for n in e["shards"] for k, v in load_file(os.path.join(e["location"], n)).items()}
        assert len(got) == e["tensors"] and sum(v.numel() * v.element_size() for v in got.values()) == e["bytes"]
    # The hot tier lost: the same job comes back from cold by itself, and trains on bitwise
    w = s["way_back"]
    assert w["ok"] and w["step"] == 40 and w["tier"] == "cold" and w["bitwise"] and w["steps"] == [41, 42, 43, 44], w
    assert w["bytes_fetched"] > 0 and "the way back:" in r.stdout
    assert "demo OK" in r.stdout and "bit-identical" in r.stdout and "adopted:" in r.stdout and "exported:" in r.stdout
    assert _procs_with_env(str(wd / "prefect")) == [], "the demo stopped every process it started"
