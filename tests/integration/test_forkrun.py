"""Flow runs forked from the worker's fork server (flows/forkrun.py, flows/worker.py): a real
Prefect server (the session's), a real ``ckptflow worker --general`` on its own pool, real
deployments of a small flow (tests/prefect_flows.py) started, failed and cancelled."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid

import pytest

from ckptflow.harness import stop_group
from tests.helpers import PY, REPO, alive, write_config


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().split(") ")[1].split()[1])


def _wait_file(path, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)
        time.sleep(0.5)
    raise AssertionError(f"{path} not written in {timeout:.0f} s")


def _start_worker(api: str, d, *, fork_flow_runs: bool = True) -> tuple[subprocess.Popen, str]:
    """A general worker on a pool of its own, the test flow deployed there (the pool's only deployment)."""
    from prefect.deployments.runner import EntrypointType

    from ckptflow.flows.serve import ensure_pool
    from tests.prefect_flows import whoami

    cfg = write_config(d, d / "hot", "http://127.0.0.1:1", "unused")
    with open(cfg, "a") as f:
        f.write(f"[prefect]\nfork_flow_runs = {str(fork_flow_runs).lower()}\n")
    pool = f"forkrun-{uuid.uuid4().hex[:8]}"
    ensure_pool(pool)
    whoami.to_deployment(name=pool, work_pool_name=pool, entrypoint_type=EntrypointType.MODULE_PATH).apply()
    env = dict(
        os.environ,
        PREFECT_API_URL=api,
        PREFECT_WORKER_QUERY_SECONDS="1",
        PREFECT_WORKER_PREFETCH_SECONDS="1",
        PYTHONPATH=REPO,
        OMP_NUM_THREADS="1",
        # A machine of its own: a worker creates its machine's sanity/upload limits on the
        # session's server, and later tests' lifecycles on this host would take those slots.
        CKPTFLOW_HOST=pool,
    )
    with open(d / "worker.log", "ab") as log:
        proc = subprocess.Popen(
            [PY, "-m", "ckptflow.cli.main", "worker", "--general", "--pool", pool, "--config", cfg],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, f"{whoami.name}/{pool}"


@pytest.fixture(scope="module")
def worker(prefect_api, tmp_path_factory):
    """A general worker with its fork server (the default), and the test flow deployed for it."""
    d = tmp_path_factory.mktemp("forkrun")
    proc, deployment = _start_worker(prefect_api, d)
    try:
        yield proc, d, d / "worker.log", deployment
    finally:
        stop_group(proc, timeout=20)


def _run(deployment: str, parameters: dict, timeout: float):
    from prefect.deployments import run_deployment

    return run_deployment(deployment, parameters=parameters, timeout=timeout)


def _state(flow_run_id):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        return c.read_flow_run(flow_run_id).state


def test_a_flow_run_is_a_child_of_the_workers_fork_server(worker):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    proc, d, log, dep = worker
    out = d / "ok.json"
    fr = _run(dep, {"out": str(out)}, timeout=240)
    assert fr.state is not None and fr.state.is_completed(), (fr.state, log.read_text()[-3000:])
    who = _wait_file(out, 5)
    server = who["ppid"]
    assert "ckptflow.tasks.forkserver" in _cmdline(server), _cmdline(server)  # not a fresh python -m prefect.engine
    assert _ppid(server) == proc.pid  # the worker's own fork server
    # The child exits with its flow run: the engine reports Completed first, then the child drains
    # Prefect's queued logs and events as an interpreter exit would, so allow it a few seconds.
    deadline = time.monotonic() + 15
    while alive(who["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(who["pid"])
    # The run's log line reached the server: the child drained Prefect's log queue as an exit would.
    deadline = time.monotonic() + 30
    msgs: list[str] = []
    while time.monotonic() < deadline:
        with get_client(sync_client=True) as c:
            msgs = [x.message for x in c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[fr.id])))]
        if any("whoami: flow run in pid" in m for m in msgs):
            break
        time.sleep(1)
    assert any(f"whoami: flow run in pid {who['pid']}" in m for m in msgs), msgs


def test_a_failing_flow_run_fails_and_the_next_one_runs(worker):
    _, d, log, dep = worker
    fr = _run(dep, {"out": str(d / "fail.json"), "fail": True}, timeout=240)
    assert fr.state is not None and fr.state.is_failed(), (fr.state, log.read_text()[-3000:])
    assert "whoami was asked to fail" in str(fr.state.message) or fr.state.type.value == "FAILED"
    again = _run(dep, {"out": str(d / "again.json")}, timeout=240)
    assert again.state is not None and again.state.is_completed()


def test_cancelling_a_flow_run_stops_its_forked_process(worker):
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    _, d, log, dep = worker
    out = d / "sleeper.json"
    fr = _run(dep, {"out": str(out), "sleep_s": 600}, timeout=0)
    who = _wait_file(out, 240)
    assert alive(who["pid"])
    with get_client(sync_client=True) as c:
        c.set_flow_run_state(fr.id, Cancelling(), force=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and (alive(who["pid"]) or not _state(fr.id).is_cancelled()):
        time.sleep(1)
    assert not alive(who["pid"]), log.read_text()[-3000:]
    assert _state(fr.id).is_cancelled(), (_state(fr.id), log.read_text()[-3000:])


def test_fork_flow_runs_false_keeps_prefects_worker_and_a_fresh_process(prefect_api, tmp_path):
    proc, dep = _start_worker(prefect_api, tmp_path, fork_flow_runs=False)
    try:
        fr = _run(dep, {"out": str(tmp_path / "fresh.json")}, timeout=240)
        assert fr.state is not None and fr.state.is_completed(), (tmp_path / "worker.log").read_text()[-3000:]
        who = _wait_file(tmp_path / "fresh.json", 5)
        assert who["ppid"] == proc.pid  # Prefect's worker started it, fresh
        assert "Worker 'ProcessWorker" in (tmp_path / "worker.log").read_text()
    finally:
        stop_group(proc, timeout=20)


def test_without_a_fork_server_the_launcher_is_prefects_engine():
    env = {k: v for k, v in os.environ.items() if k != "CKPTFLOW_FORKSERVER"}
    r = subprocess.run(
        [PY, "-m", "ckptflow.flows.forkrun", "not-a-uuid"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    # what `python -m prefect.engine not-a-uuid` answers: the engine itself ran
    assert r.returncode == 1
    assert "Invalid flow run id" in r.stderr + r.stdout
