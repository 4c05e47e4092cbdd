"""``ckptflow demo --nodes 2``: the many-node story on one machine.

1. a Prefect server and an S3-compatible server start; the deployments go to a process work
   pool (``ckptflow deploy``); a general worker (the lifecycle, reconcile, drill) and one
   worker per node, each on its node's queue with its node's config (``ckptflow worker``);
2. two torchrun agents act as two nodes (c10d rendezvous on 127.0.0.1), each with its own
   folder as its local NVMe; every checkpoint commits in two levels with a replica of each
   node's shards on the other node;
3. after ``kill_at`` node 1 is killed (agent, workers and its lifecycle worker) and replaced:
   its disk is emptied, a new worker starts for the new node, both agents restart, and the
   run resumes exactly, node 1 fetching its part from node 0's replica;
4. every commit's lifecycle runs per node: each node stages its part on warm (the lost node's
   parts come from replicas after ``node_part_timeout_s``), warm commits the whole, verify
   runs once on it, archive to S3, prune per node and tier;
5. a restore drill from cold;
6. the way back: both nodes' disks wiped and warm offline, the same job started again brings step N
   back from cold, each node the files its rank reads, and trains on bitwise as the run before;
7. the summary.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from ckptflow.demo import services
from ckptflow.demo.runner import (
    BUCKET,
    RUN_ID,
    WAY_BACK_STEPS,
    DemoOutcome,
    DemoSettings,
    _checkpoint_rows,
    _wait_lifecycles,
    lifecycle_names,
    lifecycle_problems,
)
from ckptflow.demo.wayback import Job
from ckptflow.harness import NodeAgents, Supervisor

POOL = "ckptflow-pool"


def _config(path: str, *, hot: str, wd: str, s3: str) -> str:
    with open(path, "w") as f:
        f.write(f"""# Written by `ckptflow demo --nodes`.
[hot]
url = "{hot}"
[hot.retention]
keep_last = 2
[warm]
url = "{wd}/warm"
codec = "bytegroup"
[warm.retention]
keep_last = 4
[cold]
url = "s3://{BUCKET}/ckptflow"
codec = "bytegroup"
endpoint_url = "{s3}"
[cold.retention]
keep_last = 10
[lifecycle]
node_part_timeout_s = 45
[export]
when = "every"
""")
    return path


def _node_id(root: str) -> str:
    from ckptflow.trainer.nodes.topology import node_id

    return node_id(root)


def _commits(roots: list[str]) -> list[dict[str, Any]]:
    from ckptflow.trainer.events import read_outbox

    return sorted((x for r in roots for x in read_outbox(os.path.join(r, RUN_ID))), key=lambda x: x["step"])


def run_node_demo(s: DemoSettings, nodes: int = 2, say: Callable[[str], None] = print) -> DemoOutcome:
    t0 = time.monotonic()
    wd = os.path.abspath(s.workdir)
    shutil.rmtree(wd, ignore_errors=True)
    logs = os.path.join(wd, "logs")
    os.makedirs(logs)
    general = os.path.join(wd, "ckptflow.toml")
    out = DemoOutcome(workdir=wd, config=general)
    roots = [os.path.join(wd, f"node{i}") for i in range(nodes)]
    with ExitStack() as stack:
        say("starting a Prefect server (SQLite) and an S3-compatible server on 127.0.0.1 ...")
        api, s3_url = services.start_services(stack, wd, logs, BUCKET)
        os.environ.update(
            PREFECT_API_URL=api,
            PREFECT_HOME=os.path.join(wd, "prefect"),
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            PREFECT_LOGGING_LEVEL=os.environ.get("PREFECT_LOGGING_LEVEL", "WARNING"),
        )
        _config(general, hot=os.path.join(wd, "general-hot"), wd=wd, s3=s3_url)
        node_cfg = [_config(os.path.join(wd, f"node{i}.toml"), hot=r, wd=wd, s3=s3_url) for i, r in enumerate(roots)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PREFECT_LOGGING_LEVEL="INFO", PREFECT_WORKER_QUERY_SECONDS="2")
        # The deployments and workers exactly as the README has a user start them.
        cli = [sys.executable, "-m", "ckptflow.cli.main"]
        with open(os.path.join(logs, "deploy.log"), "ab") as log:
            subprocess.run(
                [*cli, "deploy", "--pool", POOL, "--config", general], env=env, stdout=log, stderr=log, check=True
            )
        sup = stack.enter_context(Supervisor())

        def worker(cfg: str, name: str, *flags: str) -> Any:
            return sup.start(
                name,
                [*cli, "worker", "--pool", POOL, "--config", cfg, *flags],
                env=env,
                log=open(os.path.join(logs, f"{name}.log"), "ab"),
            )

        worker(general, "worker-general", "--general")
        node_workers = [worker(c, f"worker-node{i}") for i, c in enumerate(node_cfg)]
        ids = [_node_id(r) for r in roots]
        say(
            f"deployed to work pool {POOL}; workers: general (queue default), "
            + ", ".join(f"node {i} (queue node-{n})" for i, n in enumerate(ids))
        )
        args = [
            "--run-id",
            RUN_ID,
            "--model",
            s.model,
            "--max-steps",
            str(s.steps),
            "--save-every",
            str(s.save_every),
            "--step-sleep",
            "0.1",
        ]
        agents = stack.enter_context(NodeAgents(roots, args, env=dict(env, PREFECT_API_URL=api), log_dir=logs))
        say(
            f"training: {nodes} nodes x 1 rank (torchrun agents, c10d rendezvous), node-local hot folders, "
            f"model {s.model}, {s.steps} steps, a checkpoint every {s.save_every} (2 replicas)"
        )
        agents.start()
        if s.kill_at:
            _wait_step(roots, s.kill_at, 300)
            say(
                f"  node 1 lost after step {s.kill_at}: its agent, its worker and its lifecycle worker "
                "are killed, and its disk is emptied"
            )
            agents.kill(1)
            sup.stop(node_workers[1])
            agents.wait(60)  # node 0's ranks end too: their peer is gone
            shutil.rmtree(roots[1])
            os.makedirs(roots[1])
            node_workers[1] = worker(node_cfg[1], "worker-node1-new")
            ids.append(_node_id(roots[1]))
            say(f"  node 1 replaced: new node id {ids[-1]}, a new worker on queue node-{ids[-1]}; both agents restart")
            agents.args = args
            agents.start()
        rcs = agents.wait(max(60.0, s.timeout_s))
        if any(rc != 0 for rc in rcs):
            out.problems.append(f"training failed on some node ({rcs}); logs in {logs}")
            return out
        resumed = [ln for i in range(nodes) for ln in agents.output(i).splitlines() if "resumed from step" in ln]
        out.resumed = [ln.split(": ", 1)[-1] for ln in resumed]
        for ln in out.resumed:
            say("  " + ln)
        commits = _commits(roots)
        steps = sorted({c["step"] for c in commits})
        say(f"waiting for the lifecycle of {len(steps)} checkpoints {steps} (each node's part on its own worker) ...")
        left = max(120.0, s.timeout_s - (time.monotonic() - t0))
        out.lifecycle_states = _wait_lifecycles(set(lifecycle_names(RUN_ID, steps)), left, say)
        from ckptflow.trainer.format import layout

        out.checkpoints = _checkpoint_rows(
            general, layout.run_dir(os.path.join(wd, "warm"), RUN_ID), steps, hot_roots=roots
        )
        say("restore drill: newest cold checkpoint -> scratch -> sanity step at world size 1 ...")
        from ckptflow.flows.drill import DrillFailed, restore_drill

        try:
            res = restore_drill(
                run_id=RUN_ID, config=general, random_older=False, history_dir=os.path.join(wd, "drills")
            )
            out.drill = {"ok": True, **res["runs"][RUN_ID]}
        except DrillFailed as e:
            out.drill = {"ok": False, "error": str(e)}
            out.problems.append(str(e))
        if steps and not lifecycle_problems(lifecycle_names(RUN_ID, steps), out.lifecycle_states):
            from ckptflow.demo.wayback import way_back

            # only once every lifecycle is over: none may still write to warm
            out.way_back = way_back(
                runs=[os.path.join(r, RUN_ID) for r in roots],
                wipe=roots,
                warm=os.path.join(wd, "warm"),
                run_id=RUN_ID,
                last=max(steps),
                more=WAY_BACK_STEPS,
                job=_agents_job(roots, node_cfg, ["--run-id", RUN_ID, "--model", s.model], logs),
                env=dict(env, CKPTFLOW_CONFIG=node_cfg[0]),
                say=say,
            )
            if not out.way_back.ok:
                out.problems.append(f"the way back: {out.way_back.problem}")
    out.problems += lifecycle_problems(
        lifecycle_names(RUN_ID, [c["step"] for c in out.checkpoints]), out.lifecycle_states
    )
    out.seconds = time.monotonic() - t0
    out.ok = not out.problems
    with open(os.path.join(wd, "summary.json"), "w") as f:
        json.dump(
            {
                "ok": out.ok,
                "problems": out.problems,
                "checkpoints": out.checkpoints,
                "nodes": ids,
                "resumed": out.resumed,
                "lifecycle_states": out.lifecycle_states,
                "drill": out.drill,
                "way_back": dataclasses.asdict(out.way_back) if out.way_back is not None else None,
                "seconds": out.seconds,
            },
            f,
            indent=1,
            default=str,
        )
    return out


def _agents_job(roots: list[str], configs: list[str], args: list[str], logs: str) -> Job:
    """The way back's job on node-local roots: both agents, each node with its own config (its root, the tiers)
    when the environment names one, a checkpoint at the last step only."""

    def job(steps: int, extra: list[str], env: dict, log_name: str) -> tuple[int, str]:
        log_dir = os.path.join(logs, log_name.removesuffix(".log"))
        os.makedirs(log_dir, exist_ok=True)
        run_args = [*args, "--max-steps", str(steps), "--save-every", str(steps), *extra]
        with NodeAgents(roots, run_args, env=env, log_dir=log_dir) as agents:
            for i, cfg in enumerate(configs):
                agents.start(i, env={"CKPTFLOW_CONFIG": cfg} if "CKPTFLOW_CONFIG" in env else None)
            rcs = agents.wait(600)
            text = "\n".join(agents.output(i) for i in range(len(roots)))
        return (0 if all(rc == 0 for rc in rcs) else 1), text

    return job


def _wait_step(roots: list[str], step: int, timeout: float) -> None:
    from ckptflow.trainer.reference.metrics import read_metrics

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if max((r["step"] for root in roots for r in read_metrics(os.path.join(root, RUN_ID))), default=0) >= step:
            return
        time.sleep(0.1)
