"""Staging by copies alone when the layout is unchanged (``trainer/dcp/staging.py``).

The stager must hand DCP a copy equal to the live state at the moment of staging, whatever it
reuses: new values in reused buffers, this save's scalars (a learning rate), storages shared as
the live ones are, and a full DCP staging whenever the layout changed or holds something it does
not restage. FSDP2's DTensors are staged in a real gloo process group (one rank), as in a job.
"""

from __future__ import annotations

import textwrap

import torch

from ckptflow.trainer.dcp.staging import ReusingStateDictStager
from tests.helpers import run_script, script_result


def _state(w: torch.Tensor, lr: float, entry: torch.Tensor) -> dict:
    return {
        "model": {"w": w, "w_t": w.t(), "row": w[1]},  # three views of one storage
        "optim": {"param_groups": [{"lr": lr, "params": ["w"]}], "state": {"w": {"step": torch.tensor(3.0)}}},
        "ranks": {"rank0": entry},
    }


def test_an_unchanged_layout_is_restaged_by_copies_with_this_saves_values():
    st = ReusingStateDictStager(pin_memory=False, share_memory=False)
    w = torch.arange(12.0).reshape(3, 4)
    first = st.stage(_state(w, 0.1, torch.zeros(8, dtype=torch.uint8)))
    assert st.reused == 0
    w.add_(100.0)
    # A new tensor object with the same layout (a rank's state entry is a new tensor every save).
    second = st.stage(_state(w, 0.05, torch.full((8,), 7, dtype=torch.uint8)))
    assert st.reused == 1
    assert torch.equal(second["model"]["w"], w) and torch.equal(second["model"]["w_t"], w.t())
    assert torch.equal(second["model"]["row"], w[1])
    assert second["optim"]["param_groups"][0]["lr"] == 0.05  # this save's scalar, not the first's
    assert torch.equal(second["ranks"]["rank0"], torch.full((8,), 7, dtype=torch.uint8))
    # The copy is a copy: a step after staging does not reach it, and views share as live ones do.
    w.add_(1.0)
    assert torch.equal(second["model"]["w"], w - 1.0)
    assert second["model"]["w"].untyped_storage().data_ptr() != w.untyped_storage().data_ptr()
    sp = {second["model"][k].untyped_storage().data_ptr() for k in ("w", "w_t", "row")}
    assert len(sp) == 1
    assert first["model"]["w"] is second["model"]["w"]  # the buffers were reused, not remade


def test_a_changed_layout_or_an_unknown_leaf_is_staged_by_dcp():
    st = ReusingStateDictStager(pin_memory=False, share_memory=False)
    w = torch.ones(3, 4)
    st.stage(_state(w, 0.1, torch.zeros(8, dtype=torch.uint8)))
    bigger = st.stage(_state(w, 0.1, torch.zeros(16, dtype=torch.uint8)))  # an entry that grew
    assert st.reused == 0 and bigger["ranks"]["rank0"].numel() == 16
    again = st.stage(_state(w, 0.1, torch.ones(16, dtype=torch.uint8)))  # the new layout is the reference
    assert st.reused == 1 and torch.equal(again["ranks"]["rank0"], torch.ones(16, dtype=torch.uint8))

    class Opaque:
        def __init__(self, v: int) -> None:
            self.v = v

    for v in (1, 2):
        out = st.stage({"w": w, "obj": Opaque(v)})
        assert out["obj"].v == v
    assert st.reused == 1  # never restaged around an object it cannot copy


def test_fsdp_dtensors_are_restaged_in_a_process_group():
    script = textwrap.dedent("""
        import json, os, tempfile
        import torch, torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
        from ckptflow.trainer.distenv import exit_process
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from ckptflow.trainer.dcp.staging import ReusingStateDictStager

        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        fully_shard(m)
        o = torch.optim.AdamW(m.parameters(), lr=0.01)
        st = ReusingStateDictStager(pin_memory=False, share_memory=False)
        ok = []
        for i in range(3):
            m(torch.randn(5, 4)).sum().backward(); o.step(); o.zero_grad()
            msd, osd = get_state_dict(m, o)
            staged = st.stage({"model": msd, "optim": osd})
            ok.append(all(torch.equal(staged["model"][k].to_local(), v.to_local()) for k, v in msd.items()))
            ok.append(all(torch.equal(staged["optim"]["state"][k]["exp_avg"].to_local(), v["exp_avg"].to_local())
                          for k, v in osd["state"].items()))
        print("RESULT " + json.dumps({"ok": ok, "reused": st.reused,
                                      "dtensor": type(staged["model"]["0.weight"]).__name__}))
        dist.destroy_process_group()
        exit_process(0)  # no interpreter finalization racing gloo's threads
    """)
    r = run_script(script)
    assert r.returncode == 0, r.stderr[-3000:]
    out = script_result(r.stdout)
    assert out["dtensor"] == "DTensor"
    assert out["reused"] == 2, out  # the second and third saves
    assert all(out["ok"]), out
