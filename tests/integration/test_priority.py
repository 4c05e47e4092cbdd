"""The CPU priority of a save's background threads (``trainer/priority.py``).

One real process (world size 1, gloo) saves through ``CheckpointManager`` in each async mode
and records, from inside the writer and the commit, which thread did the work and at what
priority: the persist and commit threads run at the configured priority, the training thread
keeps its own (also in ``sync`` mode, where DCP writes on the training thread), and every save
still commits and loads back bitwise.
"""

from __future__ import annotations

import os
import textwrap
import threading

import pytest

from ckptflow.trainer.checkpointer import CheckpointConfig
from ckptflow.trainer.errors import ConfigError
from ckptflow.trainer.priority import PRIORITIES, lower_this_thread, this_thread
from tests.helpers import run_script, script_result

SCRIPT = textwrap.dedent("""
    import json, os, sys, threading
    import torch
    from ckptflow.trainer import fastwrite, priority, saver
    from ckptflow.trainer.checkpointer import CheckpointConfig, CheckpointManager, Provenance
    from ckptflow.trainer.distenv import init_distributed

    seen = []  # (where, thread name, priority)
    write_file = fastwrite.HashingWriter._write_file
    def spy_write(self, *a, **k):
        seen.append(("write", threading.current_thread().name, priority.this_thread()))
        return write_file(self, *a, **k)
    fastwrite.HashingWriter._write_file = spy_write
    gather = saver.AsyncSaver._gather_entries
    def spy_gather(self, *a, **k):
        seen.append(("commit", threading.current_thread().name, priority.this_thread()))
        return gather(self, *a, **k)
    saver.AsyncSaver._gather_entries = spy_gather

    env = init_distributed()
    root, mode, prio = os.environ["ROOT"], os.environ["MODE"], os.environ["PRIO"]

    def build(seed):
        torch.manual_seed(seed)
        m = torch.nn.Linear(32, 48)
        return m, torch.optim.Adam(m.parameters(), lr=0.01)

    def manager(m, o):
        return CheckpointManager(
            CheckpointConfig(root=root, run_id=mode, interval=1, emit_events=False, async_mode=mode,
                             background_priority=prio),
            model=m, optimizer=o, provenance=Provenance(config={"a": 1}, data_fingerprint="d"), env=env)

    m, o = build(0)
    ck = manager(m, o)
    for step in (1, 2):
        o.zero_grad(); m(torch.randn(32)).sum().backward(); o.step()
        ck.save(step)
    ck.close()
    want = {k: v.clone() for k, v in m.state_dict().items()}
    m2, o2 = build(1)
    ck2 = manager(m2, o2)
    step = ck2.load()
    ck2.close()
    same = all(torch.equal(want[k], v) for k, v in m2.state_dict().items())
    print("RESULT " + json.dumps({"seen": seen, "step": step, "same": same,
                                  "training": priority.this_thread()}))
""")


def _run(tmp_path, mode: str, prio: str) -> dict:
    r = run_script(SCRIPT, {"ROOT": str(tmp_path), "MODE": mode, "PRIO": prio})
    assert r.returncode == 0, r.stderr[-4000:]
    return script_result(r.stdout)


@pytest.mark.parametrize("prio", ["idle", "low"])
def test_persist_and_commit_threads_run_at_the_configured_priority(tmp_path, prio):
    out = _run(tmp_path, "async_staging", prio)
    assert out["step"] == 2 and out["same"]
    assert out["training"] == "normal"
    writes = [s for s in out["seen"] if s[0] == "write"]
    commits = [s for s in out["seen"] if s[0] == "commit"]
    assert len(writes) >= 2 and len(commits) == 2
    main = threading.main_thread().name
    for _where, name, got in writes + commits:
        assert name != main and got == prio, out["seen"]


def test_sync_mode_leaves_the_training_thread_alone(tmp_path):
    # In sync mode DCP writes on the training thread: that write must keep the training priority,
    # while the commit (its own thread) is lowered.
    out = _run(tmp_path, "sync", "idle")
    assert out["step"] == 2 and out["same"]
    assert out["training"] == "normal"
    writes = [s for s in out["seen"] if s[0] == "write"]
    commits = [s for s in out["seen"] if s[0] == "commit"]
    assert writes and all(got == "normal" for _w, _n, got in writes), out["seen"]
    assert commits and all(got == "idle" for _w, _n, got in commits), out["seen"]


def test_a_lowered_thread_passes_its_priority_to_threads_it_starts():
    got: dict[str, str] = {}

    def child() -> None:
        got["child"] = this_thread()

    def background() -> None:
        assert lower_this_thread("idle")
        got["self"] = this_thread()
        t = threading.Thread(target=child)
        t.start()
        t.join()

    t = threading.Thread(target=background)
    t.start()
    t.join()
    assert got == {"self": "idle", "child": "idle"}
    assert this_thread() == "normal"  # Linux schedules threads: the caller's thread is untouched


def test_unknown_priorities_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="normal, low, idle"):
        lower_this_thread("high")
    with pytest.raises(ConfigError, match="background_priority='high'.*normal, low, idle"):
        CheckpointConfig(root="/tmp", run_id="r", background_priority="high")
    assert lower_this_thread("normal") is False
    assert PRIORITIES == ("normal", "low", "idle")


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux only")
def test_low_is_nice_19():
    got: dict[str, int] = {}

    def background() -> None:
        lower_this_thread("low")
        got["nice"] = os.getpriority(os.PRIO_PROCESS, 0)

    t = threading.Thread(target=background)
    t.start()
    t.join()
    assert got["nice"] == 19
