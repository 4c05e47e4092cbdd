"""``net``: two nodes on a real network and a fault on node 1's link (root only).

Each trial runs the reference job on two torchrun agents, each in a network namespace of its own joined by a
bridge (``ckptflow.harness.NetNodes``: rendezvous, gloo and the replica transfers on those addresses), 12 steps
with a save every 4 on node-local roots, every shard replicated to the other node. One fault per trial:

* ``cut@<phase>``: both nodes held at ``replicate``, ``after_part`` or ``decided`` of step 8's two-level commit,
  then node 1's link taken down (before the decision nothing commits; after it every node does);
* ``cut@train``: node 1's link taken down at a random moment after step 4 committed, nothing held;
* ``flap``: node 1's link down and up again two to four times from the start of step 8's replication;
* ``throttle``: node 1's link at a few mbit (``tc tbf``) for the whole run; every save must still commit;
* ``delay`` / ``loss``: node 1's frames held 5-50 ms each way, or 1-10 % of them dropped, by the userspace relay
  node 1 reaches the bridge through (``ckptflow.netrelay``: the kernel has no ``netem``), from the start of step 8's
  replication to the end of the run; every save must still commit.

Checked: node 0 ends within its timeouts after the fault (``--timeout-s`` + ``--ckpt-timeout-s`` + a margin), never
hangs; a commit that fails before the decision names the node and the phase; every 0.1 s, each node's ``latest``
names a step every node holds, committed or prepared; after the link is back and node 1 replaced by a restart, both
nodes resume from the newest step any node committed and train to losses bitwise equal to a clean run's (made once
per campaign on the same network). The lifecycle (``chaos.nodelife``) takes every globally committed step to cold:
while node 1 is still cut off, from node 0's part and the replicas it holds of node 1's files; after the heal, the
rest from both nodes. Warm and cold are then read back (every byte checked, verified), and cold must hold every
globally committed step. The trial's namespaces are gone when it ends.
"""

from __future__ import annotations

import os
import random
import subprocess
import threading
import time

from ckptflow.chaos import checks
from ckptflow.chaos.campaign import Campaign
from ckptflow.chaos.model import TrialPlan, TrialResult
from ckptflow.chaos.nodelife import NodeLifecycle
from ckptflow.harness import NetNodes, NodeAgents, namespaces
from ckptflow.trainer import faults
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.commit import committed_steps, read_latest
from ckptflow.trainer.reference.metrics import read_metrics

RUN = "net"
STEPS, EVERY, HELD_STEP = 12, 4, 8
TIMEOUT_S, CKPT_TIMEOUT_S = 20.0, 10.0
"""The job's collective timeouts in a trial: training's, and the checkpoint group's."""
MARGIN_S = 15.0
"""What node 0 may take past both timeouts to exit (its agent tearing the workers down)."""
PHASES = {"replicate": "phase 4-5, replication", "after_part": "phase 6-7, the decision", "decided": None}
"""Where a held cut happens, and what node 0's error must name (after the decision: the commit succeeded)."""
FAULTS = ("cut", "cut", "cut", "cut@train", "flap", "throttle", "delay", "loss")
IMPAIRED = ("throttle", "delay", "loss")
"""Faults every save must survive: node 0 finishes the run."""


def plan(rng: random.Random, camp: Campaign | None) -> dict:
    fault = rng.choice(FAULTS)
    if fault == "cut":
        return {"fault": "cut", "phase": rng.choice(list(PHASES))}
    if fault == "cut@train":
        return {"fault": "cut@train", "after_s": round(rng.uniform(0.0, 2.0), 2)}
    if fault == "flap":
        k = rng.randint(2, 4)
        return {
            "fault": "flap",
            "times": k,
            "down_s": [round(rng.uniform(0.2, 3.0), 2) for _ in range(k)],
            "up_s": [round(rng.uniform(0.2, 1.0), 2) for _ in range(k)],
        }
    if fault == "delay":
        return {"fault": "delay", "ms": rng.choice([5, 20, 50])}
    if fault == "loss":
        return {"fault": "loss", "pct": rng.choice([1, 5, 10])}
    return {"fault": "throttle", "rate": rng.choice(["5mbit", "20mbit", "50mbit"])}


def _args(*extra: str) -> list[str]:
    return ["--run-id", RUN, "--model", "tiny", "--max-steps", str(STEPS), "--save-every", str(EVERY), *extra]


def _held(root: str, step: int) -> bool:
    """Whether the node holds ``step`` committed, or prepared (``.tmp`` with its manifest: rolled forward)."""
    run = os.path.join(root, RUN)
    # prepared first: a rename between the two looks finds one of them
    return os.path.exists(os.path.join(run, layout.tmp_name(step), layout.MANIFEST)) or step in committed_steps(run)


def _curve(roots: list[str]) -> dict[int, float]:
    """The loss per step, the last time it was trained, from whichever node held rank 0."""
    rows = sorted((r for root in roots for r in read_metrics(os.path.join(root, RUN))), key=lambda r: r["wall"])
    return {r["step"]: r["loss"] for r in rows}


class _Watch:
    """Samples every node's ``latest`` every 0.1 s: each must name a step every node holds."""

    def __init__(self, roots: list[str]) -> None:
        self.roots = roots
        self.broken: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="net-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            for root in self.roots:
                try:
                    s = read_latest(os.path.join(root, RUN))
                except (OSError, ValueError):
                    continue  # not there yet
                lacking = [r for r in self.roots if s is not None and not _held(r, s)]
                if lacking and len(self.broken) < 5:
                    self.broken.append(f"{root}'s latest names step {s}, which {lacking} does not hold")

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join()
        return self.broken


def _baseline(camp: Campaign, net: NetNodes) -> dict[int, float]:
    """The clean run's losses, made once per campaign on the first trial's network."""
    got = camp.cache.get("net_baseline")
    if got is None:
        roots = [os.path.join(camp.workdir, "net-baseline", f"node{i}") for i in range(2)]
        with NodeAgents(roots, _args(), log_dir=camp.log("net-baseline"), net=net) as nodes:
            nodes.start()
            rcs = nodes.wait(camp.opts.timeout_s)
            if rcs != [0, 0]:
                raise RuntimeError(f"the clean run on the network failed ({rcs}): {nodes.output(0)[-2000:]}")
        got = camp.cache["net_baseline"] = _curve(roots)
    return got


def run(camp: Campaign, tp: TrialPlan) -> TrialResult:
    if os.geteuid() != 0:
        raise RuntimeError("the net kind needs root (network namespaces)")
    p = tp.params
    label = {
        "cut": f"link cut at {p.get('phase')}@{HELD_STEP}",
        "cut@train": "link cut while training",
        "flap": f"link flapping {p.get('times')}x",
        "throttle": f"link at {p.get('rate')}",
        "delay": f"link delayed {p.get('ms')} ms each way",
        "loss": f"link losing {p.get('pct')}% of frames",
    }[p["fault"]]
    res = TrialResult(tp.index, "net", label, p)
    tdir = camp.trial_dir(tp.index, "net")
    roots = [os.path.join(tdir, f"node{i}") for i in range(2)]
    with NetNodes(2, relay=(1,)) as net:  # node 1 through a relay: delay and loss, when the fault asks
        mine = [n for n in namespaces() if n.startswith(net.name)]
        baseline = _baseline(camp, net)
        watch = _Watch(roots)
        try:
            life = NodeLifecycle(camp.scratch(tp.index, "net", sanity=False).with_run(RUN), roots)
            _trial(camp, p, net, roots, tdir, res, baseline, life)
            _to_cold(life, roots, res)
            res.recovered = res.recovered and not (res.violations or res.lost)
        finally:
            res.undetected += watch.stop()
    left = [n for n in namespaces() if n in mine]
    if left:
        res.violations.append(f"namespaces left after the trial: {left}")
    return res


def _committed(roots: list[str]) -> list[int]:
    """The steps any node committed (globally committed: no node renames before every node prepared)."""
    return sorted({s for r in roots for s in committed_steps(os.path.join(r, RUN))})


def _to_cold(life: NodeLifecycle, roots: list[str], res: TrialResult) -> None:
    """Every globally committed step to cold, every node reachable; then warm and cold checked: each committed
    checkpoint fetched with every byte checked and verified, and cold holding every globally committed step."""
    steps = _committed(roots)
    for step, why in life.run(steps, life.nodes).items():
        res.lost.append(f"step {step} was committed but did not reach cold: {why}")
    sc = life.scratch
    views = checks.tier_views(sc, [sc.tier("warm"), sc.tier("cold")])
    res.violations += checks.half_committed(views)
    missing = sorted(set(steps) - set(views["cold"].good))
    if missing:
        res.lost.append(f"committed steps {missing} are not on cold in a form that verifies")
    res.detail["cold"] = views["cold"].good


def _trial(
    camp: Campaign,
    p: dict,
    net: NetNodes,
    roots: list[str],
    tdir: str,
    res: TrialResult,
    baseline: dict,
    life: NodeLifecycle,
) -> None:
    timeouts = ["--timeout-s", str(TIMEOUT_S), "--ckpt-timeout-s", str(CKPT_TIMEOUT_S)]
    marks = os.path.join(tdir, "marks")
    os.makedirs(marks, exist_ok=True)
    env: dict[str, str] = {}
    if p["fault"] == "cut":
        env = {faults.ENV: f"{p['phase']}@{HELD_STEP}:sleep3", faults.MARKS: marks}
    elif p["fault"] in ("flap", "delay", "loss"):
        env = {faults.ENV: f"replicate@{HELD_STEP}:sleep1", faults.MARKS: marks}
    with NodeAgents(roots, _args("--step-sleep", "0.2", *timeouts), log_dir=os.path.join(tdir, "logs"), net=net) as n:
        if p["fault"] == "throttle":
            net.throttle(1, p["rate"])
        n.start(env=env)
        deadline = time.monotonic() + camp.opts.timeout_s
        alive = lambda: all(x is not None and x.poll() is None for x in n.procs)  # noqa: E731
        if env:  # both nodes held at the phase
            while len(os.listdir(marks)) < 2 and alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if len(os.listdir(marks)) < 2:
                raise RuntimeError(f"the nodes never reached {env[faults.ENV]}: {n.output(0)[-2000:]}")
        elif p["fault"] == "cut@train":
            while not all(read_latest(os.path.join(r, RUN)) for r in roots) and alive():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"step {EVERY} never committed: {n.output(0)[-2000:]}")
                time.sleep(0.05)
            time.sleep(p["after_s"])
        t0 = time.monotonic()
        if p["fault"] in ("cut", "cut@train") and alive():
            net.link_down(1)
            res.injected = 1
        elif p["fault"] == "flap":
            for down, up in zip(p["down_s"], p["up_s"], strict=True):
                net.link_down(1)
                time.sleep(down)
                net.link_up(1)
                res.injected += 1
                time.sleep(up)
        elif p["fault"] in ("delay", "loss"):  # from step 8's replication to the end of the run
            net.impair(1, delay_ms=p.get("ms", 0), loss=p.get("pct", 0) / 100)
            res.injected = 1
        elif p["fault"] == "throttle":
            res.injected = 1
        limit = TIMEOUT_S + CKPT_TIMEOUT_S + MARGIN_S + (camp.opts.timeout_s if p["fault"] in IMPAIRED else 0)
        assert n.procs[0] is not None
        try:
            rc0: int | None = n.procs[0].wait(limit)
        except subprocess.TimeoutExpired:
            res.violations.append(f"node 0 still running {limit:.0f} s after the fault, a rank outwaited its timeouts")
            rc0 = None
        res.detail["node0_exit"], res.detail["node0_after_fault_s"] = rc0, round(time.monotonic() - t0, 1)
        said = n.output(0)
        named = PHASES.get(p.get("phase", ""))
        if p["fault"] == "cut" and named and not ("was not committed: node " in said and named in said):
            res.violations.append(f"node 0's failure does not name the node and {named!r}")
        if p["fault"] in IMPAIRED and rc0 != 0:
            res.violations.append(f"a {p['fault']} link failed the run (exit {rc0}); every save should commit")
        # A run the fault did not end, on a link that is up: node 1 finishes its own commit and exits. (Behind a
        # cut link its agent cannot reach the rendezvous host to exit: it is replaced by the restart below.)
        if rc0 == 0 and p["fault"] in ("flap", *IMPAIRED) and n.procs[1] is not None:
            try:
                n.procs[1].wait(60)
            except subprocess.TimeoutExpired:
                res.violations.append("node 1 still running 60 s after node 0 finished")
        n.kill(1)
        n.wait(30)
        if p["fault"] in ("cut", "cut@train"):  # node 1 still cut off: the lifecycle goes on without it
            for step, why in life.run(_committed(roots), life.nodes[:1]).items():
                res.violations.append(f"step {step} did not reach cold while node 1 was cut off: {why}")
            res.detail["cold_while_cut"] = {s: life.part_states[s] for s in sorted(life.done)}
        net.link_up(1)
        net.unthrottle(1)
        net.impair(1)
        finished = rc0 == 0 and all(read_latest(os.path.join(r, RUN)) == STEPS for r in roots)
        if p["fault"] == "cut" and rc0 == 0:
            res.violations.append("node 0 finished although node 1 was cut off in the commit")
        newest = max(_committed(roots), default=None)
        res.detail["newest_committed"] = newest
        if p["fault"] == "cut":
            want = HELD_STEP if named is None else EVERY
            if newest != want:
                res.violations.append(f"the newest committed step is {newest}; a cut at {p['phase']} leaves {want}")
        t1 = time.monotonic()
        if not finished:  # healed: both nodes restart and resume
            n.args = _args()
            n.start()
            rcs = n.wait(camp.opts.timeout_s)
            out = n.output(0) + n.output(1)
            if rcs != [0, 0]:
                res.violations.append(f"the healed run failed ({rcs}): {out[-1500:]}")
                return
            if newest is not None and f"resumed from step {newest} on 2 nodes" not in out:
                res.violations.append(f"the healed run did not resume from step {newest}")
        res.recovery_s = round(time.monotonic() - t1, 1)
    got = _curve(roots)
    if sorted(got) != list(range(1, STEPS + 1)):
        res.violations.append(f"steps trained: {sorted(got)}")
    diff = [s for s in got if got[s] != baseline.get(s)]
    if diff:
        res.violations.append(f"losses differ from the clean run's at steps {diff}")
    lacking = [r for r in roots if read_latest(os.path.join(r, RUN)) != STEPS]
    if lacking:
        res.lost.append(f"latest is not step {STEPS} on {lacking}")
    res.recovered = not res.violations and not res.lost
