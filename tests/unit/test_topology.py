"""Many nodes with node-local hot roots: the two-level commit, peer replicas, resume anywhere.

Each node is its own torchrun agent (c10d rendezvous on 127.0.0.1) with its own hot folder as
its local disk (``ckptflow.harness.NodeAgents``). Ranks are assigned at rendezvous, so which
node holds rank 0 differs between runs: nothing here assumes it.
"""

from __future__ import annotations

import pytest

from ckptflow.trainer.errors import ConfigError
from ckptflow.trainer.nodes import transport
from ckptflow.trainer.nodes.topology import Topology, _domains

RUN = "mn"


def test_who_shares_a_root_is_an_equivalence_or_an_error():
    assert _domains([[0, 1], [0, 1], [2, 3], [2, 3]]) == ((0, 1), (2, 3))
    assert _domains([[0, 1, 2]] * 3) == ((0, 1, 2),)
    with pytest.raises(ConfigError, match="disagree"):
        _domains([[0, 1], [0, 1, 2], [1, 2]])  # half-shared: rank 1 sees both
    with pytest.raises(ConfigError, match="its own file"):
        _domains([[1], [1]])


def test_ring_placement_and_pairing():
    topo = Topology("node", ((0, 1), (2, 3), (4, 5)), ("a", "b", "c"), 0)
    assert topo.holders(2) == [[0, 1], [1, 2], [2, 0]]
    assert topo.holders(5) == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]  # capped at the node count
    assert topo.holders(1) == [[0], [1], [2]]
    assert [topo.peer_rank(r, 1) for r in (0, 1, 4, 5)] == [2, 3, 2, 3]


def test_transfer_rounds_never_make_a_rank_send_or_receive_twice():
    plan = [
        transport.Transfer(f"f{i}", s, d, 10, "x")
        for i, (s, d) in enumerate([(0, 1), (0, 2), (1, 0), (2, 0), (1, 2), (3, 1)])
    ]
    rs = transport.rounds(plan)
    assert sorted(t for r in rs for t in r) == sorted(plan)
    for r in rs:
        assert len({t.src for t in r}) == len(r) and len({t.dst for t in r}) == len(r)


def test_the_chunk_follows_the_slowest_transfer_of_each_step():
    p = transport.Pace(timeout_s=8.0)  # a step should take at most 1 s
    assert p.chunk == transport.FIRST_CHUNK
    p.after(0.1)  # under a quarter of its share: doubled
    assert p.chunk == 2 * transport.FIRST_CHUNK
    p.after(0.5)  # within its share: kept
    assert p.chunk == 2 * transport.FIRST_CHUNK
    p.after(4.0)  # four times too slow: cut to fit (a power of two)
    assert p.chunk == transport.FIRST_CHUNK // 2
    p.after(1.5)  # a little too slow: at least halved
    assert p.chunk == transport.FIRST_CHUNK // 4
    for _ in range(30):
        p.after(1000.0)
    assert p.chunk == transport.MIN_CHUNK
    for _ in range(30):
        p.after(0.0)
    assert p.chunk == transport.MAX_CHUNK
