"""The lifecycle of checkpoints saved on node-local hot roots: every node's part on its own worker.

Real parts: two simulated nodes (torchrun agents, their own hot folders), a Prefect server
(the session's), a process worker per node on its own queue ``node-<id>`` started with that
node's config, warm a shared folder, cold the moto S3 server. The lifecycle flow itself runs
in this process (as the trigger would run it on a general worker) and fans the parts out.
"""

from __future__ import annotations

import contextvars
import json
import os
import shutil
import subprocess
import threading
import time

import pytest

from ckptflow.harness import NodeAgents, stop_group
from ckptflow.tasks.storage import Tier
from ckptflow.trainer.events import read_outbox
from ckptflow.trainer.format import layout
from tests.helpers import PY, REPO

RUN = "nl"
POOL = "ckptflow-pool"


def _config(path, hot, warm, s3_endpoint, bucket, *, part_timeout: float = 120) -> str:
    path.write_text(f"""
[hot]
url = "{hot}"
[hot.retention]
keep_last = 1
[warm]
url = "{warm}"
codec = "zstd"
[warm.retention]
keep_last = 2
[cold]
url = "s3://{bucket}/c"
codec = "zstd"
endpoint_url = "{s3_endpoint}"
[cold.retention]
keep_last = 5
[lifecycle]
sanity_step = true
node_part_timeout_s = {part_timeout}
""")
    return str(path)


@pytest.fixture(scope="module")
def deployed(prefect_api):
    """The node-part deployment in the work pool (and nothing else of ours, so no trigger competes
    with other tests); removed afterwards."""
    from prefect.client.orchestration import get_client

    env = dict(os.environ, PREFECT_API_URL=prefect_api)
    subprocess.run(
        [PY, "-m", "prefect", "work-pool", "create", POOL, "--type", "process"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    r = subprocess.run(
        [
            PY,
            "-m",
            "prefect",
            "--no-prompt",
            "deploy",
            "--prefect-file",
            "deployments/prefect.yaml",
            "--name",
            "node-part",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    yield prefect_api
    with get_client(sync_client=True) as c:
        try:
            c.delete_deployment(c.read_deployment_by_name("ckptflow-node-part/node-part").id)
        except Exception:
            pass


class Workers:
    """A process worker per node, on that node's queue, with that node's config."""

    def __init__(self, api: str, log_dir) -> None:
        self.api, self.log_dir = api, log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, node: str, config: str) -> None:
        env = dict(
            os.environ,
            PREFECT_API_URL=self.api,
            CKPTFLOW_CONFIG=config,
            PREFECT_WORKER_QUERY_SECONDS="1",
            PREFECT_WORKER_PREFETCH_SECONDS="1",
            OMP_NUM_THREADS="1",
        )
        log = open(os.path.join(self.log_dir, f"worker-{node}.log"), "ab")
        self.procs[node] = subprocess.Popen(
            [PY, "-m", "ckptflow.cli.main", "worker", "--pool", POOL, "--config", config],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def stop(self, node: str) -> None:
        stop_group(self.procs.pop(node), timeout=10)

    def wait_polling(self, timeout: float = 180.0) -> None:
        """Until every started worker has polled its queue: a test whose subject is a part
        timeout must not be timing a worker's start-up (seconds, more on a busy machine)."""
        from ckptflow.flows.nodes import node_queues

        t0 = time.monotonic()
        while set(self.procs) - set(node_queues(POOL, polled_within_s=time.monotonic() - t0)):
            assert time.monotonic() - t0 < timeout, f"workers {sorted(self.procs)} did not poll in {timeout:.0f} s"
            time.sleep(0.5)

    def stop_all(self) -> None:
        for n in list(self.procs):
            self.stop(n)


def _train(tmp_path, nproc: int, replicas: int, *, steps: int = 8, every: int = 4) -> list[str]:
    roots = [str(tmp_path / f"node{i}") for i in range(2)]
    args = [
        "--run-id",
        RUN,
        "--model",
        "tiny",
        "--max-steps",
        str(steps),
        "--save-every",
        str(every),
        "--replicas",
        str(replicas),
    ]
    with NodeAgents(roots, args, nproc=nproc, log_dir=str(tmp_path / "logs")) as nodes:
        nodes.start()
        assert nodes.wait(300) == [0, 0], "\n".join(nodes.output(i)[-2000:] for i in range(2))
    return roots


def _node_id(root: str) -> str:
    with open(os.path.join(root, layout.NODE_ID)) as f:
        return json.load(f)["node"]


def _commits(roots: list[str]) -> list[dict]:
    return [x for r in roots for x in read_outbox(os.path.join(r, RUN))]


def _setup(tmp_path, s3_endpoint, bucket, roots, **kw) -> tuple[dict[str, str], str]:
    warm = str(tmp_path / "warm")
    cfgs = {
        _node_id(r): _config(tmp_path / f"n{i}.toml", r, warm, s3_endpoint, bucket, **kw) for i, r in enumerate(roots)
    }
    general = _config(tmp_path / "general.toml", str(tmp_path / "general-hot"), warm, s3_endpoint, bucket, **kw)
    return cfgs, general


def _lifecycle(commit: dict, config: str) -> dict:
    from ckptflow.flows.lifecycle import lifecycle

    return lifecycle(
        run_id=commit["run_id"],
        step=commit["step"],
        uri=commit["uri"],
        root=commit["root"],
        config=config,
        scope=commit["scope"],
        nodes=",".join(commit["nodes"]),
    )


def _warm_cold(tmp_path, s3_endpoint, bucket) -> tuple[Tier, Tier]:
    from ckptflow.tasks.config import load_config

    cfg = load_config(str(tmp_path / "general.toml"))
    return Tier(cfg.warm), Tier(cfg.cold)


def _hot(root: str):
    from ckptflow.tasks.config import TierConfig

    return TierConfig(name="hot", url=root)


def test_a_node_whose_worker_is_down_delays_only_its_part_and_reconcile_finishes(
    deployed, tmp_path, s3_endpoint, s3_bucket
):
    """Two nodes by two ranks, no replicas (each node's part exists only there), and node 1's
    worker down: the lifecycle fails naming it and warm holds nothing; once its worker is back,
    reconcile takes the checkpoint whole to warm and cold, with every part's record, and ``ls``
    on a node says which nodes committed it and what the node holds. (The node demo in tests/e2e
    takes checkpoints through the same path from real commit events, one rank per node.)"""
    roots = _train(tmp_path, nproc=2, replicas=1, steps=4)
    cfgs, general = _setup(tmp_path, s3_endpoint, s3_bucket, roots, part_timeout=20)
    commits = _commits(roots)
    assert [c["step"] for c in commits] == [4] and all(c["scope"] == "node" and len(c["nodes"]) == 2 for c in commits)
    (commit,) = commits
    nodes = list(cfgs)
    down = nodes[1]
    w = Workers(deployed, tmp_path)
    warm, cold = _warm_cold(tmp_path, s3_endpoint, s3_bucket)
    try:
        w.start(nodes[0], cfgs[nodes[0]])
        w.wait_polling()  # the part timeout (20 s) times the down node, not this worker's start-up
        from ckptflow.flows.lifecycle import lifecycle

        state = lifecycle(
            run_id=RUN,
            step=4,
            uri=commit["uri"],
            root=commit["root"],
            config=general,
            scope="node",
            nodes=",".join(nodes),
            return_state=True,
        )
        assert state.is_failed() and down in str(state.message) + str(state.result(raise_on_failure=False))
        assert warm.committed_steps(RUN) == [], "warm never holds an incomplete checkpoint"
        assert os.path.exists(warm.tmp_url(RUN, 4))  # the node that answered has its part staged
        w.start(down, cfgs[down])  # the worker is back
        w.wait_polling()  # the part timeout times its part, not its start-up (seconds on a busy machine)
        from ckptflow.flows.reconcile import reconcile

        out = reconcile(config=general)
        assert out["nodes"][RUN]["processed"] == [{"step": 4, "status": "done"}], out
    finally:
        w.stop_all()
    assert warm.committed_steps(RUN) == [4] and cold.committed_steps(RUN) == [4]
    ck = warm.open_checkpoint(RUN, 4)
    assert sorted(ck.index.files) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    rec_dir = layout.lifecycle_dir(warm.url_for(RUN), 4)
    assert {"verified.json", "promoted.json", "archived.json", "pruned.json"} <= set(os.listdir(rec_dir))
    assert sorted(os.listdir(os.path.join(rec_dir, layout.PARTS_DIR))) == sorted(
        [f"{n}.json" for n in cfgs] + ["manifest.json"]
    )
    v = json.loads(open(os.path.join(rec_dir, "verified.json")).read())
    assert v["sanity"]["probe_match"] == "bitwise"
    for root in roots:  # hot keeps 1 by policy, and that is the newest global commit
        assert Tier(_hot(root)).committed_steps(RUN) == [4]
    assert not os.path.exists(warm.tmp_url(RUN, 4))
    # ls from a node: which nodes committed each step, what this node holds, every part on warm
    r = subprocess.run(
        [PY, "-m", "ckptflow.cli.main", "ls", "--config", cfgs[nodes[0]], "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    rows = {x["step"]: x for x in json.loads(r.stdout)["checkpoints"]}
    assert sorted(rows[4]["nodes"]) == sorted(cfgs) and rows[4]["replicas"] == 1
    assert rows[4]["hot_part"][1] == 5 and 0 < rows[4]["hot_part"][0] < 5  # its part only: no replicas
    assert set(rows[4]["parts"].values()) == {"committed"} and "hot" in rows[4]["tiers"]


def test_a_lost_node_s_steps_finish_from_replicas(deployed, tmp_path, s3_endpoint, s3_bucket):
    """Node 1 is lost after step 4 was committed (its disk gone, its worker never back): step 4's
    lifecycle names it, its queue is served by nobody, and after the part timeout its files come from
    the replicas node 0 holds; step 4 ends whole on warm and cold. (A replaced node resuming from its
    peers' replicas is tests/integration/test_nodes.py's.)"""
    roots = _train(tmp_path, nproc=1, replicas=2, steps=4)
    (c4,) = [x for x in _commits(roots) if x["step"] == 4]
    kept, lost = _node_id(roots[0]), _node_id(roots[1])
    shutil.rmtree(roots[1])
    # the lost node's queue was never polled, so the part timeout decides it is gone; node 0's
    # part must come in within it on a loaded machine (a CI run saw more than 15 s)
    cfgs, general = _setup(tmp_path, s3_endpoint, s3_bucket, roots[:1], part_timeout=40)
    assert sorted(c4["nodes"]) == sorted([*cfgs, lost])
    w = Workers(deployed, tmp_path)
    done = {}
    try:
        for node, cfg in cfgs.items():
            w.start(node, cfg)
        w.wait_polling()
        # in this context: the session's Prefect settings (its server's URL) are a context variable
        ctx = contextvars.copy_context()
        t = threading.Thread(target=ctx.run, args=(lambda: done.setdefault("out", _lifecycle(c4, general)),))
        t.start()
        t.join(600)
    finally:
        w.stop_all()
    assert done["out"]["status"] == "done", done
    states = done["out"]["promote"]["part_states"]  # the lost node's part never left its queue
    assert states[lost] != "COMPLETED" and states[f"{kept} (take-over)"] == "COMPLETED", states
    # the lost node is not asked to prune (it would hold the lifecycle for the part timeout again)
    assert done["out"]["prune"]["nodes"] == {kept: "COMPLETED", lost: "SKIPPED"}, done["out"]["prune"]
    warm, cold = _warm_cold(tmp_path, s3_endpoint, s3_bucket)
    assert 4 in warm.committed_steps(RUN) and 4 in cold.committed_steps(RUN)
    ck = warm.open_checkpoint(RUN, 4)
    assert sorted(ck.index.files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_reconcile_does_not_wait_on_the_queue_of_a_node_that_is_gone(deployed):
    """A stopped or replaced node leaves its queue: a scan there held every reconcile for the
    scan timeout (300 s; a CI run showed +270 s). A queue nobody polled is skipped, and a
    scan no worker claims is given up and cancelled; a checkpoint's part is not sent there."""
    from prefect.client.orchestration import get_client

    from ckptflow.flows.nodes import NO_WORKER, UNCLAIMED, scan_all

    with get_client(sync_client=True) as c:
        try:
            c.create_work_queue(name="node-ghost", work_pool_name=POOL)
        except Exception:  # already there from an earlier run against the same server
            pass
    t0 = time.monotonic()
    assert scan_all(pool=POOL, unclaimed_s=5.0)["ghost"] == NO_WORKER  # (earlier tests stopped their workers)
    assert time.monotonic() - t0 < 30
    t0 = time.monotonic()
    states = scan_all(pool=POOL, polled_within_s=None, unclaimed_s=3.0)
    assert states["ghost"] == UNCLAIMED and time.monotonic() - t0 < 60, states
    with get_client(sync_client=True) as c:
        runs = c.read_flow_runs(limit=200)
    ghost = [r for r in runs if r.parameters.get("node") == "ghost" and r.parameters.get("action") == "scan"]
    assert ghost and all(r.state_type.value == "CANCELLED" for r in ghost), [r.state_type for r in ghost]
    # a promote or prune fan-out sends nothing to a queue whose worker stopped polling it
    from types import SimpleNamespace

    from ckptflow.flows.nodes import fan_out

    with get_client(sync_client=True) as c:
        c.get_scheduled_flow_runs_for_work_pool(POOL, work_queue_names=["node-ghost"])  # as a worker polls
    time.sleep(2.0)
    t0 = time.monotonic()
    ref = SimpleNamespace(run_id="ghost-run", step=1)
    assert fan_out("prune", ref, ["ghost"], timeout_s=300, polled_within_s=1.0) == {"ghost": NO_WORKER}  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 20
    with get_client(sync_client=True) as c:
        assert not [r for r in c.read_flow_runs(limit=200) if r.parameters.get("run_id") == "ghost-run"]
