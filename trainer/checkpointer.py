"""``CheckpointManager``: three calls in a training loop.

    ckpt = CheckpointManager(cfg, model=model, optimizer=opt, scheduler=sched, sampler=sampler,
                             provenance=Provenance(config=train_cfg, data_fingerprint=fp))
    start = ckpt.load()                      # 0 when starting fresh
    for step in range(start + 1, max_steps + 1):
        ...train one step...
        ckpt.save(step, {"loss": loss, "lr": lr}, force=(step == max_steps))
    ckpt.close()

The manager owns the interval, the async mode, the commit, resume with fallback,
and the commit event. Public methods check ``enabled`` once, then call their
``_``-prefixed implementation (``_load``, ``_save``), so the guard is in one place.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ckptflow.trainer import commit, events, layout
from ckptflow.trainer.checksum import hash_bytes
from ckptflow.trainer.distenv import DistEnv, init_distributed
from ckptflow.trainer.errors import ConfigError, IntegrityError, SaveError
from ckptflow.trainer.interval import AutoInterval
from ckptflow.trainer.loader import Reshard, files_read, load_target, load_verified
from ckptflow.trainer.manifest import FileEntry, Manifest
from ckptflow.trainer.nodes import not_recoverable_error, recover, resume_point
from ckptflow.trainer.probe import NextStepLoss, fixed_batch_record, next_step_record, none_recorded
from ckptflow.trainer.resume import check_provenance, find_resume_point, no_checkpoint_error
from ckptflow.trainer.saver import ASYNC_MODES, AsyncSaver, SaveRequest
from ckptflow.trainer.state import LAYOUT, build_save_state, rank_state, shared_state
from ckptflow.trainer.topology import SCOPES, Topology, discover, single

log = logging.getLogger(__name__)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    root: str
    """Hot-tier root folder (local NVMe); the run lives in ``<root>/<run_id>/``."""
    run_id: str
    """Names the run on every tier; [A-Za-z0-9._-]."""
    interval: int | str = 100
    """Save every ``interval`` steps (``save(..., force=True)`` saves regardless), or ``"auto"``:
    the manager picks the interval from the stall, persist time and step time it measures and
    ``mtbf_hours``, and re-evaluates it at every save (``trainer/interval.py``)."""
    mtbf_hours: float | None = None
    """``interval="auto"``: the job's mean time between failures, in hours (required there)."""
    auto_first_interval: int = 10
    """``interval="auto"``: steps to the first save, before anything is measured."""
    auto_min_interval: int = 1
    auto_max_interval: int = 1_000_000
    """``interval="auto"``: bounds on the interval it picks, in steps."""
    async_mode: str = "async_staging"
    """``async_staging`` (default): the state is copied to CPU buffers in the background and
    written from there, training blocked only while the copy starts. ``sync``: ``dcp.save`` on the
    training thread, which blocks for the whole write (14-22x the copy) but holds no CPU copy of
    the state — for a host without the memory for one."""
    enabled: bool = True
    """False turns every call into a no-op (load returns 0)."""
    resume: str = "auto"
    """``auto``: resume if a checkpoint exists; ``never``; ``required``: fail if none verifies."""
    allow_mismatch: bool = False
    """Resume even if the config hash or data fingerprint differs (logged loudly)."""
    on_save_error: str = "raise"
    """``raise``: a failed save stops training; ``continue``: log it and train on."""
    writer_threads: int = 1
    """DCP writer threads per rank."""
    direct_io: bool = False
    """Write the data files past the page cache (``O_DIRECT``, ``trainer/directio.py``), buffered
    where the file system refuses it. Off by default: on recycled page-cache pages it took the
    same CPU and longer wall time than buffered writes; it halved the persist threads' CPU only on
    a VM that backs guest pages lazily (docs/benchmarks.md, "Direct writes"). It also keeps
    checkpoints from crowding training data out of the page cache, at the price of a restart on
    the same node reading the checkpoint from the device."""
    emit_events: bool = True
    """Send ``ckptflow.checkpoint.committed`` to Prefect when PREFECT_API_URL is set."""
    event_exit_budget_s: float = 1.0
    """Longest ``close()`` waits for undelivered events (the outbox keeps them anyway)."""
    hot_scope: str = "auto"
    """Whether ``root`` is one folder all ranks share or each node's own disk. ``auto`` finds out
    at start-up (``trainer/topology.py``); ``shared`` or ``node`` say what to expect, and a
    start-up that finds otherwise fails with the reason. Node-local roots commit in two levels
    (``trainer/nodes.py``)."""
    replicas: int = 2
    """Node-local roots: how many nodes hold each shard file — the node that wrote it and the
    next ones on a ring — so a lost node loses no checkpoint. 1 turns replication off."""

    def __post_init__(self) -> None:
        layout.check_run_id(self.run_id)
        if self.hot_scope not in SCOPES:
            raise ConfigError(f"CheckpointConfig.hot_scope={self.hot_scope!r}; choose one of {', '.join(SCOPES)}")
        if not isinstance(self.replicas, int) or isinstance(self.replicas, bool) or self.replicas < 1:
            raise ConfigError(f"CheckpointConfig.replicas={self.replicas!r} must be an integer >= 1 (1: no replicas)")
        if self.interval == "auto":
            m = self.mtbf_hours
            if not isinstance(m, (int, float)) or isinstance(m, bool) or not (m > 0 and m < float("inf")):
                raise ConfigError(
                    f"CheckpointConfig(interval='auto') needs mtbf_hours, the job's mean time between "
                    f"failures in hours (> 0); got {m!r}"
                )
            for name in ("auto_first_interval", "auto_min_interval", "auto_max_interval"):
                v = getattr(self, name)
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ConfigError(f"CheckpointConfig.{name}={v!r} must be an integer >= 1")
            if self.auto_min_interval > self.auto_max_interval:
                raise ConfigError(
                    f"CheckpointConfig.auto_min_interval={self.auto_min_interval} > "
                    f"auto_max_interval={self.auto_max_interval}"
                )
        elif not isinstance(self.interval, int) or isinstance(self.interval, bool) or self.interval < 1:
            raise ConfigError(f"CheckpointConfig.interval={self.interval!r} must be an integer >= 1 or 'auto'")
        elif self.mtbf_hours is not None:
            raise ConfigError(
                f"CheckpointConfig.mtbf_hours={self.mtbf_hours!r} is used only with interval='auto' "
                f"(interval={self.interval} is fixed); drop it or set interval='auto'"
            )
        if self.async_mode not in ASYNC_MODES:
            raise ConfigError(f"CheckpointConfig.async_mode={self.async_mode!r}; choose one of {ASYNC_MODES}")
        if self.resume not in ("auto", "never", "required"):
            raise ConfigError(f"CheckpointConfig.resume={self.resume!r}; choose auto, never or required")
        if self.on_save_error not in ("raise", "continue"):
            raise ConfigError(f"CheckpointConfig.on_save_error={self.on_save_error!r}; choose raise or continue")


@dataclass(kw_only=True)
class Provenance:
    config: dict[str, Any]
    """The training config; its hash must match on resume (exclude resume-safe keys)."""
    data_fingerprint: str
    """Identifies the data set and its order; must match on resume."""
    code_version: str | None = None
    """Defaults to ``git describe`` of the working directory, else the package version."""

    @property
    def config_hash(self) -> str:
        import json

        return hash_bytes(json.dumps(self.config, sort_keys=True, default=str).encode())


@dataclass(kw_only=True)
class SanitySpec:
    """What a later sanity step needs: how to rebuild the model, and a probe."""

    builder: str
    """``module:function`` that rebuilds (model, optimizer, scheduler) from ``config``."""
    config: dict[str, Any]
    probe_tokens: list
    """A small fixed batch, stored in the manifest."""
    probe_fn: Callable[[], float]
    """Computes the probe loss now (all ranks call it; eval mode, no grad), on the training thread
    at every save."""
    reference: str = "probe"
    """The loss the sanity step must reproduce. ``probe`` (default): ``probe_fn`` on the fixed
    probe batch at save time. ``next_step``: the loss the loop computes anyway at the first step after the
    save, handed over with ``CheckpointManager.observe_loss(step, loss)`` — no extra forward pass
    at all (``trainer/probe.py``, ``NextStepLoss``). It needs a builder whose ``Built`` can
    replay that step: ``replay_sampler(world_size)`` (rank 0's data at the saving world size)
    and ``replay_loss(sampler)`` (the loop's forward, train mode, on its next batch); the
    reference builder has both."""
    next_step_timeout_s: float = 300.0
    """``next_step``: how long rank 0's commit waits for that loss before it commits without one."""

    def __post_init__(self) -> None:
        if self.reference not in REFERENCES:
            raise ConfigError(f"SanitySpec.reference={self.reference!r}; choose one of {', '.join(REFERENCES)}")
        if not self.next_step_timeout_s > 0:
            raise ConfigError(f"SanitySpec.next_step_timeout_s={self.next_step_timeout_s!r} must be > 0")


REFERENCES = ("probe", "next_step")


def code_version() -> str:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--tags"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=os.getcwd(),
        )
        if out.returncode == 0 and out.stdout.strip():
            return "git:" + out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    from importlib.metadata import PackageNotFoundError, version

    try:
        return "ckptflow " + version("ckptflow")
    except PackageNotFoundError:
        return "unknown"


@dataclass
class LoadResult:
    step: int
    path: str | None
    skipped: list[tuple[str, str]] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    fetched: list[tuple[str, str, str]] = field(default_factory=list)
    """Node-local roots: (file, from node, to node) for every file brought over the network."""


def _agree(cfg: CheckpointConfig, env: DistEnv) -> None:
    """Every rank must run with the same checkpoint settings: a rank that saves at another
    interval or into another run would send the others into mismatched collectives."""
    if env.world_size == 1:
        return
    mine = (
        cfg.run_id,
        cfg.interval,
        cfg.async_mode,
        cfg.hot_scope,
        cfg.replicas,
        (cfg.mtbf_hours, cfg.auto_first_interval, cfg.auto_min_interval, cfg.auto_max_interval),
    )
    every: list[Any] = [None] * env.world_size
    dist.all_gather_object(every, mine, group=env.ckpt_group)
    if any(e != every[0] for e in every):
        diff = {r: e for r, e in enumerate(every) if e != every[0]}
        raise ConfigError(
            f"ranks disagree on the checkpoint settings (run_id, interval, async_mode, hot_scope, "
            f"replicas, auto-interval settings): rank 0 has {every[0]}, but {diff}; start every rank with the same"
        )


class CheckpointManager:
    def __init__(
        self,
        cfg: CheckpointConfig,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        provenance: Provenance,
        scheduler: Any = None,
        scaler: Any = None,
        sampler: Stateful | None = None,
        extra: Stateful | None = None,
        sanity: SanitySpec | None = None,
        env: DistEnv | None = None,
        reshard_state: Reshard | None = None,
    ) -> None:
        self.cfg = cfg
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.sampler, self.extra, self.sanity, self.provenance = sampler, extra, sanity, provenance
        self.reshard_state = reshard_state
        """Resuming at another world size: ``fn(name, saved_states, rank, world) -> state`` for a sampler or
        ``extra`` state that differed between the saving ranks (``trainer/loader.py``)."""
        self.env = env or init_distributed()
        self.run_path = os.path.abspath(layout.run_dir(cfg.root, cfg.run_id))
        self.last_load: LoadResult | None = None
        self._code_version = provenance.code_version or code_version()
        self._sender = events.EventSender() if cfg.emit_events else events.EventSender(api_url="")
        self._saver: AsyncSaver | None = None
        self._timings: list = []
        self._hook = None
        self._auto: AutoInterval | None = None
        self._next_ref: NextStepLoss | None = None  # SanitySpec.reference="next_step": the pending one
        self.topology: Topology = single(self.env.rank, self.env.world_size)
        if not cfg.enabled:
            return
        group = self.env.ckpt_group
        os.makedirs(self.run_path, exist_ok=True)  # every rank: on node-local roots every node needs it
        _agree(cfg, self.env)
        self.topology = discover(
            os.path.abspath(cfg.root),
            self.run_path,
            rank=self.env.rank,
            world=self.env.world_size,
            group=group,
            requested=cfg.hot_scope,
        )
        if self.topology.scope == "node":
            if self.env.rank == 0:
                log.info(
                    "node-local hot roots: %s; %d replica(s) per shard",
                    self.topology.describe(),
                    min(cfg.replicas, self.topology.n_nodes),
                )
            recover(self.run_path, self.topology, group)
        else:
            if self.env.rank == 0:
                commit.clean_stale_tmp(self.run_path)
            dist.barrier(group=group)
        if cfg.interval == "auto":
            assert cfg.mtbf_hours is not None  # __post_init__ checked it
            self._auto = AutoInterval(
                mtbf_s=float(cfg.mtbf_hours) * 3600.0,
                first=cfg.auto_first_interval,
                min_steps=cfg.auto_min_interval,
                max_steps=cfg.auto_max_interval,
                rank=self.env.rank,
                world=self.env.world_size,
                group=group,
                run_path=self.run_path,
            )
        self._saver = saver = AsyncSaver(
            rank=self.env.rank,
            ckpt_group=group,
            mode=cfg.async_mode,
            writer_threads=cfg.writer_threads,
            direct_io=cfg.direct_io,
            topology=self.topology,
            replicas=cfg.replicas,
        )
        # Snapshot consistency: the staged copy must exist before parameters change.
        # (close() removes the hook before it drops the saver, so the hook always sees this one.)
        self._hook = optimizer.register_step_pre_hook(lambda *_a, **_k: self._before_optimizer_step(saver))

    # -- public API -------------------------------------------------------------------
    def load(self) -> int:
        """Resume from the newest committed checkpoint that verifies; returns its step (0: fresh)."""
        if not self.cfg.enabled or self.cfg.resume == "never":
            return 0
        t0 = time.perf_counter()
        step = self._load().step
        if self._auto is not None:
            self._auto.restore_s = time.perf_counter() - t0
            self._auto.start_at(step)
        return step

    @property
    def interval(self) -> int:
        """The save interval in steps now (with ``interval="auto"``, the latest it chose)."""
        return self._auto.interval if self._auto is not None else int(self.cfg.interval)

    @property
    def interval_decisions(self) -> list:
        """``interval="auto"``: every change it made (``trainer.interval.Decision``), oldest first."""
        return list(self._auto.decisions) if self._auto is not None else []

    def save(self, step: int, metrics: dict[str, float] | None = None, *, force: bool = False) -> bool:
        """Save the state after ``step`` if the interval (or ``force``) says so. Returns True if started.

        With ``interval="auto"`` call it after every step: the time between calls is how the
        manager measures the step and the stall."""
        if not self.cfg.enabled:
            return False
        auto = self._auto
        if auto is not None:
            auto.tick(step)
            due = auto.due(step)
        else:
            due = step % int(self.cfg.interval) == 0
        if not force and not due:
            return False
        # The previous save first (submit would wait for it anyway): its commit thread runs
        # collectives on the checkpoint group, and so does the interval agreement below — one
        # thread at a time on that group. A failed previous save is
        # reported here and this one still starts.
        self.wait()
        if auto is not None:
            # Every rank is here at this step (same interval, same step): agree on the next one.
            auto.plan(step, self._timings)
        try:
            self._save(step, dict(metrics or {}))
            return True
        except SaveError as e:
            return self._handle_save_error(e)
        finally:
            if auto is not None:
                auto.saved(step)

    def observe_loss(self, step: int, loss: float | torch.Tensor) -> None:
        """This rank's loss of training step ``step`` as the loop computed it (before any all-reduce).

        With ``SanitySpec(reference="next_step")`` call it every step, after the forward pass and
        before ``optimizer.step()``: the first step after a save is that checkpoint's sanity
        reference. Every other call returns before it looks at ``loss`` (no device sync)."""
        ref = self._next_ref
        if ref is None or step != ref.step + 1 or ref.done():
            return
        value = loss.detach() if isinstance(loss, torch.Tensor) else loss  # float() of a grad tensor warns
        ref.settle(next_step_record(float(value), self.env.world_size))

    def wait(self) -> None:
        """Block until the in-flight save is committed."""
        self._settle_reference("a wait for the commit came before the loss of the next step")
        if self._saver is not None:
            try:
                self._saver.wait()
            except SaveError as e:
                self._handle_save_error(e)

    def close(self) -> None:
        """Finish the in-flight save, release buffers, flush events (bounded)."""
        try:
            self._reference_at_close()
            if self._saver is not None:
                try:
                    self._saver.close()
                except SaveError as e:
                    self._handle_save_error(e)
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            self._saver = None
            self._sender.close()

    @property
    def save_timings(self):
        """Per-save timings (blocked, staged, persisted, committed seconds), kept after close()."""
        return self._timings

    # -- implementation -------------------------------------------------------------------
    def _handle_save_error(self, e: SaveError) -> bool:
        if self.cfg.on_save_error == "raise":
            raise e
        # Training goes on; the previous committed checkpoint stays the resume point.
        log.error("%s (on_save_error=continue: training goes on)", e)
        return False

    def _save(self, step: int, metrics: dict[str, float]) -> None:
        state = build_save_state(
            model=self.model,
            optimizer=self.optimizer,
            rank=self.env.rank,
            train=shared_state(step, scheduler=self.scheduler, scaler=self.scaler),
            per_rank=rank_state(sampler=self.sampler, extra=self.extra),
        )
        next_step = self.sanity is not None and self.sanity.reference == "next_step"
        live = self.sanity.probe_fn() if self.sanity is not None and not next_step else None
        ref: NextStepLoss | None = None
        if next_step:
            self._next_ref = ref = NextStepLoss(step)
        # The LR a resumed run will use first; the sanity step checks the restored
        # scheduler reproduces it.
        next_lr = float(self.scheduler.get_last_lr()[0]) if self.scheduler is not None else None

        def build(files: dict[str, FileEntry]) -> Manifest:
            if ref is not None:  # rank 0's commit thread: the loss of step N+1, usually there already
                assert self.sanity is not None
                return self._manifest(step, files, metrics, next_lr, ref.wait(self.sanity.next_step_timeout_s))
            return self._manifest(step, files, metrics, next_lr, self._fixed_probe(live))

        req = SaveRequest(step=step, run_path=self.run_path, build_manifest=build, on_committed=self._on_committed)
        assert self._saver is not None  # save() gets here only when cfg.enabled, and then __init__ made the saver
        self._timings.append(self._saver.submit(state, req))

    def _before_optimizer_step(self, saver: AsyncSaver) -> None:
        """The optimizer pre-hook: the staged copy must exist before the parameters change, and a
        next-step reference that has not arrived by now never will."""
        saver.wait_for_staging()
        self._settle_reference("optimizer.step() ran before observe_loss() gave the loss of the step after the save")

    def _settle_reference(self, reason: str) -> None:
        ref = self._next_ref
        if ref is not None and not ref.done():
            if ref.settle(none_recorded(f"{reason} (step {ref.step})")) and self.env.rank == 0:
                log.warning("step %d: no sanity reference loss recorded: %s", ref.step, reason)

    def _reference_at_close(self) -> None:
        """No step after the last save (the run ended): the model still holds that step's
        parameters, so the fixed probe batch gives its reference — every rank runs the probe
        together (a collective under FSDP), so they agree first, on the training group."""
        ref, self._next_ref = self._next_ref, None
        if ref is None or self.sanity is None:
            return
        pending = [not ref.done()]
        if self.env.world_size > 1:
            pending = [None] * self.env.world_size  # type: ignore[list-item]
            dist.all_gather_object(pending, not ref.done())
        if any(pending):
            loss = self.sanity.probe_fn()
            ref.settle(fixed_batch_record(loss, self.sanity.probe_tokens, "live_model_at_close"))

    def _fixed_probe(self, loss: float | None) -> dict[str, Any]:
        """The manifest's probe record of the fixed-batch probe; empty without a SanitySpec."""
        if self.sanity is None or loss is None:
            return {}
        return fixed_batch_record(loss, self.sanity.probe_tokens, "live_model")

    def _manifest(
        self, step: int, files: dict[str, FileEntry], metrics: dict, next_lr: float | None, probe: dict[str, Any]
    ) -> Manifest:
        sanity: dict[str, Any] = {}
        if self.sanity is not None:
            sanity = {
                "builder": self.sanity.builder,
                "config": self.sanity.config,
                "probe": probe,
                "next_lr": next_lr,
                "torch_threads": torch.get_num_threads(),
            }
        return Manifest(
            run_id=self.cfg.run_id,
            step=step,
            world_size=self.env.world_size,
            files=files,
            training={k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()},
            provenance={
                "config_hash": self.provenance.config_hash,
                "data_fingerprint": self.provenance.data_fingerprint,
                "code_version": self._code_version,
                "torch_version": torch.__version__,
                "config": self.provenance.config,
            },
            sanity=sanity,
            state={
                "layout": LAYOUT,
                "rng_ranks": self.env.world_size,
                "has_scheduler": self.scheduler is not None,
                "has_scaler": self.scaler is not None,
                "async_mode": self.cfg.async_mode,
            },
        )

    def _on_committed(self, manifest: Manifest, final: str) -> None:
        ev_payload: dict[str, Any] = {
            "run_id": manifest.run_id,
            "step": manifest.step,
            "uri": final,
            "bytes": manifest.total_bytes,
            "world_size": manifest.world_size,
            "root": os.path.abspath(self.cfg.root),
            "scope": self.topology.scope,
            "nodes": list(self.topology.node_ids) if self.topology.scope == "node" else [],
        }
        record = dict(
            ev_payload,
            event=events.COMMITTED,
            event_id=events.event_id(manifest.run_id, manifest.step, events.COMMITTED),
            committed_at=time.time(),
        )
        events.append_outbox(self.run_path, record)
        self._sender.send(events.make_event(events.COMMITTED, manifest.run_id, manifest.step, ev_payload))

    def _load(self) -> LoadResult:
        if self.topology.scope == "node":
            return self._load_nodes()
        env = self.env
        skipped: list[tuple[str, str]] = []
        after: int | None = None
        while True:
            # Cheap checks here (manifest, every file there with its size); the load reads every
            # byte once and verifies it as it reads, and a file that does not match fails the
            # load on every rank, so all ranks move on to the next older checkpoint together.
            rep = find_resume_point(
                self.run_path, rank=env.rank, world=env.world_size, group=env.ckpt_group, deep=False, after=after
            )
            skipped += [x for x in rep.skipped if x not in skipped]
            if rep.chosen is None:
                break
            mism = check_provenance(
                rep.chosen.manifest,
                rep.chosen.path,
                config_hash=self.provenance.config_hash,
                data_fingerprint=self.provenance.data_fingerprint,
                allow_mismatch=self.cfg.allow_mismatch,
            )
            try:
                self._load_checkpoint_dir(rep.chosen.path, rep.chosen.manifest)
                break
            except IntegrityError as e:
                skipped.append((rep.chosen.path, str(e)))
                after = rep.chosen.step
        for path, why in skipped:
            if env.rank == 0:
                log.warning("resume: skipping %s: %s", path, why)
        if rep.chosen is None:
            if self.cfg.resume == "required" or skipped:
                # Checkpoints exist but none verifies: starting over silently would
                # throw away days of training; make the operator decide.
                raise no_checkpoint_error(self.run_path, skipped)
            self.last_load = LoadResult(0, None)
            return self.last_load
        for m in mism:
            log.warning("resume despite mismatch (allow_mismatch): %s", m)
        if env.rank == 0:
            if rep.latest_was != rep.chosen.step:
                log.warning("resume: 'latest' named %s; repaired to step %d", rep.latest_was, rep.chosen.step)
                commit.write_latest(self.run_path, rep.chosen.step)
            log.info("resumed from %s (step %d)", rep.chosen.path, rep.chosen.step)
        self.last_load = LoadResult(rep.chosen.step, rep.chosen.path, skipped, mism)
        return self.last_load

    def _load_nodes(self) -> LoadResult:
        """Node-local roots: agree on the newest recoverable step, fetch what each node lacks,
        verify, load (``trainer/nodes.py``)."""
        env, topo = self.env, self.topology

        def needs(step_dir: str, manifest: Manifest) -> set[str]:
            from ckptflow.trainer.dcpmeta import read_dcp_metadata

            md = read_dcp_metadata(step_dir)  # what files_read parses anyway; also sizes the optimizer's state
            target = load_target(
                manifest,
                env=env,
                model=self.model,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                scaler=self.scaler,
                sampler=self.sampler,
                extra=self.extra,
                metadata=md,
            )
            return files_read(step_dir, target, md)

        rep = resume_point(self.run_path, topo, env.ckpt_group, needs=needs)
        if env.rank == 0:
            for step, why in rep.skipped:
                log.warning("resume: skipping %s: %s", step, why)
        if rep.step is None or rep.manifest is None:
            if self.cfg.resume == "required" or rep.skipped:
                raise not_recoverable_error(self.run_path, rep.skipped)
            self.last_load = LoadResult(0, None)
            return self.last_load
        mism = check_provenance(
            rep.manifest,
            rep.path,
            config_hash=self.provenance.config_hash,
            data_fingerprint=self.provenance.data_fingerprint,
            allow_mismatch=self.cfg.allow_mismatch,
        )
        for m in mism:
            log.warning("resume despite mismatch (allow_mismatch): %s", m)
        self._load_checkpoint_dir(rep.path, rep.manifest)
        if topo.is_leader:
            if rep.latest_was != rep.step:
                log.warning(
                    "resume: node %s's 'latest' named %s; repaired to step %d", topo.node_id, rep.latest_was, rep.step
                )
                commit.write_latest(self.run_path, rep.step)
        if env.rank == 0:
            got: dict[tuple[str, str], list[str]] = {}
            for name, src, dst in rep.fetched:
                got.setdefault((src, dst), []).append(name)
            how = (
                "; ".join(
                    f"node {dst} fetched {', '.join(sorted(n))} from node {src}"
                    for (src, dst), n in sorted(got.items())
                )
                or "every node read its own disk"
            )
            log.info("resumed from step %d on %d nodes: %s", rep.step, topo.n_nodes, how)
        self.last_load = LoadResult(rep.step, rep.path, [(s, w) for s, w in rep.skipped], mism, rep.fetched)
        return self.last_load

    def _load_checkpoint_dir(self, path: str, manifest: Manifest) -> None:
        """Load one *verified* checkpoint dir into the live objects (any world size)."""
        load_verified(
            path,
            manifest,
            env=self.env,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            scaler=self.scaler,
            sampler=self.sampler,
            extra=self.extra,
            reshard_state=self.reshard_state,
        )
