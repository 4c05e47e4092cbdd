"""DCP's plan caching under ``canonical_planner(cache_key)`` (``trainer/dcp/planner.py``).

A save whose plan is unchanged reuses the previous one; a plan that changes (a parameter group
added to the optimizer between saves, as when layers are unfrozen) is sent and merged; two managers in one process, with
different models, never get each other's plans; closing a manager drops its cache entry. Every
checkpoint's ``.metadata`` lists exactly its own state, and each loads back bitwise. The 2-rank
path (ranks sending empty plans) runs in every multi-save torchrun test, which checks bitwise
resumes.
"""

from __future__ import annotations

import textwrap

from tests.helpers import run_script, script_result

SCRIPT = textwrap.dedent("""
    import json, os, random
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlanner
    from ckptflow.trainer.format import layout
    from ckptflow.trainer.config import CheckpointConfig, Provenance
    from ckptflow.trainer.checkpointer import CheckpointManager
    from ckptflow.trainer.format.dcpmeta import read_dcp_metadata
    from ckptflow.trainer.distenv import init_distributed

    env = init_distributed()
    root = os.environ["ROOT"]
    built = []  # the cache keys whose global plan was (re)built, one per build
    _orig = DefaultSavePlanner._create_global_plan
    def _counting(self, all_plans):
        built.append(self._cached_plans_key)
        return _orig(self, all_plans)
    DefaultSavePlanner._create_global_plan = _counting
    import torch.distributed.checkpoint.default_planner as dp
    local_builds = []
    _orig_local = dp.create_default_local_save_plan
    def _counting_local(state_dict, is_coordinator):
        local_builds.append(1)
        return _orig_local(state_dict, is_coordinator)
    dp.create_default_local_save_plan = _counting_local

    def churn_rng():
        # Python's RNG state is 625 ints whose JSON text changes length as they change: the rank's
        # state entry would change size (and the plan with it) without safetree's padding.
        for _ in range(2000):
            random.random()

    def build(shape, seed, groups=2):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(*shape), torch.nn.Linear(shape[1], shape[1]))
        o = torch.optim.Adam(m[0].parameters(), lr=0.01)
        if groups == 2:
            o.add_param_group({"params": m[1].parameters()})
        return m, o

    def manager(run_id, m, o):
        return CheckpointManager(
            CheckpointConfig(root=root, run_id=run_id, interval=1, emit_events=False),
            model=m, optimizer=o, provenance=Provenance(config={"a": run_id}, data_fingerprint="d"), env=env)

    def step(m, o, n_in):
        o.zero_grad(); m(torch.randn(n_in)).sum().backward(); o.step()

    def entries(run_id, s):
        md = read_dcp_metadata(os.path.join(root, run_id, layout.step_name(s)))
        return {k: list(v.size) for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")}

    (ma, oa), (mb, ob) = build((8, 8), 0, groups=1), (build((16, 4), 1))
    a, b = manager("a", ma, oa), manager("b", mb, ob)
    keys = a._saver._plan_key, b._saver._plan_key
    step(ma, oa, 8); a.save(1)     # the optimizer holds the first layer only
    oa.add_param_group({"params": ma[1].parameters()})
    step(ma, oa, 8); a.save(2)     # now the second layer too: a changed plan
    step(mb, ob, 16); b.save(1)    # another model in the same process
    churn_rng(); step(ma, oa, 8); a.save(3)     # unchanged plan: the cached one
    step(mb, ob, 16); b.save(2)
    churn_rng(); step(ma, oa, 8); a.save(4)     # the RNG moved on again: still cached
    a.wait(); b.wait()
    a_builds = built.count(keys[0])
    local = len(local_builds)
    cached = sorted(k for k in keys if k in SavePlanner._cached_global_plan)
    want = {"a": {k: v.clone() for k, v in ma.state_dict().items()},
            "b": {k: v.clone() for k, v in mb.state_dict().items()}}
    a.close(); b.close()
    left = sorted(k for k in keys if any(k in getattr(SavePlanner, n) for n in (
        "_cached_save_plan", "_cached_final_save_plan", "_cached_all_plans", "_cached_global_plan",
        "_cached_metadata")))

    same = {}
    for run_id, shape, seed in (("a", (8, 8), 5), ("b", (16, 4), 6)):
        m, o = build(shape, seed)
        ck = manager(run_id, m, o)
        ck.load()
        ck.close()
        same[run_id] = all(torch.equal(want[run_id][k], v) for k, v in m.state_dict().items())
    print("RESULT " + json.dumps({
        "cached": len(cached), "left": left, "same": same, "a_builds": a_builds, "local": local,
        "a1": entries("a", 1), "a2": entries("a", 2), "a3": entries("a", 3),
        "b1": entries("b", 1), "b2": entries("b", 2)}))
""")


def test_cached_plans_follow_changes_and_never_cross_managers(tmp_path):
    r = run_script(SCRIPT, {"ROOT": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-4000:]
    out = script_result(r.stdout)
    assert out["cached"] == 2, out  # both managers used the cache...
    assert out["left"] == [], out  # ...and closing them dropped it
    assert out["same"] == {"a": True, "b": True}, out
    # Manager a's global plan was built for its first save and for the changed one, not for the
    # saves whose only change was the per-rank state's content (its size stays padded).
    assert out["a_builds"] == 2, out
    # Local plans were built for a's first and changed saves and b's first: an unchanged layout
    # reuses the cached plan without building it to compare (saver._LayoutCachedPlanner).
    assert out["local"] == 3, out

    def optim(e: dict) -> dict:
        return {k: v for k, v in e.items() if k.endswith(".exp_avg")}

    # The first save had the first layer's optimizer state; the second has both (the changed plan
    # was sent and merged).
    assert sorted(optim(out["a1"])) == ["optim.state.0.bias.exp_avg", "optim.state.0.weight.exp_avg"], out["a1"]
    assert sorted(optim(out["a2"])) == [
        "optim.state.0.bias.exp_avg",
        "optim.state.0.weight.exp_avg",
        "optim.state.1.bias.exp_avg",
        "optim.state.1.weight.exp_avg",
    ], out["a2"]
    assert out["a3"] == out["a2"]
    # Each run's entries are its own model's shapes, whatever the other manager saved between.
    assert {tuple(v) for k, v in out["a2"].items() if k.endswith("weight")} >= {(8, 8)}, out["a2"]
    assert {tuple(v) for k, v in out["b1"].items() if k.endswith("weight")} >= {(4, 16)}, out["b1"]
    assert (8, 8) not in {tuple(v) for v in out["b2"].values()}, out["b2"]
    assert out["b2"] == out["b1"]


def test_a_failed_save_does_not_leave_a_stale_plan_for_its_layout(tmp_path, monkeypatch):
    # Layout A saves; layout B's global plan fails (DCP then keeps A's plan cached); B again must
    # be planned from B, not given A's cached plan because B's layout was seen last.
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from ckptflow.trainer.dcp.planner import canonical_planner, drop_cached_plans
    from ckptflow.trainer.format.dcpmeta import read_dcp_metadata

    key = "test-failed-save"
    a = {"w": torch.ones(4)}
    b = {"w": torch.ones(4), "v": torch.zeros(3)}

    def save(sd, name):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(sd, checkpoint_id=str(tmp_path / name), planner=canonical_planner(key), no_dist=True)

    try:
        save(a, "a")
        real = DefaultSavePlanner._create_global_plan

        def failing(self, plans):
            raise ValueError("validation failed (test)")

        monkeypatch.setattr(DefaultSavePlanner, "_create_global_plan", failing)
        try:
            save(b, "b1")
        except BaseException as e:  # DCP's CheckpointException derives from BaseException
            assert "validation failed" in repr(e)
        else:
            raise AssertionError("the failing global plan did not fail the save")
        monkeypatch.setattr(DefaultSavePlanner, "_create_global_plan", real)
        save(b, "b2")
        assert sorted(read_dcp_metadata(tmp_path / "b2" / ".metadata").state_dict_metadata) == ["v", "w"]
        save(b, "b3")  # and the cached plan of b is then reused
        assert sorted(read_dcp_metadata(tmp_path / "b3" / ".metadata").state_dict_metadata) == ["v", "w"]
    finally:
        drop_cached_plans(key)
