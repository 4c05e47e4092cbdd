"""Resume: the newest checkpoint every rank can load, loaded, with fallback past damaged ones.

One shared root: candidates newest first (``resume.py``), each verified as it is read (``loader.py``); one
that fails on any rank fails on all, and they try the next older one together. Node-local roots: the nodes
agree on the newest recoverable step, each fetches what it lacks from a peer's replica (``nodes/``), then the
same load. Mismatched provenance is refused unless allowed; a wrong ``latest`` is repaired.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from ckptflow.trainer.config import Provenance
from ckptflow.trainer.distenv import DistEnv
from ckptflow.trainer.errors import IntegrityError, LoadError
from ckptflow.trainer.format import commit
from ckptflow.trainer.format.manifest import Manifest
from ckptflow.trainer.loader import Reshard, files_read, load_target, load_verified
from ckptflow.trainer.nodes.topology import Topology
from ckptflow.trainer.nodes.twolevel import not_recoverable_error, resume_point
from ckptflow.trainer.resume import check_provenance, find_resume_point, no_checkpoint_error, only_set_aside_error
from ckptflow.trainer.state import TrainState

__all__ = ["LoadResult", "Resume", "resume"]

log = logging.getLogger(__name__)


@dataclass
class LoadResult:
    step: int
    path: str | None
    skipped: list[tuple[str, str]] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    fetched: list[tuple[str, str, str]] = field(default_factory=list)
    """Node-local roots: (file, from node, to node) for every file brought over the network."""


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
    skipped: list[tuple[str, str]] = []
    damaged: list[tuple[int, str]] = []
    after: int | None = None
    mism: list[str] = []
    while True:
        # Cheap checks here (manifest, files present with their sizes); the load verifies every byte as it
        # reads, and a mismatch fails it on every rank, so all move on to the next older one together.
        rep = find_resume_point(
            r.run_path, rank=env.rank, world=env.world_size, group=env.ckpt_group, deep=False, after=after
        )
        skipped += [x for x in rep.skipped if x not in skipped]
        damaged += [x for x in rep.damaged if x not in damaged]
        if rep.chosen is None:
            break
        mism = _mismatches(r, rep.chosen.manifest, rep.chosen.path)
        try:
            load(rep.chosen.path, rep.chosen.manifest)
            break
        except IntegrityError as e:  # every rank failed it (load_local agrees): the next older one, together
            skipped.append((rep.chosen.path, str(e)))
            if not isinstance(e, LoadError):  # bytes that differ from the manifest: damage
                damaged.append((rep.chosen.step, str(e)))
            after = rep.chosen.step
    for path, why in skipped:
        if env.rank == 0:
            log.warning("resume: skipping %s: %s", path, why)
    if rep.chosen is None:
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
        for step, why in damaged:
            if step > rep.chosen.step:
                _set_aside(r.run_path, step, why, "resume")
        if rep.latest_was != rep.chosen.step:
            log.warning("resume: 'latest' named %s; repaired to step %d", rep.latest_was, rep.chosen.step)
            commit.write_latest(r.run_path, rep.chosen.step)
        log.info("resumed from %s (step %d)", rep.chosen.path, rep.chosen.step)
    return LoadResult(rep.chosen.step, rep.chosen.path, skipped, mism)


def _set_aside(run_path: str, step: int, why: str, found_by: str) -> None:
    """Best effort, after the load: the other ranks have gone on to train, and a failure here (a folder this
    user may not write) must not end this rank alone. A step left in place is set aside when it is saved again
    (``commit.rename_then_latest``) or at the next resume."""
    try:
        commit.set_aside(run_path, step, [why], found_by=found_by)
    except OSError as e:
        log.warning("resume: could not set %s aside (%s); it stays where it is, not resumed from", step, e)


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
                _set_aside(r.run_path, bad, why, f"resume on node {topo.node_id}")
    if topo.is_leader and rep.latest_was != rep.step:
        log.warning("resume: node %s's 'latest' named %s; repaired to step %d", topo.node_id, rep.latest_was, rep.step)
        commit.write_latest(r.run_path, rep.step)
    if env.rank == 0:
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
    return LoadResult(rep.step, rep.path, [(s, w) for s, w in rep.skipped], mism, rep.fetched)
