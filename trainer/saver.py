"""Asynchronous, sharded saves with one in flight, ending in an atomic commit.

``AsyncSaver.submit`` returns once the stager has started copying the state into reused CPU buffers (``sync``: once
DCP's save has run on the training thread, with no CPU copy). One long-lived thread (``_Lane``) runs DCP's save of
the copy, then the commit: each rank's digests gathered to rank 0, which commits and broadcasts the outcome (on
node-local roots, the two-level commit of ``nodes/twolevel.py``). Every checkpoint collective runs on the checkpoint
group, from the lane only, one save at a time: every rank issues them in the same order, never interleaved with
training's. See docs/architecture.md, "One save, per rank".
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import StagingOptions

from ckptflow.trainer import faults
from ckptflow.trainer.config import ASYNC_MODES
from ckptflow.trainer.dcp.planner import canonical_planner, drop_cached_plans
from ckptflow.trainer.dcp.staging import ReusingStager
from ckptflow.trainer.dcp.writer import HashingWriter
from ckptflow.trainer.errors import SaveError
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.checksum import digest_file
from ckptflow.trainer.format.commit import commit_checkpoint
from ckptflow.trainer.format.manifest import FileEntry, Manifest
from ckptflow.trainer.fsutil import remove_tree
from ckptflow.trainer.nodes.topology import Topology, single
from ckptflow.trainer.nodes.twolevel import PLACEMENT, NodeSave, placement

log = logging.getLogger(__name__)

# How long wait() gives the lane to drop a save once its outcome is known (its frame only), and close() to stop it.
_COMMIT_THREAD_EXIT_S = 30.0


def _then(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        first()
        second()

    return both


class _Lane:
    """One long-lived thread that runs each save's upload (DCP's ``save`` of the staged copy) and commit, in order.
    Not a thread per save (as DCP's ``async_save`` starts): the training thread waits for a new thread to run."""

    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None], done: Future) -> threading.Event:
        """Run ``job`` after the jobs before it; it sets the save's outcome in ``done``. The event
        is set once it has returned and the thread holds nothing of it any more."""
        if not self._thread.is_alive():
            raise SaveError("the saver's background thread has stopped (the saver was closed); no save was made")
        released = threading.Event()
        self._q.put((job, done, released))
        return released

    def _run(self) -> None:
        while True:
            job, done, released = self._q.get()
            if job is None:
                return
            try:
                job()
            except BaseException as e:  # a bug in a job: that save fails, the lane stays for the next
                log.exception("checkpoint background job failed")
                if not done.done():
                    done.set_exception(
                        SaveError(f"checkpoint background job failed: {e!r}; earlier checkpoints are untouched")
                    )
            finally:
                # The job's arguments (the staged copy, the writer) go before anyone is told.
                del job, done
                released.set()

    def close(self, timeout: float) -> None:
        """Stop the thread after the jobs already submitted (waits ``timeout`` at most)."""
        self._q.put((None, None, None))
        self._thread.join(timeout)


class _FaultingWriter(HashingWriter):
    """The data-file writer (``dcp/writer.py``) with the ``write``/``shards`` fault points (tests, chaos drills)."""

    def __init__(self, path: str, step: int, **kw: Any) -> None:
        super().__init__(path, **kw)
        self.step = step

    def write_data(self, plan, planner):  # noqa: ANN001 - DCP's signature
        faults.maybe_crash("write", self.step)
        fut = super().write_data(plan, planner)
        faults.maybe_crash("shards", self.step)
        return fut


def my_files(all_files: set[str], rank: int, world: int) -> list[str]:
    """The files this rank hashes: those DCP named after it (``__<rank>_*``), and on rank 0 any file no rank's prefix
    claims, so each is hashed exactly once. ``all_files``: from the metadata DCP returns, which all ranks agree on."""
    claimed = {f for f in all_files for r in range(world) if f.startswith(f"__{r}_")}
    mine = {f for f in all_files if f.startswith(f"__{rank}_")}
    if rank == 0:
        mine |= all_files - claimed
    return sorted(mine)


def disk_full_hint(run_path: str, need: int) -> str:
    """A hint naming a full disk when free space is below ``need`` (the last checkpoint's size; 16 MiB at
    least), else "". Checked this way because DCP's zip writer reports ENOSPC as an opaque ``unexpected pos``."""
    try:
        free = shutil.disk_usage(run_path if os.path.exists(run_path) else os.path.dirname(run_path)).free
    except OSError:
        return ""
    if free >= max(need, 16 << 20):
        return ""
    return (
        f" (the disk is full: the file system holding {run_path} has {free} bytes free, the last "
        f"checkpoint took {need}; free space, e.g. `ckptflow prune`, then resume)"
    )


def _entry(writer: HashingWriter, name: str) -> FileEntry:
    """A file's manifest entry: the digest the writer took as it wrote the file, else (``.metadata``) one read."""
    path = os.path.join(writer.path, name)
    d = writer.digests.get(name)
    if d is None or os.stat(path).st_size != d.size:
        d = digest_file(path)
    return FileEntry(d.size, d.hexdigest(), d.block, d.blocks())


@dataclass
class SaveRequest:
    step: int
    run_path: str
    build_manifest: Callable[[dict[str, FileEntry]], Manifest]
    """Called on rank 0 with every rank's file entries; returns the manifest to commit."""
    on_committed: Callable[[Manifest, str], None] | None = None
    """Called on rank 0 after the commit (outbox + event), still in the background."""


@dataclass
class SaveTiming:
    step: int
    blocked_s: float = 0.0
    staged_s: float = 0.0
    persisted_s: float = 0.0
    committed_s: float = 0.0
    bytes: int = 0
    extra: dict = field(default_factory=dict)


class AsyncSaver:
    """One rank's save engine. Public calls come from the training thread only."""

    def __init__(
        self,
        *,
        rank: int,
        ckpt_group: dist.ProcessGroup,
        mode: str = "async_staging",
        writer_threads: int = 1,
        topology: Topology | None = None,
        replicas: int = 2,
        timeout_s: float = 600.0,
    ) -> None:
        if mode not in ASYNC_MODES:
            raise ValueError(f"async mode {mode!r} is unknown; choose one of {ASYNC_MODES}")
        self.rank = rank
        self.group = ckpt_group
        self.topology = topology or single(rank, dist.get_world_size(ckpt_group))
        """Who shares the hot root: one root (rank 0 commits) or node-local roots (two-level commit)."""
        self.replicas = replicas
        self.timeout_s = timeout_s
        self._last_bytes = 0  # size of the last committed checkpoint: what the next one needs
        self.mode = mode
        self.writer_threads = writer_threads
        # Reused across saves: its CPU buffers are allocated once, then copied into.
        self._stager = (
            ReusingStager(
                StagingOptions(
                    use_pinned_memory=False,
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=False,
                )
            )
            if mode == "async_staging"
            else None
        )
        self._staging: Future | None = None
        self._done: Future | None = None
        self._released: threading.Event | None = None  # the lane holds nothing of the last save
        self._lane = _Lane("ckptflow-commit")
        self._plan_key = f"ckptflow-saver-{uuid.uuid4().hex}"
        """This saver's entry in DCP's plan cache (``canonical_planner``)."""

    # -- called by the manager on the training thread -------------------------------
    def submit(self, state: dict[str, Any], req: SaveRequest) -> SaveTiming:
        """Start saving ``state``; returns once training may continue."""
        self.wait()  # one save in flight: the previous must be committed (or failed)
        timing = SaveTiming(req.step)
        tmp = os.path.join(req.run_path, layout.tmp_name(req.step))
        os.makedirs(tmp, exist_ok=True)
        writer = _FaultingWriter(
            tmp,
            req.step,
            thread_count=self.writer_threads,
            sync_files=True,
        )
        t0 = time.perf_counter()
        upload: Future = Future()
        upload_job: Callable[[], None] | None = None  # DCP's save, to run on the lane first
        if self.mode == "sync":
            try:
                upload.set_result(self._dcp_save(state, writer))
            except BaseException as e:  # DCP's CheckpointException derives from BaseException
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                upload.set_exception(e)  # the commit reports it as a SaveError
            timing.blocked_s = timing.staged_s = time.perf_counter() - t0
        else:
            # dcp.async_save with async staging, but the upload runs on the lane, not on a thread started for it.
            assert self._stager is not None
            staging = self._stager.stage(state)
            assert isinstance(staging, Future)  # DefaultStager with use_async_staging: always a Future
            self._staging = staging
            staging.add_done_callback(lambda _f: setattr(timing, "staged_s", time.perf_counter() - t0))
            upload_job = functools.partial(self._upload, staging, writer, upload)
            timing.blocked_s = time.perf_counter() - t0
            faults.maybe_crash("staging", req.step)  # the staged copy is being made in the background
        done: Future = Future()
        self._done = done
        commit_job = functools.partial(self._commit, upload, writer, req, timing, t0, done)
        self._released = self._lane.submit(commit_job if upload_job is None else _then(upload_job, commit_job), done)
        return timing

    def _upload(self, staging: Future, writer: _FaultingWriter, upload: Future) -> None:
        """DCP's save of the staged copy (on the lane, once staging is done); its outcome goes into ``upload``."""
        try:
            upload.set_result(self._dcp_save(staging.result(), writer))
        except BaseException as e:  # DCP's CheckpointException derives from BaseException
            upload.set_exception(e)  # the commit reports it as a SaveError

    def _dcp_save(self, state: dict[str, Any], writer: _FaultingWriter) -> Any:
        """DCP's save on the checkpoint group, with this saver's cached plans; returns DCP's metadata."""
        return dcp.save(
            state, storage_writer=writer, process_group=self.group, planner=canonical_planner(self._plan_key)
        )

    def wait_for_staging(self) -> None:
        """Block until the staged copy exists (call before mutating model/optimizer state)."""
        if self._staging is not None:
            try:
                self._staging.result()
            finally:
                self._staging = None

    def wait(self) -> None:
        """Block until the in-flight save is committed; raise ``SaveError`` if it failed."""
        self.wait_for_staging()
        if self._done is not None:
            done, self._done = self._done, None
            try:
                done.result()
            finally:
                self._wait_released()

    def _wait_released(self) -> None:
        # The outcome is set before the lane drops the save's frame (staged copy, writer). Waiting means no thread
        # is still freeing tensors when the caller tears down process groups or the interpreter: a daemon thread
        # caught in C++ by interpreter finalization aborts the process (SIGABRT). Bounded: only that frame is left.
        released, self._released = self._released, None
        if released is not None:
            released.wait(timeout=_COMMIT_THREAD_EXIT_S)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._lane.close(_COMMIT_THREAD_EXIT_S)
            drop_cached_plans(self._plan_key)
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    # -- background ------------------------------------------------------------------
    def _commit(
        self,
        upload: Future,
        writer: _FaultingWriter,
        req: SaveRequest,
        timing: SaveTiming,
        t0: float,
        done: Future,
    ) -> None:
        try:
            gathered = self._gather_entries(upload, writer, req, timing, t0)
            if self.topology.scope == "node":
                self._commit_nodes(gathered, req, timing)
            else:
                self._commit_shared(gathered, req, timing)
            timing.committed_s = time.perf_counter() - t0
            self._last_bytes = timing.bytes
            done.set_result(timing)
        except BaseException as e:  # surface on the training thread at the next wait()
            if not isinstance(e, SaveError):
                e = SaveError(
                    f"checkpoint of step {req.step} in {req.run_path} failed: {e!r}"
                    f"{disk_full_hint(req.run_path, self._last_bytes)}; "
                    "earlier checkpoints are untouched"
                )
            done.set_exception(e)

    @contextmanager
    def _phase(self, req: SaveRequest, name: str) -> Iterator[None]:
        """A failed collective of the two-level commit (peer gone, link down) becomes a SaveError naming this node
        and phase, logged at once: the training thread may die of its own collective's timeout before seeing it."""
        try:
            yield
        except BaseException as e:
            err = self._not_committed(
                req, f"node {self.topology.node_id} (rank {self.rank}), phase {name} of the two-level commit: {e!r}"
            )
            log.error("%s", err)
            raise err from e

    def _not_committed(self, req: SaveRequest, detail: str) -> SaveError:
        return SaveError(
            f"checkpoint of step {req.step} in {req.run_path} was not committed: "
            f"{detail}{disk_full_hint(req.run_path, self._last_bytes)}; earlier checkpoints are untouched"
        )

    def _gather_entries(
        self, upload: Future, writer: _FaultingWriter, req: SaveRequest, timing: SaveTiming, t0: float
    ) -> list | None:
        """Phases 1-2: wait for DCP, hash this rank's files, gather everyone's entries on rank 0."""
        err: BaseException | None = None
        referenced: set[str] = set()
        try:
            referenced = writer.referenced(upload.result())
        except BaseException as e:  # DCP's CheckpointException derives from BaseException
            err = e
        timing.persisted_s = time.perf_counter() - t0
        # Every rank reaches the gather, failed or not, so no rank waits forever.
        entries: dict[str, FileEntry] = {}
        if err is None:
            try:
                world = dist.get_world_size(self.group)
                names = my_files(referenced, self.rank, world)
                if self.rank == 0:
                    names.append(layout.DCP_METADATA)
                    faults.maybe_crash("after_shards", req.step)
                for n in names:
                    entries[n] = _entry(writer, n)
            except OSError as e:
                err = e
        gathered: list | None = [None] * dist.get_world_size(self.group) if self.rank == 0 else None
        dist.gather_object((entries, repr(err) if err else None, sorted(referenced)), gathered, dst=0, group=self.group)
        return gathered

    def _commit_shared(self, gathered: list | None, req: SaveRequest, timing: SaveTiming) -> None:
        """One root for all ranks: rank 0 commits for everyone, then tells them."""
        outcome: list = [None]
        if self.rank == 0:
            assert gathered is not None  # allocated on rank 0 by _gather_entries
            outcome[0] = self._coordinate(gathered, req)
        dist.broadcast_object_list(outcome, src=0, group=self.group)
        status, detail = outcome[0]
        if status != "ok":
            raise self._not_committed(req, detail)
        timing.bytes = int(detail)

    def _commit_nodes(self, gathered: list | None, req: SaveRequest, timing: SaveTiming) -> None:
        """Node-local roots: the two-level commit of ``trainer/nodes/twolevel.py``, phases 3-8."""
        ns = NodeSave(self.topology, req.run_path, req.step, self.group, timeout_s=self.timeout_s)
        box: list = [None]
        if self.rank == 0:
            assert gathered is not None  # allocated on rank 0 by _gather_entries
            box[0] = self._build_node_manifest(gathered, req)
        with self._phase(req, "3, the manifest's broadcast"):
            dist.broadcast_object_list(box, src=0, group=self.group)
        if box[0][0] != "ok":
            ns.discard()
            raise self._not_committed(req, box[0][1])
        _, manifest_bytes, metadata = box[0]
        manifest = Manifest.from_json(manifest_bytes, source=f"step {req.step}'s manifest from rank 0")
        tr = time.perf_counter()
        with self._phase(req, "4-5, replication"):
            problems = ns.decide(ns.replicate(manifest))
        timing.extra["replicate_s"] = time.perf_counter() - tr
        if not problems:
            with self._phase(req, "6-7, the decision"):
                problems = ns.decide(ns.prepare(manifest_bytes, metadata))
        if problems:
            ns.discard()
            raise self._not_committed(
                req, "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else "")
            )
        final = ns.commit()
        timing.bytes = manifest.total_bytes
        timing.extra["replicated_bytes"] = ns.replicated_bytes
        if self.rank == 0:
            self._announce(req, manifest, final)

    def _checked_files(self, gathered: list) -> tuple[dict[str, FileEntry] | None, str, dict[str, int]]:
        """Every rank's entries merged, or why not: (files, problem, file -> the rank that wrote it)."""
        errors = [f"rank {r}: {e}" for r, (_, e, _) in enumerate(gathered) if e]
        if errors:
            return None, "; ".join(errors), {}
        files: dict[str, FileEntry] = {}
        owners: dict[str, int] = {}
        for r, (ents, _, _) in enumerate(gathered):
            files.update(ents)
            owners.update(dict.fromkeys(ents, r))
        # A file DCP references but the manifest misses would go unverified (and uncopied): refuse to commit.
        missing = (set(gathered[0][2]) | {layout.DCP_METADATA}) - set(files)
        if missing:
            return None, f"no checksum for {sorted(missing)} (a rank did not hash its files)", {}
        return files, "", owners

    def _build_node_manifest(self, gathered: list, req: SaveRequest) -> tuple:
        """Rank 0, node-local roots: the manifest with its placement, and ``.metadata``'s bytes."""
        files, problem, owners = self._checked_files(gathered)
        if files is None:
            return "failed", problem
        try:
            manifest = req.build_manifest(files)
            manifest.extra[PLACEMENT] = placement(self.topology, owners, self.replicas)
            with open(os.path.join(req.run_path, layout.tmp_name(req.step), layout.DCP_METADATA), "rb") as f:
                metadata = f.read()
            return "ok", manifest.to_json(), metadata
        except Exception as e:
            return "failed", f"manifest: {e!r}"

    def _coordinate(self, gathered: list, req: SaveRequest) -> tuple[str, Any]:
        """Rank 0, one shared root: build the manifest from every rank's entries and commit."""
        files, problem, _ = self._checked_files(gathered)
        if files is None:
            self._discard_tmp(req)
            return "failed", problem
        try:
            manifest = req.build_manifest(files)
            final = commit_checkpoint(req.run_path, manifest)
        except Exception as e:
            self._discard_tmp(req)
            return "failed", f"commit: {e!r}"
        self._announce(req, manifest, final)
        return "ok", manifest.total_bytes

    @staticmethod
    def _announce(req: SaveRequest, manifest: Manifest, final: str) -> None:
        """Rank 0, after the commit: ``req.on_committed`` (outbox line, event)."""
        if req.on_committed is None:
            return
        try:
            req.on_committed(manifest, final)
        except Exception as e:  # committed is committed; reconcile finds it on storage
            log.warning("step %d committed but its outbox/event failed: %r", req.step, e)

    @staticmethod
    def _discard_tmp(req: SaveRequest) -> None:
        # Every rank has finished writing (all reached the gather), so the partial dir can go now.
        try:
            remove_tree(os.path.join(req.run_path, layout.tmp_name(req.step)))
        except OSError as e:
            log.warning("could not remove the failed save's .tmp dir: %s", e)
