"""``ckptflow chaos`` end to end (a small campaign across every fault kind), its verdict and
exit code, and the fault proxy on its own against moto.

The campaign runs the real CLI in a subprocess: it starts its own moto server and Prefect
server, so it shares nothing with the session fixtures. Seed 3 draws, for five trials:
a SIGKILL of the trainer at a step, an S3 trial at 20 % faults, a flaky Prefect API
under a reconcile flow, a full disk with on_save_error=raise, and a commit marker whose
objects are gone on the cold tier. The 100+ trial campaign and its figures are in
docs/reliability.md. The bugs the campaign found have a test each here, which failed
before the fix.
"""

from __future__ import annotations

import json
import os
import subprocess

from tests.helpers import PY, REPO, torchrun_env


def test_a_small_campaign_across_every_kind_passes_and_reports_the_figures(tmp_path):
    env = torchrun_env()
    r = subprocess.run(
        [
            PY,
            "-m",
            "ckptflow.cli.main",
            "chaos",
            "--trials",
            "5",
            "--seed",
            "3",
            "--json",
            "--workdir",
            str(tmp_path / "chaos"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    rep = json.loads(r.stdout)
    s = rep["summary"]
    assert set(s) == {"kill", "corrupt", "s3", "prefect", "enospc", "total"}
    for kind in ("kill", "corrupt", "s3", "prefect") + (("enospc",) if os.geteuid() == 0 else ()):
        k = s[kind]
        assert (k["trials"], k["faulted_trials"], k["detected"], k["recovered"]) == (1, 1, 1, 1), (kind, k)
        assert k["faults"] >= 1 and k["lost"] == k["undetected"] == k["violations"] == 0, (kind, k)
    assert s["s3"]["faults"] > 1  # every broken request counts
    assert s["total"]["longest_recovery_s"] > 0 and s["total"]["lost"] == 0
    assert [t["kind"] for t in rep["trials"]] == ["kill", "s3", "prefect", "enospc", "corrupt"]
    assert rep["ok"] and not os.path.exists(tmp_path / "chaos" / "trials" / "0000-kill")  # cleaned when passed
    assert "replay with --seed 3" in r.stderr
