"""Resume refuses a different experiment, and restores the state that has no tensors."""

from __future__ import annotations

import subprocess
import textwrap

from tests.helpers import PY, REPO, make_run, run_script, torchrun_env


def _train(root, *extra):
    return subprocess.run(
        [
            PY,
            "-m",
            "ckptflow.trainer.train",
            "--parallel",
            "none",
            "--ckpt-root",
            str(root),
            "--run-id",
            "r",
            "--model",
            "tiny",
            "--max-steps",
            "6",
            "--save-every",
            "2",
            *extra,
        ],
        cwd=REPO,
        env=torchrun_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_config_mismatch_is_refused_with_both_values_and_can_be_overridden(tmp_path):
    make_run(tmp_path, "r", max_steps=4, save_every=2)
    r = _train(tmp_path, "--lr", "0.002")  # a different experiment, same run id
    assert r.returncode != 0
    assert "MismatchError" in r.stderr and "config hash" in r.stderr
    assert r.stderr.count("'") >= 4  # both hash values are quoted in the message
    assert "--allow-mismatch" in r.stderr
    ok = _train(tmp_path, "--lr", "0.002", "--allow-mismatch")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "resume despite mismatch" in ok.stderr


def test_data_fingerprint_mismatch_is_refused(tmp_path):
    make_run(tmp_path, "r", max_steps=4, save_every=2)
    r = _train(tmp_path, "--seed", "7")  # other data order
    assert r.returncode != 0 and "data fingerprint" in r.stderr


SCRIPT = textwrap.dedent("""
    import os, random, numpy as np, torch
    from ckptflow.trainer.config import CheckpointConfig, Provenance
    from ckptflow.trainer.checkpointer import CheckpointManager
    from ckptflow.trainer.distenv import init_distributed
    env = init_distributed()
    def build():
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 4); o = torch.optim.AdamW(m.parameters(), lr=0.1)
        s = torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
        g = torch.amp.GradScaler("cpu", init_scale=1024.0)
        return m, o, s, g
    class Sampler:
        def __init__(self): self.pos = 0
        def state_dict(self): return {"pos": self.pos}
        def load_state_dict(self, d): self.pos = d["pos"]
    cfg = CheckpointConfig(root=os.environ["ROOT"], run_id="x", interval=1)
    prov = Provenance(config={"a": 1}, data_fingerprint="d")
    m, o, s, g = build(); smp = Sampler()
    ck = CheckpointManager(cfg, model=m, optimizer=o, scheduler=s, scaler=g, sampler=smp, provenance=prov, env=env)
    g.scale(m(torch.ones(2, 4)).sum()).backward(); g.step(o); g.update(new_scale=77.0)
    s.step(); s.step(); smp.pos = 42
    random.seed(5); np.random.seed(5); torch.manual_seed(5)
    ck.save(3); ck.close()
    expect = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    m2, o2, s2, g2 = build(); smp2 = Sampler()
    random.seed(0); np.random.seed(0); torch.manual_seed(0)
    ck2 = CheckpointManager(cfg, model=m2, optimizer=o2, scheduler=s2, scaler=g2, sampler=smp2,
                        provenance=prov, env=env)
    assert ck2.load() == 3
    assert torch.equal(m.weight, m2.weight)
    assert s2.get_last_lr() == s.get_last_lr() and s2.last_epoch == 2
    assert g2.get_scale() == 77.0, g2.get_scale()
    assert smp2.pos == 42
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expect, "RNG streams restored"
    st1, st2 = o.state_dict()["state"][0], o2.state_dict()["state"][0]
    assert all(torch.equal(st1[k], st2[k]) for k in ("exp_avg", "exp_avg_sq"))
    ck2.close()
    print("OK")
""")


def test_scheduler_scaler_sampler_and_rng_round_trip(tmp_path):
    r = run_script(SCRIPT, {"ROOT": str(tmp_path)}, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
