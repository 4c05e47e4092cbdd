"""A worker that finished ends cleanly: no checkpoint thread outlives ``close()``, and
``exit_process`` ends the process with its code and its output, without interpreter
finalization (where torch's C++ threads could abort a job that succeeded)."""

from __future__ import annotations

import textwrap
import time

from tests.helpers import run_script

LINGERING_COMMIT = textwrap.dedent("""
    import os, threading, time
    import torch
    from ckptflow.trainer import saver
    from ckptflow.trainer.checkpointer import CheckpointConfig, CheckpointManager, Provenance
    from ckptflow.trainer.distenv import init_distributed, shutdown

    commit = saver.AsyncSaver._commit
    def slow_to_return(self, *a, **k):
        commit(self, *a, **k)  # the outcome is set in here: wait() can return from now on
        time.sleep(1.0)        # what is left of the thread: its frame, slowed down
    saver.AsyncSaver._commit = slow_to_return

    env = init_distributed()
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 8)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    ck = CheckpointManager(
        CheckpointConfig(root=os.environ["ROOT"], run_id="r", interval=1, emit_events=False),
        model=m, optimizer=o, provenance=Provenance(config={"a": 1}, data_fingerprint="d"), env=env)
    for step in (1, 2):
        o.zero_grad(); m(torch.randn(8)).sum().backward(); o.step()
        ck.save(step)
    ck.close()
    alive = [t.name for t in threading.enumerate() if t.name.startswith("ckptflow-commit")]
    print("ALIVE", alive)
    shutdown(env)
""")


def test_no_commit_thread_outlives_close(tmp_path):
    r = run_script(LINGERING_COMMIT, {"ROOT": str(tmp_path)}, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ALIVE []" in r.stdout, r.stdout


def test_exit_process_keeps_the_code_and_the_output_and_skips_finalization():
    # A non-daemon thread would hold a normal exit for a minute; exit_process does not wait.
    script = (
        "import sys, threading, time\n"
        "from ckptflow.trainer.distenv import exit_process\n"
        "threading.Thread(target=time.sleep, args=(60,)).start()\n"
        "sys.stdout.write('unflushed out')\n"
        "sys.stderr.write('unflushed err')\n"
        "exit_process(3)\n"
    )
    t0 = time.monotonic()
    r = run_script(script, timeout=60)
    assert time.monotonic() - t0 < 30
    assert r.returncode == 3
    assert r.stdout == "unflushed out"
    assert r.stderr.endswith("unflushed err")
