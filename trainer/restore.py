"""Resume: the newest checkpoint every rank can load, loaded, with fallback past damaged ones.

One shared root: candidates newest first (``resume.py``), each verified as it is read (``loader.py``); one
that fails on any rank fails on all, and they try the next older one together. Node-local roots: the nodes
agree on the newest recoverable step, each fetches what it lacks from a peer's replica (``nodes/``), then the
same load. Mismatched provenance is refused unless allowed; a wrong ``latest`` is repaired.

With tiers beyond the hot root (``trainer/recall.py``): rank 0 lists them once (bounded retries) and shares
the answer; a step they hold that is newer than every good step on hot is brought into the hot root, verified,
and loaded like a hot one. Node-local roots that all lost the run: each node brings back the files its ranks
read. A tier unreachable when it is needed: stop, naming it, rather than start at 0 or go on from an older step
than the tiers may hold.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar, cast

from ckptflow.trainer.config import Provenance
from ckptflow.trainer.distenv import DistEnv, gather, on_ranks
from ckptflow.trainer.errors import CheckpointNotFoundError, ConfigError
from ckptflow.trainer.format import commit, layout
from ckptflow.trainer.format.atomicity import RENAME
from ckptflow.trainer.format.manifest import Manifest, read_manifest
from ckptflow.trainer.fsutil import remove_tree
from ckptflow.trainer.loader import Reshard, files_read, load_target, load_verified
from ckptflow.trainer.nodes.topology import Topology
from ckptflow.trainer.nodes.twolevel import not_recoverable_error, resume_point
from ckptflow.trainer.recall import Brought, Recall, TierUnreachableError, steps_with_retries
from ckptflow.trainer.resume import (
    Candidate,
    ResumeReport,
    bring_into_hot,
    check_provenance,
    find_resume_point,
    needs_tiers,
    no_checkpoint_error,
    only_set_aside_error,
    set_aside_or_warn,
    settle,
    walk,
)
from ckptflow.trainer.state import TrainState

__all__ = ["LoadResult", "Resume", "refuse_second_history", "resume"]

T = TypeVar("T")

log = logging.getLogger(__name__)


@dataclass
class LoadResult:
    step: int
    path: str | None
    skipped: list[tuple[str, str]] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    fetched: list[tuple[str, str, str]] = field(default_factory=list)
    """Node-local roots: (file, from node, to node) for every file brought over the network."""
    brought: Brought | None = None
    """The checkpoint resumed from was brought back from a tier beyond the hot root (warm, cold)."""


@dataclass(frozen=True)
class Resume:
    """What a resume needs besides the objects it fills."""

    run_path: str
    env: DistEnv
    topology: Topology
    provenance: Provenance
    required: bool
    """No checkpoint to resume from is an error (``resume="required"``)."""
    allow_mismatch: bool
    reshard_state: Reshard | None = None
    recall: Recall | None = None
    """The tiers beyond the hot root (``trainer/recall.py``); None: the hot root alone."""
    tiers_wait_s: float = 60.0
    """How long rank 0 retries a tier it cannot list before the resume decides without it."""


def resume(r: Resume, state: TrainState) -> LoadResult:
    load: Callable[[str, Manifest], object] = lambda path, manifest: load_verified(  # noqa: E731
        path, manifest, env=r.env, state=state, reshard_state=r.reshard_state
    )
    if r.topology.scope == "node":
        return _resume_nodes(r, state, load)
    return _resume_shared(r, load)


def _mismatches(r: Resume, manifest: Manifest, path: str) -> list[str]:
    return check_provenance(
        manifest,
        path,
        config_hash=r.provenance.config_hash,
        data_fingerprint=r.provenance.data_fingerprint,
        allow_mismatch=r.allow_mismatch,
    )


def _resume_shared(r: Resume, load: Callable[[str, Manifest], object]) -> LoadResult:
    env = r.env

    def find(after: int | None) -> ResumeReport:
        # Cheap checks here (manifest, files present with their sizes); the load verifies every byte as it
        # reads, and a mismatch fails it on every rank, so all move on to the next older one together.
        return find_resume_point(
            r.run_path, rank=env.rank, world=env.world_size, group=env.ckpt_group, deep=False, after=after
        )

    mism: list[str] = []

    def use(c: Candidate) -> None:
        nonlocal mism
        mism = _mismatches(r, c.manifest, c.path)
        load(c.path, c.manifest)

    def bring(step: int, bad: set[int]) -> tuple[Brought | None, str]:
        assert r.recall is not None
        recall = r.recall
        return _on_rank0(env, lambda: bring_into_hot(r.run_path, recall, step, bad), f"bring-{step}")

    w = walk(
        r.run_path,
        find=find,
        use=use,
        beyond=lambda rep: _look_beyond(r, rep),
        held=lambda: _tier_steps(r),
        bring=bring,
        where=r.recall.describe() if r.recall is not None else "",
    )
    skipped, chosen, brought = w.skipped, w.chosen, w.brought
    for path, why in skipped:
        if env.rank == 0:
            log.warning("resume: skipping %s: %s", path, why)
    if chosen is None:
        if r.required or skipped:
            # Checkpoints exist but none verifies: starting over silently would discard training; ask the operator
            raise no_checkpoint_error(r.run_path, skipped)
        aside = commit.set_aside_steps(r.run_path)
        if aside:  # every checkpoint was set aside as damaged earlier: still not a reason to start over silently
            raise only_set_aside_error(r.run_path, aside)
        return LoadResult(0, None)
    for m in mism:
        log.warning("resume despite mismatch (allow_mismatch): %s", m)
    if env.rank == 0:
        # Damaged means no longer committed: what this resume passed over is set aside, so the saves that
        # replay those steps commit (not dropped as "already committed" beside a damaged copy).
        settle(r.run_path, w)
        if brought is not None:
            log.info(
                "resumed from step %d brought back from the %s tier (%s): %d files, %d bytes in %.2f s",
                brought.step,
                brought.tier,
                brought.uri,
                brought.files,
                brought.bytes_fetched,
                brought.seconds,
            )
        else:
            log.info("resumed from %s (step %d)", chosen.path, chosen.step)
    return LoadResult(chosen.step, chosen.path, skipped, mism, brought=brought)


def _look_beyond(r: Resume, rep: ResumeReport) -> bool:
    """``resume.needs_tiers``, rank 0's answer shared: ``latest`` is read by each rank."""
    if r.recall is None:
        return False
    need = needs_tiers(r.run_path, rep)
    return bool(gather(need, r.env.ckpt_group)[0]) if r.env.world_size > 1 else need


def _tier_steps(r: Resume) -> set[int]:
    """Rank 0 lists the tiers beyond hot (bounded retries); every rank gets its answer, so all branch alike.
    Raises TierUnreachableError on every rank when a tier stays unreachable: it may hold what hot lacks."""
    if r.recall is None:
        return set()
    recall = r.recall
    held, why = _on_rank0(
        r.env, lambda: steps_with_retries(recall, os.path.basename(r.run_path), wait_s=r.tiers_wait_s), "list"
    )
    if held is None:
        raise TierUnreachableError(
            f"{why}. Not resuming {r.run_path} while the tiers may hold checkpoints newer than any good one on "
            "hot: make the tier reachable and start again, or, to resume from the hot root alone (or start over "
            "on an empty one), set CheckpointConfig.tiers='none'"
        )
    return held


def _on_rank0(env: DistEnv, work: Callable[[], T], name: str) -> tuple[T | None, str]:
    """``work()`` on rank 0 (``_on_each``); every rank gets (its result, "") or (None, why it failed)."""
    outcome = _on_each(env, work, name, here=env.rank == 0)[0]
    assert outcome is not None
    return outcome


def _on_each(env: DistEnv, work: Callable[[], T], name: str, *, here: bool) -> list[tuple[T | None, str] | None]:
    """``distenv.on_ranks`` on the checkpoint group, in rounds of at most a quarter of its timeout."""
    return on_ranks(work, here=here, group=env.ckpt_group, round_s=min(10.0, env.ckpt_timeout_s / 4), name=name)


def refuse_second_history(run_path: str, env: DistEnv, recall: Recall | None, *, wait_s: float) -> None:
    """``resume="never"`` under a run id that holds committed checkpoints (hot, or the tiers): its saves would
    take the names of steps already there, two histories under one id. Refused at start, on every rank."""
    run_id = os.path.basename(run_path)

    def look() -> list[str]:
        found: list[str] = []
        steps = commit.committed_steps(run_path)
        if steps:
            found.append(f"hot ({run_path}): steps {_shown(steps)}")
        if recall is not None:
            held = steps_with_retries(recall, run_id, wait_s=wait_s)
            if held:
                found.append(f"{recall.describe()}: steps {_shown(sorted(held, reverse=True))}")
        return found

    found, why = _on_rank0(env, look, "never")
    if found is None:
        raise ConfigError(
            f"resume='never': cannot tell whether run {run_id} already has checkpoints ({why}); make the tier "
            "reachable, or set CheckpointConfig.tiers='none' to start without looking beyond the hot root"
        )
    if found:
        raise ConfigError(
            f"resume='never' but run {run_id} already has checkpoints ({'; '.join(found)}); "
            "starting over would write a second history under the same run id. Use a new run id, or "
            "resume='auto' to go on from the newest"
        )


def _shown(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:4])) + (f" (+{len(steps) - 4} more)" if len(steps) > 4 else "")


def _resume_nodes(r: Resume, state: TrainState, load: Callable[[str, Manifest], object]) -> LoadResult:
    """Node-local roots: agree on the newest recoverable step, fetch, verify, load (``nodes/twolevel.py``)."""
    env, topo = r.env, r.topology

    def needs(step_dir: str, manifest: Manifest) -> set[str]:
        from ckptflow.trainer.format.dcpmeta import read_dcp_metadata

        md = read_dcp_metadata(step_dir)  # what files_read parses anyway; also sizes the optimizer's state
        return files_read(step_dir, load_target(manifest, env=env, state=state, metadata=md), md)

    rep = resume_point(r.run_path, topo, env.ckpt_group, needs=needs, timeout_s=env.ckpt_timeout_s)
    if env.rank == 0:
        for step, why in rep.skipped:
            log.warning("resume: skipping %s: %s", step, why)
    brought: Brought | None = None
    parts: list[tuple[str, Brought]] = []
    if rep.step is None or rep.manifest is None:
        held = _tier_steps(r)
        if held:  # never start over while the tiers hold the run: each node brings back what its ranks read
            rep.step, rep.manifest, parts = _bring_to_nodes(r, held, needs)
            rep.path = os.path.join(r.run_path, layout.step_name(rep.step))
    if parts:
        b = parts[0][1]
        brought = Brought(
            b.step,
            b.tier,
            b.uri,
            sum(p.files for _, p in parts),
            sum(p.bytes_fetched for _, p in parts),
            max(p.seconds for _, p in parts),
        )
    if rep.step is None or rep.manifest is None:
        if r.required or rep.skipped:
            raise not_recoverable_error(r.run_path, rep.skipped)
        if rep.set_aside:  # agreed: every rank has every node's answer
            raise only_set_aside_error(r.run_path, [f"on node {n}" for n in rep.set_aside])
        return LoadResult(0, None)
    mism = _mismatches(r, rep.manifest, rep.path)
    for m in mism:
        log.warning("resume despite mismatch (allow_mismatch): %s", m)
    load(rep.path, rep.manifest)
    if topo.is_leader:  # each node sets aside its own copy of what the agreed resume passed over
        for bad, why in rep.damaged:
            if bad > rep.step:
                set_aside_or_warn(r.run_path, bad, why, f"resume on node {topo.node_id}")
    if topo.is_leader and rep.latest_was != rep.step:
        log.warning("resume: node %s's 'latest' named %s; repaired to step %d", topo.node_id, rep.latest_was, rep.step)
        commit.write_latest(r.run_path, rep.step)
    if env.rank == 0 and brought is not None:
        log.info(
            "resumed from step %d on %d nodes, brought back from the %s tier (%s): %d files, %d bytes in %.2f s "
            "(each node what its ranks read: %s)",
            brought.step,
            topo.n_nodes,
            brought.tier,
            brought.uri,
            brought.files,
            brought.bytes_fetched,
            brought.seconds,
            "; ".join(f"node {n} {p.files} files, {p.bytes_fetched} bytes" for n, p in parts),
        )
    elif env.rank == 0:
        got: dict[tuple[str, str], list[str]] = {}
        for name, src, dst in rep.fetched:
            got.setdefault((src, dst), []).append(name)
        how = (
            "; ".join(
                f"node {dst} fetched {', '.join(sorted(n))} from node {src}" for (src, dst), n in sorted(got.items())
            )
            or "every node read its own disk"
        )
        log.info("resumed from step %d on %d nodes: %s", rep.step, topo.n_nodes, how)
    return LoadResult(rep.step, rep.path, [(s, w) for s, w in rep.skipped], mism, rep.fetched, brought=brought)


def _bring_to_nodes(
    r: Resume, held: set[int], needs: Callable[[str, Manifest], set[str]]
) -> tuple[int, Manifest, list[tuple[str, Brought]]]:
    """No node holds a checkpoint and the tiers do: the newest step whose parts every node can bring back. Each
    node's leader fetches ``.metadata`` (every byte checked) into the step's staging folder, every rank plans its
    load from it, then each leader fetches the files its node's ranks read into the step folder, committed there
    by the fetch's rename under the tiers' manifest: each node holds its part, as after a save. Every outcome is
    shared, so the ranks move to an older step together; CheckpointNotFoundError naming each failure when none
    can be brought."""
    env, topo = r.env, r.topology
    assert r.recall is not None
    recall, run_id = r.recall, os.path.basename(r.run_path)
    tried: list[str] = []
    for step in sorted(held, reverse=True):
        mine_ok = False
        stage = RENAME.staging_url(r.run_path, step)
        step_dir = os.path.join(r.run_path, layout.step_name(step))

        def plan_from(step: int = step, stage: str = stage, step_dir: str = step_dir) -> Brought:
            if os.path.lexists(step_dir):  # this node's damaged copy: set aside, not overwritten
                commit.set_aside(r.run_path, step, ["replaced by the copy on the tiers"], found_by="resume")
            remove_tree(stage)  # a crashed save's staging folder is never trusted
            return recall.bring(run_id, step, stage, only={layout.DCP_METADATA})

        failed = _failures(_on_each(env, plan_from, f"plan-{step}", here=topo.is_leader), topo)
        if not failed:
            try:  # every rank answers, failed or not: one that raised alone would leave the others in gather
                manifest = read_manifest(stage)
                with open(os.path.join(stage, layout.MANIFEST), "rb") as f:
                    which = hashlib.sha256(f.read()).hexdigest()
                answer: tuple[bool, object] = (True, (which, sorted(needs(stage, manifest))))
            except Exception as e:  # noqa: BLE001 - shared below
                answer = (False, f"rank {env.rank}: {type(e).__name__}: {e}")
            answers = gather(answer, env.ckpt_group) if env.world_size > 1 else [answer]
            failed = [str(why) for ok, why in answers if not ok]
            if not failed and len({cast(tuple, why)[0] for _, why in answers}) > 1:
                # each node fetched from the first tier whose copy verified: two tiers holding different
                # checkpoints under one step would have the nodes load different histories
                failed = [f"the nodes brought different manifests of step {step} (the tiers disagree)"]
        if not failed:
            reads = [cast(tuple, why)[1] for _, why in answers]
            mine = {f for rank in topo.domains[topo.domain] for f in reads[rank]} | {layout.DCP_METADATA}

            def part(step: int = step, stage: str = stage, step_dir: str = step_dir, mine: set[str] = mine) -> Brought:
                remove_tree(stage)
                return recall.bring(run_id, step, step_dir, only=mine)

            outcomes = _on_each(env, part, f"bring-{step}", here=topo.is_leader)
            failed = _failures(outcomes, topo)
            mine_ok = outcomes[env.rank] is not None and cast(tuple, outcomes[env.rank])[0] is not None
            if not failed:
                each = [(topo.node_ids[i], outcomes[d[0]]) for i, d in enumerate(topo.domains)]
                parts = [(node, o[0]) for node, o in each if o is not None and o[0] is not None]
                return step, manifest, parts
        tried += [f"step {step}: {why}" for why in failed]
        log.warning("resume: step %d cannot be brought back from %s: %s", step, recall.describe(), failed[0])
        if topo.is_leader:
            try:
                remove_tree(stage)
                if mine_ok:  # the part this node brought is of no use without the others' (the tiers keep it)
                    remove_tree(step_dir)
            except OSError as e:  # one leader alone must not leave the others in the next round
                log.warning("resume: could not remove what step %d's bring left on this node: %s", step, e)
    raise CheckpointNotFoundError(
        f"no node's root holds a checkpoint of {r.run_path}, and none on {recall.describe()} could be brought back "
        f"({'; '.join(tried[:6])}). Check the tiers with 'ckptflow verify' on those steps and the nodes' free space "
        f"and permissions under {r.run_path}; to start the run over instead, use a new run id"
    )


def _failures(outcomes: list[tuple[T | None, str] | None], topo: Topology) -> list[str]:
    return [
        f"node {topo.node_ids[topo.domain_of(rank)]}: {o[1]}"
        for rank, o in enumerate(outcomes)
        if o is not None and o[0] is None
    ]
