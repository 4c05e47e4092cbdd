"""``prefect``: the orchestrator refuses, hangs or restarts — during training and during flows.

Modes (chosen per trial from the seed):

=============  ====================================================================
train-refuse   training sends its commit events to a port nobody listens on
train-hang     ... to a server that accepts and never answers
train-restart  ... to the campaign's Prefect server, killed at the first commit and
               started again (same port, same database) while training goes on
flow-restart   the reconcile flow is running lifecycles when the server is killed and
               restarted under it
flow-flaky     the reconcile flow talks to the server through a fault proxy that
               answers 503, resets or stalls a share of API requests
flow-kill      the process running the reconcile flow is SIGKILLed in the middle of a
               lifecycle (a worker node dies); the server still shows that run RUNNING
=============  ====================================================================

Checks: the reference job (steps 1-6, a save every 2) finishes, ``save()`` never blocks
more than a couple hundred ms (an event POST that blocked would cost >= 500 ms) and
``close()`` stays within the 1 s event budget (a run over 3 s slower than the same run with
no Prefect is reported as a finding: wall time is noisy on a shared machine); after the fault, reconcile
runs until it completes (``flows.reconcile`` against the healthy server): every commit
gets its lifecycle (``archived.json``), every tier ends as retention says, nothing is
committed half; a further reconcile finds nothing to do, and no data object was
uploaded to completion twice (the cold tier is behind a counting proxy).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time

from ckptflow.chaos import checks, procs
from ckptflow.chaos.campaign import Campaign
from ckptflow.chaos.model import TrialPlan, TrialResult
from ckptflow.chaos.s3proxy import FaultProxy
from ckptflow.chaos.servers import BlackHole, free_port
from ckptflow.tasks import records, stages
from ckptflow.trainer import events
from ckptflow.trainer.format import commit, layout

MODES = ("train-refuse", "train-hang", "train-restart", "flow-restart", "flow-flaky", "flow-kill")
STEPS, EVERY, SLEEP = 6, 2, 0.2
STALL_LIMIT_MS = 250.0
"""A save that waited on the network would block >= 500 ms (the event POST's attempt timeout)."""


def plan(rng: random.Random, camp: Campaign) -> dict:
    return {"mode": rng.choice(MODES), "proxy_seed": rng.randrange(1 << 30), "delay": rng.uniform(0.5, 4.0)}


def _train_cmd(root: str, run_id: str) -> list[str]:
    return procs.train_cmd(root, run_id, nproc=1, max_steps=STEPS, save_every=EVERY, extra=["--step-sleep", str(SLEEP)])


def run(camp: Campaign, tp: TrialPlan) -> TrialResult:
    p = tp.params
    mode = p["mode"]
    res = TrialResult(tp.index, "prefect", f"prefect {mode}", p)
    srv = camp.prefect()
    base = camp.train_baseline(lambda root: _train_cmd(root, "baseline"))
    run_id = f"chaos-p{tp.index:04d}"  # own flow-run names: one trial's runs never shadow another's
    sc = camp.scratch(tp.index, "prefect", sanity=False).with_run(run_id)
    counter = FaultProxy(camp.moto.url, share=0.0).start()  # counts completed uploads
    sc.point_cold_at(counter.url)
    log = os.path.join(sc.dir, "trial.log")
    hole = BlackHole() if mode == "train-hang" else None
    try:
        api = {"train-refuse": f"http://127.0.0.1:{free_port()}/api", "train-hang": hole.url if hole else ""}.get(
            mode, srv.url
        )
        restarter: list[threading.Thread] = []

        def on_start(_proc) -> None:
            if mode == "train-restart":
                t = threading.Thread(target=_restart_at_first_commit, args=(srv, sc.run_path, res), daemon=True)
                t.start()
                restarter.append(t)

        r = procs.run(
            _train_cmd(sc.hot, run_id),
            env=dict(camp.env, PREFECT_API_URL=api),
            log_path=log,
            timeout=camp.opts.timeout_s,
            started=on_start,
        )
        for t in restarter:
            t.join(camp.opts.timeout_s)
        res.injected = 1
        _training_checks(res, r, base)
        committed = set(commit.committed_steps(sc.run_path)) | {
            int(x["step"]) for x in events.read_outbox(sc.run_path) if "step" in x
        }

        # The flows, under the fault where the mode says so.
        env = dict(camp.env, PREFECT_API_URL=srv.url)
        rcmd = procs.worker_cmd("reconcile", "--config", sc.config_path)
        if mode == "flow-flaky":
            with FaultProxy(
                srv.url.rsplit("/api", 1)[0],
                share=camp.opts.prefect_share,
                modes=("503", "reset", "stall"),
                seed=p["proxy_seed"],
                stall_s=(0.2, 2.0),
            ) as px:
                first = procs.run(
                    rcmd, env=dict(env, PREFECT_API_URL=px.url + "/api"), log_path=log, timeout=camp.opts.timeout_s
                )
                res.detail["api_proxy"] = px.stats.to_dict()
                res.injected = sum(px.stats.faults.values())
        elif mode == "flow-restart":
            killer = threading.Thread(target=_restart_after, args=(srv, p["delay"], res), daemon=True)
            first = procs.run(
                rcmd, env=env, log_path=log, timeout=camp.opts.timeout_s, started=lambda _p: killer.start()
            )
            ended = time.monotonic()
            killer.join(camp.opts.timeout_s)
            if res.detail.pop("killed_at", ended) >= ended:
                res.injected = 0  # the flow finished before the server went down: nothing was tested
                res.notes.append("reconcile finished before the server restart")
        elif mode == "flow-kill":
            first = procs.run(
                rcmd,
                env=env,
                log_path=log,
                timeout=camp.opts.timeout_s,
                started=lambda proc: threading.Thread(
                    target=_kill_mid_lifecycle, args=(proc, sc.run_path, res), daemon=True
                ).start(),
            )
            if not first.killed:
                res.injected = 0
                res.notes.append("reconcile finished before it could be killed")
        else:
            first = procs.run(rcmd, env=env, log_path=log, timeout=camp.opts.timeout_s)
        res.detail["first_reconcile_rc"] = first.rc
        if first.rc is None and mode != "flow-kill":
            res.violations.append(f"reconcile hung under {mode} (killed after {camp.opts.timeout_s:.0f} s)")

        # Recovery: reconcile against a healthy server until it has caught up.
        t0 = time.monotonic()
        second = procs.run(rcmd, env=env, log_path=log, timeout=camp.opts.timeout_s)
        res.recovery_s = time.monotonic() - t0 + (first.seconds if first.rc == 0 else 0.0)
        if second.rc != 0:
            res.violations.append(f"reconcile after the fault failed (rc={second.rc}): {second.tail()}")
            return res
        third = procs.run(rcmd, env=env, log_path=log, timeout=camp.opts.timeout_s)
        again = _result(third).get("runs", {}).get(run_id, {})
        if third.rc != 0 or again.get("processed") or again.get("unfinished"):
            res.violations.append(f"a further reconcile still had work (duplicate or unfinished): {again}")
        _state_checks(res, sc, committed, counter)
        res.recovered = not res.violations and not res.lost and not res.undetected
    finally:
        counter.stop()
        if hole is not None:
            hole.stop()
    return res


def _training_checks(res: TrialResult, r: procs.Ran, base: dict) -> None:
    if r.rc != 0:
        res.violations.append(f"training did not finish with Prefect {res.params['mode']} (rc={r.rc}): {r.tail()}")
        return
    s = r.summary() or {}
    res.detail["training"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()}
    res.detail["training_baseline"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in base.items()}
    if s.get("stall_max_ms", 1e9) > max(STALL_LIMIT_MS, 3 * base["stall_max_ms"]):
        res.violations.append(f"a save blocked training {s.get('stall_max_ms'):.0f} ms")
    if s.get("close_s", 1e9) > 1.5:
        res.violations.append(f"close() took {s.get('close_s'):.2f} s (event budget 1 s)")
    if s.get("train_s", 1e9) > base["train_s"] + 3.0:  # wall time is noisy on a shared machine: a finding
        res.findings.append(f"training took {s['train_s']:.2f} s, {base['train_s']:.2f} s without Prefect")


def _state_checks(res: TrialResult, sc, committed: set[int], counter: FaultProxy) -> None:
    for s in sorted(committed):
        st = stages.stage_records(sc.run_path, s)
        if stages.ARCHIVE.record not in st and records.QUARANTINED not in st:
            res.violations.append(
                f"lost commit: step {s} was committed but reconcile never finished its lifecycle (no archived.json)"
            )
    views = checks.tier_views(sc)
    res.undetected += checks.half_committed(views)
    keep = sorted(committed, reverse=True)[:2]
    for name, v in views.items():
        if v.good != keep:
            res.violations.append(f"{name} ends with {v.good}, retention keeps {keep}")
    res.lost += checks.lost_steps(views, set(keep))
    dup = {
        k: n
        for k, n in counter.stats.duplicate_uploads().items()
        if k.rsplit("/", 1)[-1] not in (layout.MANIFEST, layout.TIER_MANIFEST, layout.COMMIT_MARKER)
        and f"/{layout.LEASES_DIR}/" not in k
    }
    if dup:
        res.violations.append(f"lifecycle work done twice: data objects uploaded more than once: {dup}")


def _kill_mid_lifecycle(proc, run_path: str, res: TrialResult) -> None:
    """SIGKILL the flow process once a lifecycle is under way (its verify record exists)."""
    import signal

    rec = records.record_path(run_path, 2 * EVERY, stages.VERIFY.record)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None and not os.path.exists(rec):
        time.sleep(0.02)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _restart_at_first_commit(srv, run_path: str, res: TrialResult) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not events.read_outbox(run_path):
        time.sleep(0.05)
    res.detail["server_down_s"] = round(srv.restart(), 1)


def _restart_after(srv, delay: float, res: TrialResult) -> None:
    time.sleep(delay + 4.0)  # the flow process needs ~4 s to import and start its first lifecycle
    res.detail["killed_at"] = time.monotonic()
    res.detail["server_down_s"] = round(srv.restart(), 1)


def _result(r: procs.Ran) -> dict:
    for line in reversed(r.output.splitlines()):
        if line.startswith("chaos-worker-result "):
            try:
                return json.loads(line[len("chaos-worker-result ") :])
            except json.JSONDecodeError:
                return {}
    return {}
