"""Which ranks share a hot root: found out at start-up, never assumed.

Every rank drops a token file into ``<run>/_scope/``; the ranks exchange their tokens and which they see. "Sees"
must be an equivalence relation whose classes are the storage nodes, else the start fails (a half-shared file system
is a misconfiguration no protocol can fix). One class: one shared root; several: node-local roots and the two-level
commit (``twolevel.py``). ``CheckpointConfig.hot_scope`` is checked against what is found. Each node's root keeps
its id in ``_node.json`` (a replaced node's empty disk gets a new one). See docs/architecture.md, "Many nodes".
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ckptflow.trainer.errors import ConfigError
from ckptflow.trainer.format import layout
from ckptflow.trainer.fsutil import replace_atomic
from ckptflow.trainer.safeopen import read_small

__all__ = ["SCOPES", "Topology", "discover", "node_id", "single"]


SCOPES = ("auto", "node", "shared")


@dataclass(frozen=True, slots=True)
class Topology:
    """The storage domains of a job, as every rank agreed on them."""

    scope: str
    """``"shared"`` (one domain) or ``"node"`` (node-local hot roots)."""
    domains: tuple[tuple[int, ...], ...]
    """Ranks sharing a hot root, each tuple sorted; domains ordered by their lowest rank."""
    node_ids: tuple[str, ...]
    """The id of each domain's hot root (``_node.json``), in domain order."""
    rank: int

    @property
    def n_nodes(self) -> int:
        return len(self.domains)

    def domain_of(self, rank: int) -> int:
        for i, d in enumerate(self.domains):
            if rank in d:
                return i
        raise KeyError(rank)

    @property
    def domain(self) -> int:
        """This rank's domain (node) index."""
        return self.domain_of(self.rank)

    @property
    def leader(self) -> int:
        """The rank that writes this node's shared files (manifest, ``.metadata``, renames)."""
        return self.domains[self.domain][0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    @property
    def node_id(self) -> str:
        return self.node_ids[self.domain]

    def holders(self, replicas: int) -> list[list[int]]:
        """For each node, the nodes holding its shard files: itself, then the next ``replicas - 1`` on a ring
        (as NVIDIA's resiliency extension places them), so losing any ``replicas - 1`` nodes loses no shard."""
        k = max(1, min(replicas, self.n_nodes))
        return [[(i + j) % self.n_nodes for j in range(k)] for i in range(self.n_nodes)]

    def peer_rank(self, rank: int, node: int) -> int:
        """The rank on ``node`` paired with ``rank``: the same position within its node."""
        own = self.domains[self.domain_of(rank)]
        there = self.domains[node]
        return there[own.index(rank) % len(there)]

    def describe(self) -> dict[str, Any]:
        return {
            "scope": self.scope,
            "nodes": [{"node": n, "ranks": list(d)} for n, d in zip(self.node_ids, self.domains, strict=True)],
        }


def single(rank: int = 0, world: int = 1, node_id: str = "shared") -> Topology:
    """One shared domain: what a job without distributed storage looks like."""
    return Topology("shared", (tuple(range(world)),), (node_id,), rank)


def node_id(root: str) -> str:
    """This disk's node id: read from ``<root>/_node.json``, created the first time."""
    path = os.path.join(root, layout.NODE_ID)
    try:
        return str(json.loads(read_small(path, 4096))["node"])
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        pass
    os.makedirs(root, exist_ok=True)
    nid = f"{socket.gethostname().split('.')[0]}-{uuid.uuid4().hex[:8]}"
    replace_atomic(path, (json.dumps({"node": nid, "created_at": time.time()}) + "\n").encode())
    # a concurrent creator may have won: theirs counts
    return str(json.loads(read_small(path, 4096))["node"])


def discover(root: str, run_path: str, *, rank: int, world: int, group: Any, requested: str = "auto") -> Topology:
    """Find which ranks share ``root`` (all ranks call this together; see the module docstring)."""
    # here, not at the top: distenv imports torch, and the lifecycle's node parts read node ids
    # (``node_id``) in processes that never need it (1.7 s of import in each)
    from ckptflow.trainer.distenv import gather

    if requested not in SCOPES:  # callers other than CheckpointConfig reach here too
        raise ConfigError(f"CheckpointConfig.hot_scope={requested!r}; choose one of {', '.join(SCOPES)}")
    if world == 1:
        return single(rank, 1)
    scope_dir = os.path.join(run_path, layout.SCOPE_DIR)
    os.makedirs(scope_dir, exist_ok=True)
    token = f"{rank}.{uuid.uuid4().hex}"
    path = os.path.join(scope_dir, token)
    with open(path, "w") as f:
        f.write(socket.gethostname())
    try:
        tokens = gather(token, group)
        present = set(os.listdir(scope_dir))
        seen = sorted(r for r, t in enumerate(tokens) if t in present)
        seen_by = gather(seen, group)
    finally:
        try:
            os.unlink(path)  # every rank has listed (the all-gather above): safe to remove
        except OSError:
            pass
    domains = _domains([list(s) for s in seen_by])
    scope = "shared" if len(domains) == 1 else "node"
    if requested == "shared" and scope != "shared":
        raise ConfigError(
            f"CheckpointConfig.hot_scope='shared', but the hot root {root} is not shared: ranks "
            f"{list(domains[0])} see one folder and ranks {list(domains[1])} another (node-local disks). "
            "Use hot_scope='auto' (or 'node') so every node commits its own part"
        )
    if scope == "shared":
        return single(rank, world)  # one root: no node ids needed (and none written)
    me = next(i for i, d in enumerate(domains) if rank in d)
    mine = node_id(root) if rank == domains[me][0] else None
    ids = gather(mine, group)
    node_ids = tuple(str(ids[d[0]]) for d in domains)
    if len(set(node_ids)) != len(node_ids):
        raise ConfigError(
            f"two nodes' hot roots carry the same node id ({node_ids}): a disk image was "
            f"copied with its {layout.NODE_ID}; delete that file on one of them"
        )
    return Topology(scope, domains, node_ids, rank)


def _domains(seen_by: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    """Equivalence classes of "rank a sees rank b's token"; a relation that is not one is an error."""
    world = len(seen_by)
    for a in range(world):
        if a not in seen_by[a]:
            raise ConfigError(
                f"rank {a} cannot see its own file on its hot root; the folder is not "
                "writable or not a normal file system"
            )
        for b in seen_by[a]:
            if sorted(seen_by[b]) != sorted(seen_by[a]):
                raise ConfigError(
                    f"ranks disagree about which of them share a hot root: rank {a} sees {seen_by[a]}, rank "
                    f"{b} sees {seen_by[b]}. Give every node one root that its ranks (and only they) share, "
                    "or one root shared by all"
                )
    return tuple(sorted({tuple(sorted(s)) for s in seen_by}, key=lambda d: d[0]))
