"""The lifecycle with Prefect on PostgreSQL (what Prefect advises for production): a real
PostgreSQL 15 cluster (as the ``postgres`` user when we are root), a Prefect server on it, the
deployments served, several training runs committing at once. Every commit ends verified,
none is processed twice; a server outage is caught up by reconcile."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from ckptflow.harness import PostgresServer, PrefectServer, child_env, children_of
from ckptflow.trainer.format import layout
from tests.helpers import PY, REPO, make_run, prefect_at, write_config


@pytest.fixture(scope="module")
def prefect_pg(tmp_path_factory):
    """A Prefect server whose database is a real PostgreSQL server; yields its API URL."""
    d = tmp_path_factory.mktemp("pg")
    with PostgresServer(str(d / "pg.log")) as pg:
        with PrefectServer(str(d / "prefect"), str(d / "prefect.log"), database_url=pg.url) as srv:
            srv.pg = pg  # type: ignore[attr-defined]
            yield srv


def _lifecycle_runs(api: str, prefix: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with prefect_at(api), get_client(sync_client=True) as c:
        return c.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=prefix)), limit=200)


def test_prefect_on_postgres_really_uses_postgres(prefect_pg):
    # The server's schema is in PostgreSQL (its settings API redacts the URL, so ask the database).
    tables = {r[0] for r in prefect_pg.pg.query("select table_name from information_schema.tables")}
    assert {"flow_run", "deployment", "automation"} <= tables


def test_three_runs_at_once_every_commit_verified_once_on_postgres(prefect_pg, s3_endpoint, s3_bucket, tmp_path):
    hot = tmp_path / "hot"
    cfg = write_config(tmp_path, hot, s3_endpoint, s3_bucket)
    env = dict(child_env(), PREFECT_API_URL=prefect_pg.url, PREFECT_SERVER_ANALYTICS_ENABLED="false")
    log = open(tmp_path / "serve.log", "w")
    srv = subprocess.Popen(
        [PY, "-m", "ckptflow.flows.serve", "--config", cfg, "--reconcile-every", "3600", "--limit", "2"],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    runs = ("pg-a", "pg-b", "pg-c")
    try:
        time.sleep(8)  # the runner registers its deployments and triggers
        jobs = [
            subprocess.Popen(
                [
                    PY,
                    "-m",
                    "ckptflow.trainer.train",
                    "--parallel",
                    "none",
                    "--ckpt-root",
                    str(hot),
                    "--run-id",
                    r,
                    "--model",
                    "tiny",
                    "--max-steps",
                    "4",
                    "--save-every",
                    "2",
                ],
                cwd=REPO,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            for r in runs
        ]
        for j in jobs:
            assert j.wait(300) == 0, j.stderr.read()[-3000:] if j.stderr else ""
        deadline = time.monotonic() + 600
        done: dict[str, list] = {}
        while time.monotonic() < deadline:
            done = {r: _lifecycle_runs(prefect_pg.url, f"lifecycle-{r}-step") for r in runs}
            final = [x for rs in done.values() for x in rs if x.state_type.value in ("COMPLETED", "FAILED", "CRASHED")]
            if len(final) >= 2 * len(runs):
                break
            time.sleep(3)
    finally:
        srv.terminate()
        srv.wait(30)
    for r in runs:
        names = sorted(x.name for x in done[r])
        assert names == [f"lifecycle-{r}-step2", f"lifecycle-{r}-step4"], (
            names,
            (tmp_path / "serve.log").read_text()[-3000:],
        )
        assert {x.state_type.value for x in done[r]} == {"COMPLETED"}
        for s in (2, 4):
            v = json.loads((hot / r / "_lifecycle" / layout.step_name(s) / "verified.json").read_text())
            assert v["sanity"]["process"] == "forkserver"  # the served runs' checks fork from one warm process
    # the runs are rows of PostgreSQL's flow_run table
    rows = prefect_pg.pg.query("select name from flow_run where name like 'lifecycle-pg-%'")
    assert sorted(r[0] for r in rows) == sorted(f"lifecycle-{r}-step{s}" for r in runs for s in (2, 4))


def test_reconcile_catches_up_commits_made_while_the_server_was_down(prefect_pg, s3_endpoint, s3_bucket, tmp_path):
    """Commits while the server is down leave their events in the outbox; after it is back, one
    reconcile run starts every missed lifecycle and each ends verified."""
    from ckptflow.flows.reconcile import reconcile

    hot = tmp_path / "hot"
    cfg = write_config(tmp_path, hot, s3_endpoint, s3_bucket, hot_keep=5, warm_keep=5, cold_keep=5, sanity=False)
    prefect_pg.kill()
    try:
        make_run(hot, "pg-down", max_steps=4, save_every=2, env={"PREFECT_API_URL": prefect_pg.url})
    finally:
        prefect_pg.start()
    with prefect_at(prefect_pg.url):
        out = reconcile(config=cfg)
        again = reconcile(config=cfg)
    assert out["runs"]["pg-down"]["unfinished"] == [2, 4]
    assert [x["status"] for x in out["runs"]["pg-down"]["processed"]] == ["done", "done"]
    for s in (2, 4):
        assert (hot / "pg-down" / "_lifecycle" / layout.step_name(s) / "verified.json").exists()
    assert again["runs"]["pg-down"]["processed"] == []  # nothing twice


def test_each_machine_gets_its_own_sanity_and_upload_limit(prefect_pg, monkeypatch):
    from prefect.client.orchestration import get_client

    from ckptflow.flows.limits import ensure_machine_limits, machine_slot

    monkeypatch.setenv("PREFECT_API_URL", prefect_pg.url)
    monkeypatch.setenv("CKPTFLOW_HOST", "m1")
    with prefect_at(prefect_pg.url):
        assert ensure_machine_limits(1, 2) == {"ckptflow-sanity-m1": 1, "ckptflow-upload-m1": 2}
        assert ensure_machine_limits(3, 2)["ckptflow-sanity-m1"] == 3  # a restart with a new config updates it
        with get_client(sync_client=True) as c:
            with machine_slot("verify"):  # the verify stage holds one slot of this machine's limit
                held = c.read_global_concurrency_limit_by_name("ckptflow-sanity-m1").active_slots
            after = c.read_global_concurrency_limit_by_name("ckptflow-sanity-m1").active_slots
            assert c.read_global_concurrency_limit_by_name("ckptflow-upload-m1").limit == 2
        assert (held, after) == (1, 0)
        with machine_slot("compress"):  # no limit for the other stages
            pass


def test_a_slot_held_past_its_renewal_is_renewed_on_the_callers_server(prefect_pg, monkeypatch, caplog):
    """The lease is renewed from a thread of its own, with the Prefect settings the slot was taken
    with: a plain thread saw none, and its client started a local server of its own (a process
    that outlived the test) and renewed there a lease that server never had."""
    import logging

    import prefect.settings  # noqa: F401 - the process's root settings, as a flow process has them, hold no URL

    from ckptflow.flows import limits

    monkeypatch.setenv("PREFECT_API_URL", prefect_pg.url)  # machine_slot's switch
    monkeypatch.setenv("CKPTFLOW_HOST", "m-renew")
    monkeypatch.setattr(limits, "RENEW_S", 1.0)
    before = set(children_of(os.getpid()))
    with prefect_at(prefect_pg.url), caplog.at_level(logging.WARNING, logger=limits.__name__):
        limits.ensure_machine_limits(1, 1)
        with limits.machine_slot("verify"):
            time.sleep(2.5)  # two renewals
    assert not [r for r in caplog.records if "renew" in r.getMessage()], caplog.text
    assert set(children_of(os.getpid())) - before == set(), "no Prefect server of this process's own"


def test_two_workers_of_one_machine_starting_at_once_both_get_its_limits(prefect_pg, monkeypatch):
    """The second worker's read found no limit, the first created it before the second's create:
    the second sets its values on the existing limit instead of exiting (``ObjectAlreadyExists``)."""
    from prefect.client.orchestration import SyncPrefectClient, get_client
    from prefect.exceptions import ObjectNotFound

    from ckptflow.flows.limits import ensure_machine_limits

    monkeypatch.setenv("PREFECT_API_URL", prefect_pg.url)
    monkeypatch.setenv("CKPTFLOW_HOST", "race")
    with prefect_at(prefect_pg.url):
        ensure_machine_limits(1, 1)  # the first worker

        def not_there_yet(self, name):  # what the second worker read just before the first created it
            raise ObjectNotFound(http_exc=Exception(name))

        monkeypatch.setattr(SyncPrefectClient, "read_global_concurrency_limit_by_name", not_there_yet)
        assert ensure_machine_limits(2, 3) == {"ckptflow-sanity-race": 2, "ckptflow-upload-race": 3}
        monkeypatch.undo()
        monkeypatch.setenv("PREFECT_API_URL", prefect_pg.url)
        with get_client(sync_client=True) as c:
            assert c.read_global_concurrency_limit_by_name("ckptflow-sanity-race").limit == 2
            assert c.read_global_concurrency_limit_by_name("ckptflow-upload-race").limit == 3


def test_a_lifecycle_killed_inside_verify_holds_its_machine_s_slot_for_seconds_not_the_lease(
    prefect_pg, tiny_run, tmp_path, monkeypatch
):
    """A lifecycle SIGKILLed in its verify stage cannot release its machine's sanity slot (limit 1).
    The next lifecycle on that machine releases it (the holder's process is gone) and starts its
    own verify within seconds — not after the slot's lease, nor Prefect's default 300 s."""
    import shutil

    from prefect.client.orchestration import get_client

    from ckptflow.flows.limits import SLOT_LEASE_S, _Holders, ensure_machine_limits, limit_name

    hot = tmp_path / "hot"
    shutil.copytree(tiny_run, hot / "tiny")
    cfg = tmp_path / "ckptflow.toml"
    cfg.write_text(f'[hot]\nurl = "{hot}"\n[warm]\nurl = "{tmp_path / "warm"}"\n[lifecycle]\nsanity_step = false\n')
    env = dict(child_env(), PREFECT_API_URL=prefect_pg.url, CKPTFLOW_HOST="m-killed")
    monkeypatch.setenv("PREFECT_API_URL", prefect_pg.url)
    monkeypatch.setenv("CKPTFLOW_HOST", "m-killed")
    with prefect_at(prefect_pg.url):
        ensure_machine_limits(1, 1)

    def lifecycle(step: int, fault: str = "") -> subprocess.CompletedProcess:
        code = f"from ckptflow.flows.lifecycle import lifecycle\nlifecycle('tiny', {step}, config={str(cfg)!r})"
        return subprocess.run(
            [PY, "-c", code], cwd=REPO, env=dict(env, CKPTFLOW_FAULT=fault), capture_output=True, text=True, timeout=300
        )

    killed = lifecycle(6, "verify.before_record@6")  # killed after verifying, before its record
    assert killed.returncode == -9, killed.stderr[-2000:]
    with prefect_at(prefect_pg.url), get_client(sync_client=True) as c:
        assert c.read_global_concurrency_limit_by_name(limit_name("sanity")).active_slots == 1  # still held
    # when the killed lifecycle took the slot: its holder file (this machine's registry) was written then
    (held,) = [e for e in os.scandir(_Holders(limit_name("sanity")).dir) if not e.name.startswith(".")]
    taken = held.stat().st_mtime
    nxt = lifecycle(4)
    assert nxt.returncode == 0, nxt.stderr[-2000:]
    verified_json = hot / "tiny" / "_lifecycle" / layout.step_name(4) / "verified.json"
    assert verified_json.exists()
    assert "died holding it" in nxt.stderr
    # Its verify ran before the killed holder's lease could have run out (the server keeps a slot for
    # SLOT_LEASE_S after its holder's last renewal): it took the slot from the dead holder, it did not
    # wait out the lease. Measured against when the slot was taken, not as the next lifecycle's wall
    # time, which on a loaded machine is mostly its interpreter's start-up (31 s in one CI run).
    verified = verified_json.stat().st_mtime
    assert verified - taken < SLOT_LEASE_S, (verified - taken, SLOT_LEASE_S)
    with prefect_at(prefect_pg.url), get_client(sync_client=True) as c:
        assert c.read_global_concurrency_limit_by_name(limit_name("sanity")).active_slots == 0
