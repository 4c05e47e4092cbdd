"""`ckptflow demo --nodes 2` end to end in a shorter setting, as a user starts it, checked for what it
did (a module of its own: the longest test, scheduled beside the single-node demo)."""

from __future__ import annotations

import json

from tests.e2e.test_demo import _demo, _procs_with_env


def test_node_demo_takes_every_checkpoint_through_the_node_workers_to_cold(tmp_path):
    """The many-node path as shipped: ``ckptflow deploy``, ``ckptflow worker --general`` and one
    ``ckptflow worker`` per node, two torchrun agents on node-local roots whose commits reach the
    lifecycle by their real events; node 1 is lost and replaced by an empty node mid-run. Every
    checkpoint ends promoted from the nodes' parts, verified on warm (probe bitwise), exported as
    safetensors by the general worker, archived and pruned; the drill restores the newest from cold; and
    with both nodes' disks wiped the job comes back from cold by itself, bitwise."""
    wd = tmp_path / "nodes"
    r = _demo(wd, "--nodes", "2", "--steps", "20", "--save-every", "10", "--kill-at", "15")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    s = json.loads((wd / "summary.json").read_text())
    assert s["ok"] and s["problems"] == []
    assert len(set(s["nodes"])) == 3, "node 1 came back as a new node"
    assert any("resumed from step 10" in x and "fetched" in x for x in s["resumed"]), s["resumed"]
    assert [c["step"] for c in s["checkpoints"]] == [10, 20]
    newest = s["checkpoints"][-1]  # on both nodes' own hot roots (the summary's "hot")
    assert newest["hot_nodes"] == 2 and newest["tiers"][0] == "hot", newest
    for c in s["checkpoints"]:
        assert c["stages"] == ["verified", "promoted", "exported", "archived", "pruned"], c
        assert c["export"]["location"].startswith(str(wd / "warm")) and c["export"]["tensors"] > 0, c
        assert c["probe"] == "bitwise" and "cold" in c["tiers"] and not c["quarantined"], c
    assert sorted(s["lifecycle_states"]) == [f"lifecycle-demo-step{n}" for n in (10, 20)]
    assert set(s["lifecycle_states"].values()) == {"COMPLETED"}
    assert s["drill"]["ok"] and s["drill"]["results"][0]["step"] == 20
    # both nodes' disks wiped and warm offline: step 20 back from cold, each node what its rank reads
    w = s["way_back"]
    assert w["ok"] and w["step"] == 20 and w["tier"] == "cold" and w["bitwise"], w
    assert w["steps"] == [21, 22, 23, 24] and w["bytes_fetched"] > 0
    files = sorted(f for f, _ in w["node_parts"].values())  # .metadata and the shards its rank reads
    assert len(files) == 2 and files[0] < files[1] and sum(b for _, b in w["node_parts"].values()) == w["bytes_fetched"]
    assert "every node's disk wiped" in r.stdout
    assert "demo OK" in r.stdout
    assert _procs_with_env(str(wd / "prefect")) == [], "the demo stopped every process it started"
