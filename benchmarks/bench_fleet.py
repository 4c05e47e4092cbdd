"""The lifecycle at fleet scale: many runs committing at once, Prefect on SQLite and on PostgreSQL.

    python -m benchmarks.bench_fleet [--runs 8] [--workers 2] [--commit-every-s 60] [--minutes 4]
                                     [--backends sqlite,postgres] [--outage-s 60] [--reconcile-every 60]

For each backend: a Prefect server (SQLite in its home, or a real PostgreSQL cluster), the
deployments on a process work pool (``ckptflow deploy``), ``--workers`` general workers (each
``ckptflow worker --general``: its machine's sanity and upload limits, a flow-run limit),
moto as S3, and ``--runs`` training runs of the tiny reference model, each committing about
every ``--commit-every-s`` seconds for ``--minutes``. Then the backlog drains. With
``--outage-s``, one more PostgreSQL round kills the Prefect server that long in the middle;
the reconcile deployment (every ``--reconcile-every`` s) must catch up every commit it missed.

Measured: commits and lifecycles finished per minute, commit -> flow-run-start latency
p50/p95/p99, commit -> lifecycle done p50/p95, how long the backlog took to drain, and the
invariants — every commit ends verified or quarantined (a record on disk), none processed twice
(a stage that ran its work twice for one checkpoint: ``_lifecycle/step_N/executions.jsonl``),
none lost.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from ckptflow.harness import LOCAL_AWS, MotoServer, PostgresServer, PrefectServer, Supervisor, child_env
from ckptflow.tasks.records import read_executions

POOL = "ckptflow-pool"
STEP_SLEEP = 1.0  # long steps: 8 trainers must not eat the 2 cores the lifecycles need


def config(path: str, wd: str, s3: str, bucket: str) -> str:
    with open(path, "w") as f:
        f.write(f"""
[hot]
url = "{wd}/hot"
[hot.retention]
keep_last = 2
[warm]
url = "{wd}/warm"
codec = "zstd"
[warm.retention]
keep_last = 2
[cold]
url = "s3://{bucket}/ckpt"
codec = "zstd"
endpoint_url = "{s3}"
[cold.retention]
keep_last = 2
[lifecycle]
sanity_step = true
# The tiny model's biases start at zero and move far between checkpoints minutes apart early
# in training: the default 0.5 bound on the relative norm change would quarantine most of them.
max_norm_change = 100.0
[prefect]
flow_concurrency = 2
sanity_per_machine = 1
uploads_per_machine = 2
""")
    return path


def busy_cpu_s() -> float:
    """CPU-seconds this machine has been busy (all cores, /proc/stat: everything but idle and iowait)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def commits(hot: str) -> dict[tuple[str, int], float]:
    from ckptflow.trainer.events import read_outbox

    out = {}
    for run in sorted(os.listdir(hot)) if os.path.isdir(hot) else []:
        for rec in read_outbox(os.path.join(hot, run)):
            if isinstance(rec.get("step"), int) and isinstance(rec.get("committed_at"), (int, float)):
                out[(run, int(rec["step"]))] = float(rec["committed_at"])
    return out


def outcome(hot: str, key: tuple[str, int]) -> str | None:
    from ckptflow.trainer.format import layout

    d = os.path.join(hot, key[0], "_lifecycle", layout.step_name(key[1]))
    for rec, name in (("pruned.json", "done"), ("quarantined.json", "quarantined")):
        if os.path.exists(os.path.join(d, rec)):
            return name
    return None


def flow_runs(api: str) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    out: list[Any] = []
    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as c:
        while True:
            page = c.read_flow_runs(
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_="lifecycle-")), limit=200, offset=len(out)
            )
            out += page
            if len(page) < 200:
                return out


def trainers(
    sup: Supervisor, wd: str, n: int, steps: int, every: int, env: dict, stagger_s: float
) -> list[subprocess.Popen]:
    """``n`` runs, started ``stagger_s`` apart: independent jobs do not commit in lockstep."""
    out = []
    for i in range(n):
        if i:
            time.sleep(stagger_s)
        args = ["--parallel", "none", "--ckpt-root", f"{wd}/hot", "--run-id", f"run{i:02d}", "--model", "tiny"]
        args += ["--max-steps", str(steps), "--save-every", str(every), "--step-sleep", str(STEP_SLEEP)]
        args += ["--seed", str(1000 + i)]
        out.append(
            sup.start(
                f"train{i}",
                [sys.executable, "-m", "ckptflow.trainer.train", *args],
                env=env,
                log=open(os.path.join(wd, f"train{i}.log"), "ab"),
            )
        )
    return out


def one_round(a: argparse.Namespace, backend: str, s3: MotoServer, base: str, *, outage: bool = False) -> dict:
    name = backend + ("-outage" if outage else "")
    wd = os.path.join(base, name)
    os.makedirs(wd)
    bucket = s3.make_bucket(f"fleet-{name}")
    cfg = config(os.path.join(wd, "ckptflow.toml"), wd, s3.url, bucket)
    pg = PostgresServer(os.path.join(wd, "pg.log")) if backend == "postgres" else None
    res: dict[str, Any] = {"backend": backend, "outage_s": a.outage_s if outage else 0}
    try:
        srv = PrefectServer(
            os.path.join(wd, "prefect"), os.path.join(wd, "prefect.log"), database_url=pg.url if pg else None
        )
        with srv, Supervisor() as sup:
            env = dict(child_env({"PREFECT_API_URL": srv.url, "PREFECT_WORKER_QUERY_SECONDS": "1"}))
            env.update(LOCAL_AWS)
            os.environ["PREFECT_API_URL"] = srv.url
            from prefect.settings import PREFECT_API_URL, temporary_settings

            from ckptflow.flows.serve import deploy

            # Prefect caches its settings per process: name this round's server explicitly.
            with temporary_settings({PREFECT_API_URL: srv.url}):
                deploy(POOL, cfg, reconcile_every_s=a.reconcile_every)
            for w in range(a.workers):
                sup.start(
                    f"worker{w}",
                    [sys.executable, "-m", "ckptflow.cli.main", "worker", "--pool", POOL, "--general", "--config", cfg],
                    env=dict(env, CKPTFLOW_CONFIG=cfg, CKPTFLOW_HOST=f"machine{w}"),
                    log=open(os.path.join(wd, f"worker{w}.log"), "ab"),
                )
            time.sleep(10)  # workers register
            every = max(2, round(a.commit_every_s / STEP_SLEEP))
            steps = max(every, round(a.minutes * 60 / STEP_SLEEP))
            t0 = time.time()
            busy0, kids0 = busy_cpu_s(), children_cpu_s()
            jobs = trainers(sup, wd, a.runs, steps, every, env, a.commit_every_s / a.runs)
            down_at = up_at = None
            if outage:
                time.sleep(a.minutes * 30)
                down_at = time.time()
                srv.kill()
                time.sleep(a.outage_s)
                srv.start()
                up_at = time.time()
            for j in jobs:
                j.wait(a.minutes * 60 * 4 + 600)
            t_train = time.time()
            trainers_cpu = children_cpu_s() - kids0  # only the trainers were reaped meanwhile
            hot = os.path.join(wd, "hot")
            made = commits(hot)
            deadline = time.time() + a.drain_timeout_s
            while time.time() < deadline and any(outcome(hot, k) is None for k in made):
                time.sleep(2)
            t_drained = time.time()
            busy = busy_cpu_s() - busy0
            runs = flow_runs(srv.url)
    finally:
        if pg is not None:
            pg.stop()
    by_key: dict[tuple[str, int], list[Any]] = {}
    for r in runs:
        p = r.parameters or {}
        if "run_id" in p and "step" in p:
            by_key.setdefault((str(p["run_id"]), int(p["step"])), []).append(r)
    starts, ends, ran_twice, missing = [], [], [], []
    for k, at in made.items():
        rs = by_key.get(k, [])
        started = [r for r in rs if r.start_time is not None]
        if started:
            starts.append(min(r.start_time.timestamp() for r in started) - at)
        done = [r for r in started if r.end_time is not None and r.state_type.value == "COMPLETED"]
        if done:
            ends.append(min(r.end_time.timestamp() for r in done) - at)
        ran = [e["stage"] for e in read_executions(os.path.join(hot, k[0]), k[1])]
        if len(ran) != len(set(ran)):  # a stage that did its work twice (records.log_execution)
            ran_twice.append(k)
        if not rs:
            missing.append(k)
    outcomes = {k: outcome(hot, k) for k in made}
    minutes = (t_train - t0) / 60
    res.update(
        runs=a.runs,
        workers=a.workers,
        commit_every_s=a.commit_every_s,
        commits=len(made),
        commits_per_min=len(made) / minutes,
        lifecycles_per_min=sum(1 for v in outcomes.values() if v) / ((t_drained - t0) / 60),
        start_latency_s={"p50": pct(starts, 0.5), "p95": pct(starts, 0.95), "p99": pct(starts, 0.99)},
        end_to_end_s={"p50": pct(ends, 0.5), "p95": pct(ends, 0.95)},
        drain_s=t_drained - t_train,
        verified=sum(1 for v in outcomes.values() if v == "done"),
        quarantined=sum(1 for v in outcomes.values() if v == "quarantined"),
        lost=[f"{k[0]}@{k[1]}" for k, v in outcomes.items() if v is None],
        processed_twice=[f"{k[0]}@{k[1]}" for k in ran_twice],
        no_flow_run=len(missing),
        cpu={
            "cores": os.cpu_count(),
            "busy_s": busy,
            "trainers_s": trainers_cpu,
            "utilisation": busy / ((t_drained - t0) * (os.cpu_count() or 1)),
            # everything but the trainers (server, database, workers, flow runs, checks, S3) per lifecycle
            "per_lifecycle_s": (busy - trainers_cpu) / max(1, sum(1 for v in outcomes.values() if v)),
        },
    )
    if outage and up_at is not None and down_at is not None:
        missed = [k for k, at in made.items() if down_at <= at <= up_at]
        done_at = []
        for k in missed:
            from ckptflow.trainer.format import layout

            p = os.path.join(hot, k[0], "_lifecycle", layout.step_name(k[1]), "pruned.json")
            if os.path.exists(p):
                done_at.append(os.path.getmtime(p))
        res.update(
            missed_during_outage=len(missed),
            caught_up=len(done_at),
            catch_up_s=(max(done_at) - up_at) if done_at and len(done_at) == len(missed) else None,
            reconcile_every_s=a.reconcile_every,
        )
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--commit-every-s", type=float, default=60.0)
    p.add_argument("--minutes", type=float, default=4.0)
    p.add_argument("--backends", default="sqlite,postgres")
    p.add_argument("--outage-s", type=float, default=0.0, help="also a PostgreSQL round with the server down this long")
    p.add_argument("--reconcile-every", type=int, default=60)
    p.add_argument("--drain-timeout-s", type=float, default=900.0)
    p.add_argument("--keep", action="store_true")
    a = p.parse_args(argv)
    base = tempfile.mkdtemp(prefix="ckptflow-bench-fleet-")
    out = []
    try:
        with MotoServer(os.path.join(base, "moto.log")) as s3:
            for b in [x.strip() for x in a.backends.split(",") if x.strip()]:
                out.append(one_round(a, b, s3, base))
                print(json.dumps(out[-1]), flush=True)
            if a.outage_s:
                out.append(one_round(a, "postgres", s3, base, outage=True))
                print(json.dumps(out[-1]), flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)
        else:
            print("kept", base)
    for r in out:
        sl, e2e = r["start_latency_s"], r["end_to_end_s"]
        line = (
            f"{r['backend']:8s}{' outage' if r['outage_s'] else ''}: {r['runs']} runs x 1 commit / "
            f"{r['commit_every_s']:g} s on {r['workers']} workers: {r['commits']} commits "
            f"({r['commits_per_min']:.1f}/min), lifecycles {r['lifecycles_per_min']:.1f}/min; start latency "
            f"p50/p95/p99 {_s(sl['p50'])}/{_s(sl['p95'])}/{_s(sl['p99'])}; end to end p50/p95 "
            f"{_s(e2e['p50'])}/{_s(e2e['p95'])}; drained {r['drain_s']:.0f} s after training; verified "
            f"{r['verified']}, quarantined {r['quarantined']}, lost {len(r['lost'])}, "
            f"twice {len(r['processed_twice'])}; "
            f"CPU {r['cpu']['utilisation']:.0%} busy, trainers {r['cpu']['trainers_s']:.0f} s, "
            f"{r['cpu']['per_lifecycle_s']:.1f} CPU-s per lifecycle for the rest"
        )
        if r.get("missed_during_outage") is not None:
            line += (
                f"; outage: {r['missed_during_outage']} commits missed, {r['caught_up']} caught up, "
                f"{_s(r['catch_up_s'])} after the server was back (reconcile every {r['reconcile_every_s']} s)"
            )
        print(line)
    return 0 if all(not r["lost"] and not r["processed_twice"] for r in out) else 1


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} s"


if __name__ == "__main__":
    raise SystemExit(main())
