"""A worker that finished ends cleanly: no checkpoint thread outlives ``close()``, and
``exit_process`` ends the process with its code and its output, without interpreter
finalization (where torch's C++ threads could abort a job that succeeded)."""

from __future__ import annotations

import textwrap
import time

from tests.helpers import run_script

# A one-layer model and its manager, saving every step (both scripts below).
MANAGER = """env = init_distributed()
torch.manual_seed(0)
m = torch.nn.Linear(8, 8)
o = torch.optim.SGD(m.parameters(), lr=0.1)
ck = CheckpointManager(
    CheckpointConfig(root=os.environ["ROOT"], run_id="r", interval=1, emit_events=False),
    model=m, optimizer=o, provenance=Provenance(config={"a": 1}, data_fingerprint="d"), env=env)
"""

LINGERING_COMMIT = textwrap.dedent("""
    import os, threading, time
    import torch
    from ckptflow.trainer import saver
    from ckptflow.trainer.config import CheckpointConfig, Provenance
    from ckptflow.trainer.checkpointer import CheckpointManager
    from ckptflow.trainer.distenv import init_distributed, shutdown

    commit = saver.AsyncSaver._commit
    def slow_to_return(self, *a, **k):
        commit(self, *a, **k)  # the outcome is set in here: wait() can return from now on
        time.sleep(1.0)        # what is left of the thread: its frame, slowed down
    saver.AsyncSaver._commit = slow_to_return

    {manager}
    for step in (1, 2):
        o.zero_grad(); m(torch.randn(8)).sum().backward(); o.step()
        ck.save(step)
    ck.close()
    alive = [t.name for t in threading.enumerate() if t.name.startswith("ckptflow-commit")]
    print("ALIVE", alive)
    shutdown(env)
""").replace("{manager}\n", MANAGER)


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


ONE_LANE = textwrap.dedent("""
    import os, threading
    import torch
    from ckptflow.trainer import saver
    from ckptflow.trainer.config import CheckpointConfig, Provenance
    from ckptflow.trainer.checkpointer import CheckpointManager
    from ckptflow.trainer.distenv import init_distributed, shutdown
    from ckptflow.trainer.errors import SaveError

    commit = saver.AsyncSaver._commit
    def buggy_once(self, upload, writer, req, *a, **k):
        if req.step == 3:
            raise RuntimeError("a bug in the commit")  # escapes _commit: the lane must survive it
        commit(self, upload, writer, req, *a, **k)
    saver.AsyncSaver._commit = buggy_once

    started = []
    start = threading.Thread.start
    def counting(self):
        started.append(self.name)
        start(self)

    {manager}
    for step in range(1, 7):
        o.zero_grad(); m(torch.randn(8)).sum().backward(); o.step()
        if step == 3:
            threading.Thread.start = counting  # from the third save on: the saver's threads exist
        ck.save(step)
        try:
            ck.wait()
        except SaveError as e:
            print("FAILED", step, e)
    ck.close()
    print("STARTED", sorted(n for n in started if n.startswith("ckptflow-commit")))
    print("LATEST", open(os.path.join(os.environ["ROOT"], "r", "latest")).read().strip())
    shutdown(env)
""").replace("{manager}\n", MANAGER)


def test_saves_run_on_one_background_thread_that_outlives_a_failed_job(tmp_path):
    # A thread started per save cost the training thread 4-7 ms each on a busy host; the saver
    # starts its lane once. A job that raises fails that save only; the next one commits.
    r = run_script(ONE_LANE, {"ROOT": str(tmp_path)}, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "FAILED 3 " in r.stdout and "a bug in the commit" in r.stdout, r.stdout
    assert "FAILED" not in r.stdout.replace("FAILED 3 ", ""), r.stdout
    assert "STARTED []" in r.stdout, r.stdout
    assert "LATEST step_000000006" in r.stdout, r.stdout
