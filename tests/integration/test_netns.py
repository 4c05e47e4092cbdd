"""Nodes on a real network: each torchrun agent in a network namespace of its own, joined to the
others by a veth link to a bridge (``ckptflow.harness.NetNodes``), the rendezvous and gloo on
those addresses; faults taken on the links. Root only (as CI runs here)."""

from __future__ import annotations

import json
import os
import time

import pytest

from ckptflow.harness import NetNodes, NodeAgents, namespaces
from ckptflow.trainer import faults
from ckptflow.trainer.nodes import transport
from ckptflow.trainer.reference.metrics import read_metrics

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
RUN = "net"


def _args(*extra: str) -> list[str]:
    return ["--run-id", RUN, "--model", "tiny", "--max-steps", "12", "--save-every", "4", *extra]


def _run(root: str) -> str:
    return os.path.join(root, RUN)


def _curve(roots: list[str]) -> dict[int, float]:
    """The loss per step, the last time it was trained, from whichever node held rank 0."""
    rows = sorted((r for root in roots for r in read_metrics(_run(root))), key=lambda r: r["wall"])
    return {r["step"]: r["loss"] for r in rows}


def _latest(root: str) -> int | None:
    from ckptflow.trainer.format.commit import read_latest

    return read_latest(_run(root))


def _steps(root: str) -> list[int]:
    from ckptflow.trainer.format.commit import committed_steps

    return committed_steps(_run(root))


def _summary(out: str) -> dict:
    line = [ln for ln in out.splitlines() if ln.startswith("ckptflow-summary ")][-1]
    return json.loads(line.split(" ", 1)[1])


@pytest.fixture(scope="module")
def network(tmp_path_factory):
    """Two nodes over the bridge, node 1 through a userspace relay, and a run on it to compare with
    (bitwise, the network does not change a loss): node 1's link throttled (tbf, 50 mbit), its frames
    delayed 5 ms each way and 2 % of them dropped (the relay) for the whole run; the shards replicate
    across it and every checkpoint commits. Every namespace the harness made is gone afterwards,
    and the relay with them."""
    tmp = tmp_path_factory.mktemp("net")
    with NetNodes(2, relay=(1,)) as net:
        mine = [n for n in namespaces() if n.startswith(net.name)]
        assert len(mine) == 4
        relays = list(net.relays.values())
        clean = [str(tmp / "clean" / f"node{i}") for i in range(2)]
        net.throttle(1, "50mbit")
        net.impair(1, delay_ms=5, loss=0.02)
        with NodeAgents(clean, _args(), log_dir=str(tmp / "logs-clean"), net=net) as nodes:
            nodes.start()
            assert nodes.wait(180) == [0, 0], nodes.output(0)[-3000:]
            summary = _summary("\n".join(nodes.output(i) for i in range(2)))  # rank 0's, on either node
        net.unthrottle(1)
        net.impair(1)
        assert summary["saves"] == 3 and summary["replicated_bytes"] > 0, summary
        assert all(_latest(r) == 12 for r in clean)
        yield net, _curve(clean)
    assert not [n for n in namespaces() if n in mine] and all(p.poll() is not None for p in relays)


# Where node 1 is cut off in step 8's commit, what the failure names, and the step both resume from:
# before the unanimous decision nothing commits (roll back); after it every node commits (forward).
CUTS = [
    ("replicate", "phase 4-5, replication", 4),
    ("after_part", "phase 6-7, the decision", 4),
    ("decided", None, 8),
]


def test_a_node_cut_off_in_the_commit_fails_in_time_leaves_latest_whole_and_the_healed_run_resumes_bitwise(
    network, tmp_path, s3_endpoint, s3_bucket
):
    """One job, cut three times: node 1 is cut off while both nodes are held at a phase of step 8's
    commit (each cut in turn; the job restarts in between, as an operator would). Each time node 0
    fails within its timeouts instead of hanging (the commit's own failure naming the node and the
    phase), no node's ``latest`` names a step another node lacks, and once the link is back both
    nodes resume from the newest globally committed step. The healed job trains to losses bitwise
    equal to the clean run's at every step. The lifecycle takes every globally committed step to cold: step 8,
    committed by the cut after the decision, while node 1 is still cut off (node 1's files taken over from the
    replicas node 0 holds), the others once the link is back."""
    from ckptflow.chaos import checks
    from ckptflow.chaos.nodelife import NodeLifecycle
    from ckptflow.chaos.workspace import Scratch, Style

    net, baseline = network
    roots = [str(tmp_path / f"node{i}") for i in range(2)]
    timeouts = ["--timeout-s", "20", "--ckpt-timeout-s", "10"]
    outs = []
    with NodeAgents(roots, _args(), log_dir=str(tmp_path / "logs"), net=net) as nodes:
        for k, (phase, named, resume) in enumerate(CUTS):
            marks = tmp_path / f"marks-{phase}"
            marks.mkdir()
            nodes.args = _args("--step-sleep", "0.2", *timeouts)
            nodes.start(env={faults.ENV: f"{phase}@8:sleep3", faults.MARKS: str(marks)})
            deadline = time.monotonic() + 120
            while len(os.listdir(marks)) < 2:  # both nodes held at the phase
                assert time.monotonic() < deadline and all(p.poll() is None for p in nodes.procs if p), phase
                time.sleep(0.05)
            net.link_down(1)
            t0 = time.monotonic()
            assert nodes.procs[0] is not None
            rc0 = nodes.procs[0].wait(60)
            waited = time.monotonic() - t0
            assert rc0 != 0 and waited < 45, (phase, rc0, waited)  # the 20 s timeout ended it, not a hang
            said = nodes.output(0)
            if named:  # the commit's own timeout (10 s) names the node and the phase
                assert "was not committed: node " in said and named in said, (phase, said[-3000:])
            if k:  # each restart resumed from the step the cut before it left on every node
                both = said + nodes.output(1)
                assert "resumed from step 4 on 2 nodes" in both, (phase, both[-3000:])
            for root in roots:  # every node holds what any `latest` names
                assert _latest(root) == resume and (8 in _steps(root)) is (resume == 8), (phase, root, _steps(root))
            # Node 1's agent keeps calling the rendezvous host it cannot reach (torchrun's own
            # timeouts, minutes): the node is replaced the way an operator would, by a restart.
            nodes.kill(1)
            nodes.wait(30)
            if not k:
                tiers = Scratch(str(tmp_path / "tiers"), s3_bucket, "c", s3_endpoint, Style(sanity_step=False))
                life = NodeLifecycle(tiers.with_run(RUN), roots)
            if resume == 8:  # node 1 still cut off: the lifecycle of step 8 goes on without it
                assert life.run([8], life.nodes[:1]) == {}
                states = life.part_states[8]
                assert states[life.nodes[1]] == "NO_WORKER" and f"{life.nodes[0]} (take-over)" in states, states
            net.link_up(1)
            outs.append(said)
        nodes.args = _args()
        nodes.start()
        assert nodes.wait(240) == [0, 0], nodes.output(0)[-3000:]
        out = "\n".join(nodes.output(i) for i in range(2))
    assert "resumed from step 8 on 2 nodes" in out, out[-3000:]
    got = _curve(roots)
    assert sorted(got) == list(range(1, 13))
    assert all(got[s] == baseline[s] for s in got), [(s, got[s], baseline[s]) for s in got if got[s] != baseline[s]]
    assert all(_latest(r) == 12 for r in roots)
    assert life.run([4, 8, 12], life.nodes) == {}
    views = checks.tier_views(life.scratch, [life.scratch.tier("warm"), life.scratch.tier("cold")])
    assert sorted(views["cold"].good) == [4, 8, 12] and not checks.half_committed(views), views


def test_a_replica_transfer_longer_than_the_commit_timeout_completes_on_a_slow_link(network, tmp_path):
    """The checkpoint group's timeout bounds each wait of a transfer, not the transfer: on node 1's link at
    8 mbit, 3 MB take longer than a 2 s timeout, yet rank 0 (node 0) sends them to rank 2 (node 1) while rank 1
    (node 0), with nothing to move, waits step by step beside them and then gathers as phase 5 does. The chunk
    shrinks to fit the link; the bytes arrive whole."""
    import subprocess

    from ckptflow.harness import free_port
    from tests.helpers import PY, REPO, torchrun_env

    net, _ = network
    size, timeout_s, port = 3_000_000, 2.0, free_port()
    net.throttle(1, "8mbit")
    try:
        procs = [
            subprocess.Popen(
                [*net.exec_prefix(node), PY, "-m", "tests.loops.transfer_job"]
                + [str(rank), "3", net.addr(0), str(port), str(tmp_path), str(size), str(timeout_s)],
                cwd=REPO,
                env=torchrun_env({"GLOO_SOCKET_IFNAME": NetNodes.LINK}),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank, node in enumerate([0, 0, 1])
        ]
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        net.unthrottle(1)
    assert [p.returncode for p in procs] == [0, 0, 0], [e[-2000:] for _, e in outs]
    got = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    assert all(g["problems"] == [[], [], []] for g in got), got
    assert got[2]["received"] == size and (tmp_path / "rank2" / "blob").stat().st_size == size
    assert all(g["s"] > timeout_s for g in got), got  # every rank outlasted the timeout without a wait exceeding it
    assert got[0]["chunk"] < transport.FIRST_CHUNK, got  # the chunk followed the link down


def test_the_namespaces_of_a_harness_killed_without_clean_up_are_removed_by_the_next():
    import signal
    import subprocess
    import sys

    code = (
        "from ckptflow.harness import NetNodes; import time; n = NetNodes(2); print(n.name, flush=True); time.sleep(60)"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    name = p.stdout.readline().strip()
    p.send_signal(signal.SIGKILL)
    p.wait(30)
    assert len([n for n in namespaces() if n.startswith(name + "-")]) == 3  # left behind
    with NetNodes(1):
        assert not [n for n in namespaces() if n.startswith(name + "-")]


def test_chaos_net_kind_a_flapping_link_in_the_commit_loses_nothing_and_leaves_no_namespace(tmp_path):
    """``ckptflow chaos --kinds net``, as a user starts it: seed 29's one trial takes node 1's link down and up three
    times from the start of step 8's replication. Whether the commit survives the flaps or fails naming its
    phase, no rank waits past its timeouts, no node's ``latest`` ever names a step another node lacks (sampled
    every 0.1 s), the healed run's losses are the clean run's bit for bit, and the namespaces are gone."""
    import subprocess

    from tests.helpers import PY, REPO, torchrun_env

    p = subprocess.Popen(
        [PY, "-m", "ckptflow.cli.main", "chaos", "--kinds", "net", "--trials", "1", "--seed", "29", "--json"],
        cwd=REPO,
        env=torchrun_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-4000:]
    assert not [n for n in namespaces() if n.startswith(f"ckf{p.pid}x")]  # the harness's names carry its pid
    rep = json.loads(out)
    (t,) = rep["trials"]
    assert t["kind"] == "net" and t["fault"] == "link flapping 3x" and t["injected"] == 3, t
    assert t["ok"] and t["recovered"] and not (t["lost"] or t["undetected"] or t["violations"]), t
    assert sorted(t["detail"]["cold"]) == [4, 8, 12], t  # every globally committed step taken to cold
    s = rep["summary"]["net"]
    assert (s["trials"], s["detected"], s["lost"], s["undetected"]) == (1, 1, 0, 0), s
