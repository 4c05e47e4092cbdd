"""Node-local hot roots: the two-level commit, peer replicas, start-up recovery, resume anywhere.

When ``trainer.topology`` finds the ranks' hot roots node-local (each node's own disk), no one rank can
commit for everyone. Step N's protocol, in every rank's commit thread (``AsyncSaver``), all collectives on
the checkpoint group:

====  =================  ==============================================================
 1    all ranks          DCP writes each rank's shards into its node's ``step_N.tmp/``
                         (the coordinator's node also gets ``.metadata``)
 2    all -> rank 0      each rank hashes its own files; rank 0 gathers them and builds the global
                         manifest with the *placement*: which node wrote, which nodes hold each file
 3    rank 0 -> all      broadcast the manifest's and ``.metadata``'s bytes (or the failure: every
                         node drops its ``.tmp``, SaveError)
 4    pairs of ranks     replication: each shard to the ``replicas - 1`` next nodes on a ring
                         (``trainer/nodes/transport.py``), checked on arrival
 5    all-gather         everyone learns whether every transfer succeeded
 6    node leaders       ``.metadata``, then ``manifest.json`` last, made durable in the node's
                         ``.tmp`` (a ``.tmp`` with its manifest is a *prepared* part)
 7    all-gather         the decision: every node prepared -> commit; else every node drops its part
                         and the save fails everywhere (no rank branches on facts not from all)
 8    node leaders       rename ``step_N.tmp`` -> ``step_N`` (the node's commit point), then
                         ``latest``; rank 0 writes the outbox line and sends the event
====  =================  ==============================================================

A step is committed once any node renamed its part; renames start only after phase 7's unanimous decision,
so every other node holds a prepared part by then. A crash during or after 7 -> 8 rolls *forward* at the next
start (:func:`recover` renames prepared parts of steps another node committed); a crash before 7 rolls back
(no node renamed, every part is discarded). No node's ``latest`` ever names a step not complete everywhere.

Resume (:func:`resume_point`): every node says what it holds; all agree on the newest step whose every file
some live node holds (own disk or a peer's replica); each node fetches what its ranks need from a holder (a
replaced node starts empty); every byte is verified against the manifest; only then is it loaded.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ckptflow.trainer import faults
from ckptflow.trainer.distenv import gather
from ckptflow.trainer.errors import CheckpointNotFoundError, CkptflowError, IntegrityError, UntrustedError
from ckptflow.trainer.format import commit, layout
from ckptflow.trainer.format.atomicity import RENAME
from ckptflow.trainer.format.checksum import hash_bytes
from ckptflow.trainer.format.manifest import MAX_MANIFEST_BYTES, PLACEMENT, Manifest
from ckptflow.trainer.fsutil import fsync_dir, remove_tree, write_durable
from ckptflow.trainer.nodes import transport
from ckptflow.trainer.nodes.topology import Topology
from ckptflow.trainer.nodes.transport import Transfer
from ckptflow.trainer.safeopen import read_small
from ckptflow.trainer.verify import check_file, verify_checkpoint

__all__ = [
    "NodeResume",
    "NodeSave",
    "PLACEMENT",
    "not_recoverable_error",
    "placement",
    "recover",
    "replication_plan",
    "resume_point",
]


log = logging.getLogger(__name__)


# ---- placement (rank 0, at save) -------------------------------------------------------


def placement(topo: Topology, owners: dict[str, int], replicas: int) -> dict[str, Any]:
    """Which node wrote each file and which hold it after replication. ``owners``: file name -> the rank
    that wrote it. ``.metadata`` goes to every node."""
    ring = topo.holders(replicas)
    holders = {}
    owner_node = {}
    for name, rank in sorted(owners.items()):
        node = topo.domain_of(rank)
        owner_node[name] = node
        holders[name] = list(range(topo.n_nodes)) if name == layout.DCP_METADATA else ring[node]
    return {
        "scope": topo.scope,
        "replicas": max(1, min(replicas, topo.n_nodes)),
        "nodes": [{"node": n, "ranks": list(d)} for n, d in zip(topo.node_ids, topo.domains, strict=True)],
        "owner_rank": dict(sorted(owners.items())),
        "owner": owner_node,
        "holders": holders,
    }


def replication_plan(topo: Topology, manifest: Manifest) -> list[Transfer]:
    """Phase 4: every shard file from the rank that wrote it to its paired rank on each other
    holder node (``.metadata`` travels with the broadcast instead)."""
    pl = manifest.extra.get(PLACEMENT) or {}
    plan = []
    for name, nodes in sorted(pl.get("holders", {}).items()):
        if name == layout.DCP_METADATA:
            continue
        src = int(pl["owner_rank"][name])
        e = manifest.files[name]
        for node in nodes:
            if node != topo.domain_of(src):
                plan.append(Transfer(name, src, topo.peer_rank(src, node), e.size, e.checksum))
    return plan


# ---- the save, phases 3-8 (every rank, commit thread) ------------------------------------


@dataclass(slots=True)
class NodeSave:
    """What one rank does with one step's node-local commit (see the module docstring)."""

    topo: Topology
    run_path: str
    step: int
    group: Any
    timeout_s: float = 600.0
    replicated_bytes: int = 0

    @property
    def tmp(self) -> str:
        return RENAME.staging_url(self.run_path, self.step)

    def replicate(self, manifest: Manifest) -> list[str]:
        """Phase 4; returns this rank's problems (the caller gathers everyone's)."""
        faults.maybe_crash("replicate", self.step)
        plan = replication_plan(self.topo, manifest)
        problems, self.replicated_bytes = transport.run(
            plan,
            rank=self.topo.rank,
            group=self.group,
            source=lambda n: os.path.join(self.tmp, *n.split("/")),
            dest_dir=lambda n: self.tmp,
            timeout_s=self.timeout_s,
        )
        return problems

    def prepare(self, manifest_bytes: bytes, metadata: bytes) -> list[str]:
        """Phase 6 (node leaders): ``.metadata`` then ``manifest.json``, durable; the part is prepared."""
        if not self.topo.is_leader:
            return []
        try:
            md = os.path.join(self.tmp, layout.DCP_METADATA)
            if not os.path.exists(md):
                write_durable(md, metadata)
            write_durable(os.path.join(self.tmp, layout.MANIFEST), manifest_bytes)
            fsync_dir(self.tmp)
        except OSError as e:
            return [f"node {self.topo.node_id}: could not make its part of step {self.step} durable: {e}"]
        faults.maybe_crash("after_part", self.step)
        return []

    def decide(self, problems: list[str]) -> list[str]:
        """Phase 7: every rank's problems, gathered — the one value every rank branches on."""
        return [p for ps in gather(problems, self.group) for p in ps]

    def commit(self) -> str:
        """Phase 8 (node leaders): the node's commit point, then ``latest``."""
        final = layout.join(self.run_path, layout.step_name(self.step))
        if not self.topo.is_leader:
            return final
        faults.maybe_crash("decided", self.step)
        commit.rename_then_latest(self.run_path, self.step)
        return final

    def discard(self) -> None:
        if self.topo.is_leader:
            try:
                remove_tree(self.tmp)
            except OSError as e:
                log.warning("could not remove the failed save's %s: %s", self.tmp, e)


# ---- start-up: roll forward or back what a crash left -------------------------------------


def _prepared(run_path: str) -> tuple[list[int], list[str]]:
    """Steps with a prepared part (a ``.tmp`` holding its manifest), and every other ``.tmp``."""
    prepared, other = [], []
    try:
        names = os.listdir(run_path)
    except FileNotFoundError:
        return [], []
    for n in names:
        s = layout.parse_tmp_step(n)
        if s is None:
            continue
        if os.path.exists(os.path.join(run_path, n, layout.MANIFEST)):
            prepared.append(s)
        else:
            other.append(os.path.join(run_path, n))
    return sorted(prepared), other


def recover(run_path: str, topo: Topology, group: Any) -> dict[str, Any]:
    """At start-up, before any save, on all ranks: finish or undo the commits a crash interrupted. A prepared
    part of a step some node committed is renamed (rolled forward: the decision was to commit); any other
    ``.tmp`` is removed (no node committed it). The gathered facts are the same on every rank."""
    mine = None
    if topo.is_leader:
        prepared, _ = _prepared(run_path)
        mine = {"committed": RENAME.committed_steps(run_path), "prepared": prepared}
    facts = gather(mine, group)
    committed_anywhere = {s for d in topo.domains for s in facts[d[0]]["committed"]}
    out: dict[str, Any] = {"rolled_forward": [], "removed": []}
    if topo.is_leader:
        prepared, other = _prepared(run_path)
        for s in prepared:
            if s in committed_anywhere and not RENAME.is_committed(run_path, s):
                RENAME.commit(run_path, s)
                out["rolled_forward"].append(s)
                log.warning(
                    "node %s: step %d was committed by another node before a crash; this node's "
                    "prepared part is committed now (rolled forward)",
                    topo.node_id,
                    s,
                )
            else:
                other.append(RENAME.staging_url(run_path, s))
        for path in other:
            try:
                remove_tree(path)
                out["removed"].append(path)
            except OSError as e:  # never trusted; the next start retries
                log.warning("could not remove stale %s: %s", path, e)
        newest = max(RENAME.committed_steps(run_path), default=None)
        if out["rolled_forward"] and newest is not None:
            commit.write_latest(run_path, newest)
    dist.barrier(group=group)
    return out


# ---- resume -----------------------------------------------------------------------------


@dataclass(slots=True)
class NodeResume:
    """The step every rank agreed on, and how each node came to hold what its ranks read."""

    step: int | None
    manifest: Manifest | None = None
    path: str = ""
    """This node's copy of the step (all this node's ranks read from it)."""
    fetched: list[tuple[str, str, str]] = field(default_factory=list)
    """(file, from node, to node) for every file brought over the network."""
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(step, why) for each newer step passed over."""
    latest_was: int | None = None
    damaged: list[tuple[int, str]] = field(default_factory=list)
    """(step, why) for each step passed over as damaged, incomplete or quarantined (not for a manifest a node
    cannot trust: another key, a newer format): what each node sets aside once the resume goes on."""
    set_aside: list[str] = field(default_factory=list)
    """Nodes whose run holds checkpoints set aside earlier (``_damaged/``)."""


def _holdings(run_path: str, key: bytes | None) -> dict[int, dict[str, Any]]:
    """Per committed step on this node: its manifest's digest and the files present (by size)."""
    out: dict[int, dict[str, Any]] = {}
    for s in RENAME.committed_steps(run_path):
        d = os.path.join(run_path, layout.step_name(s))
        rec: dict[str, Any] = {
            "digest": None,
            "present": [],
            "missing": [],
            "problem": None,
            "untrusted": False,
            "quarantined": commit.is_quarantined(run_path, s),
        }
        try:
            data = read_small(os.path.join(d, layout.MANIFEST), MAX_MANIFEST_BYTES)
            m = Manifest.from_json(data, source=os.path.join(d, layout.MANIFEST), key=key)
            if m.step != s:
                raise IntegrityError(f"{d}: its manifest is for step {m.step}")
            rec["digest"] = hash_bytes(data)
            for name, e in m.files.items():
                p = os.path.join(d, *name.split("/"))
                ok = os.path.isfile(p) and not os.path.islink(p) and os.path.getsize(p) == e.size
                rec["present" if ok else "missing"].append(name)
        except (OSError, CkptflowError) as e:
            rec["problem"] = str(e)
            rec["untrusted"] = isinstance(e, UntrustedError)
        out[s] = rec
    return out


def _choose(
    topo: Topology, nodes: list[dict[int, dict[str, Any]]], exclude: set[tuple[int, str]]
) -> tuple[int | None, list[tuple[str, str]], list[tuple[int, str]]]:
    """The newest step for which every file is held by some node (``exclude``: copies found bad), the steps
    passed over, and those of them that are damage (:attr:`NodeResume.damaged`); the same answer on every
    rank, since every rank has the same ``nodes``."""
    skipped: list[tuple[str, str]] = []
    damaged: list[tuple[int, str]] = []

    def skip(s: int, why: str, damage: bool = True) -> None:
        skipped.append((layout.step_name(s), why))
        if damage:
            damaged.append((s, why))

    steps = sorted({s for n in nodes for s in n}, reverse=True)
    for s in steps:
        held = [(i, n[s]) for i, n in enumerate(nodes) if s in n]
        if any(r["quarantined"] for _, r in held):
            skip(s, "quarantined by the lifecycle's verify stage")
            continue
        digests = {r["digest"] for _, r in held if r["digest"] is not None}
        if len(digests) != 1:
            why = (
                "; ".join(f"node {topo.node_ids[i]}: {r['problem']}" for i, r in held if r["problem"])
                or "the nodes hold different manifests for it"
            )
            skip(s, why, damage=not any(r.get("untrusted") for _, r in held))
            continue
        need = {f for _, r in held if r["digest"] for f in (*r["present"], *r["missing"])}
        have = {f for i, r in held if r["digest"] for f in r["present"] if (i, f) not in exclude}
        lost = sorted(need - have)
        if lost:
            more = f" (+{len(lost) - 5} more)" if len(lost) > 5 else ""
            skip(s, f"no live node holds {', '.join(lost[:5])}{more}")
            continue
        return s, skipped, damaged
    return None, skipped, damaged


def resume_point(
    run_path: str,
    topo: Topology,
    group: Any,
    *,
    needs: Callable[[str, Manifest], set[str]],
    key: bytes | None = None,
    timeout_s: float = 600.0,
) -> NodeResume:
    """Agree on the newest recoverable step, bring every node what its ranks will read, verify it (module
    docstring). ``needs(step_dir, manifest)`` -> the files this rank's load reads (its DCP load plan);
    called once ``.metadata`` is local and verified."""
    exclude: set[tuple[int, str]] = set()
    for _attempt in range(4):  # each retry drops at least one bad copy; 4 is plenty
        mine = (
            (_holdings(run_path, key), commit.read_latest(run_path), bool(commit.set_aside_steps(run_path)))
            if topo.is_leader
            else None
        )
        facts = gather(mine, group)
        nodes = [facts[d[0]][0] for d in topo.domains]
        latest = facts[topo.leader][1]
        step, skipped, damaged = _choose(topo, nodes, exclude)
        out = NodeResume(step, skipped=skipped, latest_was=latest, damaged=damaged)
        out.set_aside = [topo.node_ids[i] for i, d in enumerate(topo.domains) if facts[d[0]][2]]
        if step is None:
            return out
        d = layout.join(run_path, layout.step_name(step))
        stage = d if step in nodes[topo.domain] else RENAME.staging_url(run_path, step)
        out.path = d
        # the manifest, from the first node holding the step (every holder's is the same)
        src = next(i for i, n in enumerate(nodes) if step in n and n[step]["digest"])
        box: list[Any] = [None]
        if topo.rank == topo.domains[src][0]:
            box[0] = read_small(os.path.join(d, layout.MANIFEST), MAX_MANIFEST_BYTES)
        dist.broadcast_object_list(box, src=topo.domains[src][0], group=group)
        manifest = Manifest.from_json(box[0], source=f"{topo.node_ids[src]}:{d}/{layout.MANIFEST}", key=key)
        out.manifest = manifest
        if topo.is_leader and stage != d:
            os.makedirs(stage, exist_ok=True)
        present = [set(n[step]["present"]) if step in n else set() for n in nodes]
        for i, bad_name in exclude:
            present[i].discard(bad_name)
        # first .metadata (the load plan needs it), then what every rank will read
        md_problems = _fetch(
            topo,
            group,
            manifest,
            present,
            {i: {layout.DCP_METADATA} for i in range(topo.n_nodes)},
            run_path,
            step,
            stage,
            out,
            timeout_s,
        )
        if md_problems:
            raise IntegrityError(
                f"resume: could not bring {layout.DCP_METADATA} of step {step} to every node: "
                + "; ".join(md_problems[:3])
            )
        if topo.is_leader and stage != d:
            write_durable(os.path.join(stage, layout.MANIFEST), box[0])
        dist.barrier(group=group)
        try:  # every rank answers, failed or not: a rank that raised alone would leave the others in gather
            answer: tuple[bool, Any] = (True, sorted(_needs_checked(stage, manifest, needs)))
        except Exception as e:
            answer = (False, f"rank {topo.rank}: {type(e).__name__}: {e}")
        answers = gather(answer, group)
        failed = [why for ok, why in answers if not ok]
        if failed:
            raise IntegrityError(f"resume: planning the load of step {step} failed: {failed[0]}")
        all_needs = [list(got) for _, got in answers]
        per_node = {
            i: {f for r in dom for f in all_needs[r]} | {layout.DCP_METADATA} for i, dom in enumerate(topo.domains)
        }
        problems = _fetch(topo, group, manifest, present, per_node, run_path, step, stage, out, timeout_s)
        if problems:
            raise IntegrityError(f"resume: fetching the files of step {step} failed: {'; '.join(problems[:3])}")
        if topo.is_leader and stage != d:
            RENAME.commit(run_path, step)  # this node now holds (its part of) the step
        dist.barrier(group=group)
        # verify every byte this node's ranks will read, before anything is unpickled
        local = topo.domains[topo.domain]
        mine_v = sorted(per_node[topo.domain])[local.index(topo.rank) :: len(local)]
        res = verify_checkpoint(d, only=mine_v, key=key)
        bad = [(topo.domain, str(p.path).rsplit("/", 1)[-1], str(p)) for p in res.problems]
        flat = [b for bs in gather(bad, group) for b in bs]
        if not flat:
            return out
        for node, name, why in flat:
            log.warning(
                "resume: node %s's copy of %s in step %d is damaged (%s); trying another holder",
                topo.node_ids[node],
                name,
                step,
                why,
            )
            exclude.add((node, name))
            if topo.domain == node and topo.is_leader:
                try:
                    os.unlink(os.path.join(d, *name.split("/")))  # damaged: never read it again
                except OSError:
                    pass
    raise IntegrityError(f"resume: copies of step {step} kept failing verification; see the warnings above")


def _needs_checked(step_dir: str, manifest: Manifest, needs: Callable[[str, Manifest], set[str]]) -> set[str]:
    """This rank's load plan, computed only after ``.metadata`` matched its manifest digest."""
    e = manifest.files[layout.DCP_METADATA]
    p = check_file(step_dir, layout.DCP_METADATA, e.size, e.checksum)
    if p is not None:
        raise IntegrityError(f"resume: {p}", path=p.path)
    wanted = needs(step_dir, manifest)
    unknown = wanted - set(manifest.files)
    if unknown:
        raise IntegrityError(f"{step_dir}: the load plan reads {sorted(unknown)}, which its manifest does not list")
    return wanted


def _fetch(
    topo: Topology,
    group: Any,
    manifest: Manifest,
    present: list[set[str]],
    want: dict[int, set[str]],
    run_path: str,
    step: int,
    stage: str,
    out: NodeResume,
    timeout_s: float,
) -> list[str]:
    """Bring each node the files of ``want`` it lacks, each from the lowest-numbered holder; senders and
    receivers spread over the nodes' ranks. Updates ``present``."""
    plan = []
    for node in range(topo.n_nodes):
        for k, name in enumerate(sorted(want[node] - present[node])):
            holders = [i for i in range(topo.n_nodes) if name in present[i]]
            if not holders:
                return [f"no node holds {name}"]
            h = holders[0]
            e = manifest.files[name]
            src = topo.domains[h][k % len(topo.domains[h])]
            dst = topo.domains[node][k % len(topo.domains[node])]
            plan.append(Transfer(name, src, dst, e.size, e.checksum))
            out.fetched.append((name, topo.node_ids[h], topo.node_ids[node]))
    if not plan:
        return []
    d = layout.join(run_path, layout.step_name(step))
    problems, _ = transport.run(
        plan,
        rank=topo.rank,
        group=group,
        source=lambda n: os.path.join(d, *n.split("/")),
        dest_dir=lambda n: stage,
        timeout_s=timeout_s,
    )
    flat = [p for ps in gather(problems, group) for p in ps]
    if not flat:
        for t in plan:
            present[topo.domain_of(t.dst)].add(t.name)
    return flat


def not_recoverable_error(run_path: str, skipped: list[tuple[str, str]]) -> CheckpointNotFoundError:
    run = os.path.basename(run_path)
    detail = "; ".join(f"{s}: {w}" for s, w in skipped)
    return CheckpointNotFoundError(
        f"no committed checkpoint of {run} can be recovered from the nodes' hot roots ({detail}). Bring one "
        f"back from the warm or cold tier onto every node, then start again: 'ckptflow restore {run} --step N "
        f"--to {run_path}/step_<N as 9 digits>' on each node (the newest step on warm/cold: 'ckptflow ls "
        f"{run}'), or start fresh with a new run id"
    )
