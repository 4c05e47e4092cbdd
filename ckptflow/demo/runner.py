"""``ckptflow demo`` end to end, as one function that returns what happened.

1. a Prefect server (SQLite under the demo folder) and an S3-compatible server start;
2. ``flows.serve`` serves the deployments (lifecycle on the commit event, drill, reconcile);
3. a 2-rank torchrun job trains with checkpoints; one worker is SIGKILLed mid-run and
   torchrun restarts it; the run resumes from the newest committed checkpoint;
4. every commit's lifecycle runs (verify -> compress -> promote -> export -> archive -> prune);
5. a checkpoint another tool wrote (a plain ``dcp.save`` folder) is adopted with
   ``ckptflow adopt``, and its commit event starts the same deployed lifecycle;
6. a restore drill restores the newest cold checkpoint at another world size;
7. the summary says what is where, how big, verified or not, and the recovery time.
Everything started is stopped on the way out, Ctrl-C included.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from ckptflow.demo import services
from ckptflow.demo.training import run_training
from ckptflow.harness import Supervisor, wait_deployments
from ckptflow.trainer.format import layout

if TYPE_CHECKING:
    from prefect.client.schemas.objects import StateType

RUN_ID = "demo"
OTHER_RUN = "other-tool"
"""The run the adopted checkpoint joins: one written by plain ``dcp.save``, as another tool would."""
OTHER_STEP = 100
BUCKET = "ckptflow-demo"
WAY_BACK_STEPS = 4
"""Steps the job trains after it comes back from cold, compared with the run before."""

OTHER_TOOL = """
import sys, torch, torch.distributed.checkpoint as dcp
g = torch.Generator().manual_seed(0)
state = {"model": {"w": torch.randn(512, 512, generator=g)}, "step": torch.tensor(100)}
dcp.save(state, checkpoint_id=sys.argv[1], no_dist=True)
"""


@dataclass
class DemoSettings:
    workdir: str
    steps: int = 120
    save_every: int = 20
    model: str = "mini"
    kill_at: int | None = 50
    timeout_s: float = 600.0


@dataclass
class DemoOutcome:
    workdir: str
    config: str
    training: Any = None
    checkpoints: list[dict] = field(default_factory=list)
    lifecycle_states: dict[str, str] = field(default_factory=dict)
    drill: dict | None = None
    adopted: dict | None = None
    """The checkpoint another tool wrote: what ``ckptflow adopt`` committed and where its lifecycle took it."""
    replay_identical: tuple[int, int] = (0, 0)
    resumed: list[str] = field(default_factory=list)
    """The node demo: how each node resumed (from which step, what it fetched from which peer)."""
    way_back: Any = None
    """The hot tier lost, the job back from cold (``demo/wayback.py``)."""
    seconds: float = 0.0
    ok: bool = False
    problems: list[str] = field(default_factory=list)


def _lifecycle_states() -> dict[str, str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as c:
        runs = c.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_="lifecycle-")), limit=200)
    # a deployment's flow runs are created Scheduled, so each one the server lists has a state
    return {r.name: cast("StateType", r.state_type).value for r in runs}


RECONCILE_AFTER_S = 45.0
"""How long the demo waits for a step's lifecycle run to appear before it asks reconcile for it."""


def _wait_lifecycles(want: set[str], timeout: float, say: Callable[[str], None]) -> dict[str, str]:
    """The lifecycle runs' states once every one named in ``want`` has finished (or at ``timeout``).
    Events are lossy — one emitted while the server was still loading its automations starts
    nothing — so a step that has no run ``RECONCILE_AFTER_S`` in is left to reconcile, started
    once, as the deployment's schedule would (the demo's schedule is an hour)."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    last = None
    reconciled = False
    while time.monotonic() < deadline:
        st = _lifecycle_states()
        done = {n for n in want if st.get(n) in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")}
        if len(done) != last:
            say(f"  lifecycles finished: {len(done)}/{len(want)}")
            last = len(done)
        if done == want:
            return st
        missing = sorted(want - st.keys())
        if missing and not reconciled and time.monotonic() - t0 > RECONCILE_AFTER_S:
            from prefect.deployments import run_deployment

            say(f"  no lifecycle run for {missing} after {RECONCILE_AFTER_S:.0f} s (its event was lost); reconcile")
            run_deployment("ckptflow-reconcile/reconcile", timeout=0)
            reconciled = True
        time.sleep(2)
    return _lifecycle_states()


def lifecycle_names(run_id: str, steps: list[int]) -> list[str]:
    return [f"lifecycle-{run_id}-step{s}" for s in steps]


def lifecycle_problems(names: list[str], states: dict[str, str]) -> list[str]:
    """What is wrong with the lifecycles ``names``: runs that did not complete, steps with none."""
    out = []
    bad = [n for n, st in states.items() if st != "COMPLETED"]
    if bad:
        out.append(f"lifecycle runs not completed: {bad}")
    missing = [n for n in names if n not in states]
    if missing:
        out.append(f"no lifecycle run at all: {missing}")
    return out


def _checkpoint_rows(
    cfg_path: str, run_path: str, steps: list[int], run_id: str = RUN_ID, hot_roots: list[str] | None = None
) -> list[dict]:
    """One row per step: its tiers, sizes, verification and stages. ``hot_roots``: the nodes' own hot roots
    (node-local runs), whose checkpoints the config's hot tier does not hold; ``hot`` then means "on some node's
    hot root" and ``hot_nodes`` says on how many."""
    from ckptflow.tasks.config import TierConfig, load_config
    from ckptflow.tasks.stages import RECORDS, VERIFY, stage_records
    from ckptflow.tasks.storage import Tier

    cfg = load_config(cfg_path)
    tiers = {t.name: Tier(t) for t in cfg.tiers()}
    nodes = [Tier(TierConfig(name="hot", url=r)) for r in hot_roots or []]
    rows = []
    for s in steps:
        row: dict[str, Any] = {"step": s, "tiers": [], "raw": None, "stored": {}}
        if nodes:
            row["hot_nodes"] = sum(t.is_committed(run_id, s) for t in nodes)
        for name, t in tiers.items():
            if nodes and name == "hot":
                if row["hot_nodes"]:
                    row["tiers"].append(name)
                continue
            if t.is_committed(run_id, s):
                row["tiers"].append(name)
                idx = t.read_index(run_id, s) if name != "hot" else None
                row["raw"] = row["raw"] or t.read_manifest(run_id, s).total_bytes
                if idx is not None:
                    row["stored"][name] = idx.total_stored_bytes
        st = stage_records(run_path, s)
        v = st.get(VERIFY.record)
        row["verified"] = bool(v)
        row["probe"] = (v or {}).get("sanity", {}).get("probe_match")
        row["check"] = (v or {}).get("sanity", {}).get("check", "probe")
        row["expectations"] = ((v or {}).get("expectations") or {}).get("success")
        row["quarantined"] = (st.get("quarantined") or {}).get("reasons")
        row["stages"] = [k for k in RECORDS if k in st]
        ex = st.get("exported") or {}
        row["export"] = (
            {k: ex.get(k) for k in ("location", "cold", "dtype", "tensors", "bytes", "shards")} if ex else None
        )
        rows.append(row)
    return rows


def _replays(run_path: str) -> tuple[int, int]:
    """(identical, total) losses of steps trained twice (before the kill and after the resume)."""
    from ckptflow.tasks.report import read_metrics

    seen: dict[int, float] = {}
    same = total = 0
    for r in read_metrics(run_path):
        if r["step"] in seen:
            total += 1
            same += seen[r["step"]] == r["loss"]
        seen[r["step"]] = r["loss"]
    return same, total


def run_demo(s: DemoSettings, say: Callable[[str], None] = print) -> DemoOutcome:
    t0 = time.monotonic()
    wd = os.path.abspath(s.workdir)
    shutil.rmtree(wd, ignore_errors=True)
    logs = os.path.join(wd, "logs")
    os.makedirs(logs)
    out = DemoOutcome(workdir=wd, config=os.path.join(wd, "ckptflow.toml"))
    with ExitStack() as stack:
        say("starting a Prefect server (SQLite) and an S3-compatible server on 127.0.0.1 ...")
        api, s3_url = services.start_services(stack, wd, logs, BUCKET)
        services.demo_config(out.config, workdir=wd, s3_endpoint=s3_url, bucket=BUCKET)
        sup = stack.enter_context(Supervisor())
        # From here on this process is a Prefect client of the demo server.
        os.environ.update(
            PREFECT_API_URL=api,
            PREFECT_HOME=os.path.join(wd, "prefect"),
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            CKPTFLOW_CONFIG=out.config,
            PREFECT_LOGGING_LEVEL=os.environ.get("PREFECT_LOGGING_LEVEL", "WARNING"),
        )
        env = dict(os.environ, OMP_NUM_THREADS="1", PREFECT_LOGGING_LEVEL="INFO")  # full logs in logs/
        say(f"  Prefect API {api}; S3 {s3_url} (bucket {BUCKET}); config {out.config}")
        sup.start(
            "serve",
            [sys.executable, "-m", "ckptflow.flows.serve", "--config", out.config, "--reconcile-every", "3600"],
            env=env,
            log=open(os.path.join(logs, "serve.log"), "w"),
        )
        wait_deployments(["ckptflow-lifecycle/lifecycle"], 90)
        say("serving deployments: lifecycle (on ckptflow.checkpoint.committed), reconcile, restore-drill")
        say(
            f"training: torchrun 2 ranks (gloo, FSDP2), model {s.model}, {s.steps} steps, checkpoint every "
            f"{s.save_every}" + (f", SIGKILL of one worker after step {s.kill_at}" if s.kill_at else "")
        )
        out.training = run_training(
            sup,
            root=os.path.join(wd, "hot"),
            run_id=RUN_ID,
            steps=s.steps,
            save_every=s.save_every,
            model=s.model,
            kill_at=s.kill_at,
            env=env,
            log_dir=logs,
            say=say,
        )
        if out.training.returncode != 0:
            out.problems.append(f"training failed (exit {out.training.returncode}); log: {out.training.log_path}")
            return out
        if out.training.resumed_from is not None:
            say(f"  torchrun restarted the workers; the run resumed from step {out.training.resumed_from}")
        run_path = os.path.join(wd, "hot", RUN_ID)
        out.replay_identical = _replays(run_path)
        from ckptflow.trainer.events import read_outbox

        steps = sorted({int(x["step"]) for x in read_outbox(run_path)})
        adopted = _adopt_other_tool(wd, env, logs, say)
        want = lifecycle_names(RUN_ID, steps) + lifecycle_names(OTHER_RUN, [OTHER_STEP] if adopted else [])
        say(f"waiting for the lifecycle of {len(want)} checkpoints ...")
        left = max(60.0, s.timeout_s - (time.monotonic() - t0))
        out.lifecycle_states = _wait_lifecycles(set(want), left, say)
        out.checkpoints = _checkpoint_rows(out.config, run_path, steps)
        if adopted:
            other = os.path.join(wd, "hot", OTHER_RUN)
            out.adopted = {**adopted, **_checkpoint_rows(out.config, other, [OTHER_STEP], OTHER_RUN)[0]}
        else:
            out.problems.append("the other tool's checkpoint was not adopted; log: logs/adopt.log")
        say("restore drill: newest cold checkpoint -> scratch -> sanity step at world size 1 ...")
        from ckptflow.flows.drill import DrillFailed, restore_drill

        try:
            res = restore_drill(
                run_id=RUN_ID, config=out.config, random_older=False, history_dir=os.path.join(wd, "drills")
            )
            out.drill = {"ok": True, **res["runs"][RUN_ID]}
        except DrillFailed as e:
            out.drill = {"ok": False, "error": str(e)}
            out.problems.append(str(e))
        pending = lifecycle_problems(lifecycle_names(RUN_ID, steps), out.lifecycle_states)
        if steps and not pending:  # only once every lifecycle is over: none may still write to warm
            from ckptflow.demo.wayback import torchrun_job, way_back

            run = os.path.join(wd, "hot", RUN_ID)
            out.way_back = way_back(
                runs=[run],
                wipe=[run],
                warm=os.path.join(wd, "warm"),
                run_id=RUN_ID,
                last=max(steps),
                more=WAY_BACK_STEPS,
                job=torchrun_job(os.path.join(wd, "hot"), RUN_ID, s.model, logs),
                env=env,
                say=say,
            )
            if not out.way_back.ok:
                out.problems.append(f"the way back: {out.way_back.problem}")
    names = lifecycle_names(RUN_ID, [c["step"] for c in out.checkpoints])
    out.problems += lifecycle_problems(names + lifecycle_names(OTHER_RUN, [OTHER_STEP]), out.lifecycle_states)
    out.seconds = time.monotonic() - t0
    out.ok = not out.problems
    with open(os.path.join(wd, "summary.json"), "w") as f:
        json.dump(
            {
                "ok": out.ok,
                "problems": out.problems,
                "checkpoints": out.checkpoints,
                "lifecycle_states": out.lifecycle_states,
                "drill": out.drill,
                "adopted": out.adopted,
                "replay_identical": list(out.replay_identical),
                "seconds": out.seconds,
                "resumed_from": out.training.resumed_from if out.training else None,
                "killed_at_step": out.training.killed_at_step if out.training else None,
                "way_back": dataclasses.asdict(out.way_back) if out.way_back is not None else None,
            },
            f,
            indent=1,
            default=str,
        )
    return out


def _adopt_other_tool(wd: str, env: dict[str, str], logs: str, say: Callable[[str], None]) -> dict | None:
    """A checkpoint another tool wrote (plain ``dcp.save``), adopted as a user would, in processes
    of their own: ``ckptflow adopt`` commits it and posts the event the served lifecycle starts on.
    The committed record, or None when a step failed (its output in ``logs/adopt.log``)."""
    import subprocess

    src = os.path.join(wd, OTHER_RUN, f"step-{OTHER_STEP}")
    say(f"adopting a checkpoint another tool wrote (dcp.save): ckptflow adopt {src} --run-id {OTHER_RUN}")
    with open(os.path.join(logs, "adopt.log"), "w") as log:
        for cmd in (
            [sys.executable, "-c", OTHER_TOOL, src],
            [sys.executable, "-m", "ckptflow.cli.main", "adopt", src, "--run-id", OTHER_RUN, "--json"],
        ):
            r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True, timeout=300)
            log.write(r.stdout)
            if r.returncode != 0:
                return None
    return {"run_id": OTHER_RUN, "record": json.loads(r.stdout)}


def step_label(step: int) -> str:
    return layout.step_name(step)
