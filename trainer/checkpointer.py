"""``CheckpointManager``: three calls in a training loop, ``load()``, ``save(step, metrics)`` after every step and
``close()`` (README.md, "Add it to your own training loop"). The manager owns the interval, the async mode, the
commit, resume with fallback and the commit event. See docs/architecture.md, "Training side".
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from ckptflow.trainer import events
from ckptflow.trainer.config import CheckpointConfig, Provenance, SanitySpec, Stateful, code_version
from ckptflow.trainer.distenv import DistEnv, gather, init_distributed
from ckptflow.trainer.errors import ConfigError, SaveError
from ckptflow.trainer.format import commit, layout
from ckptflow.trainer.format.manifest import FileEntry, Manifest
from ckptflow.trainer.interval import AutoInterval
from ckptflow.trainer.loader import Reshard
from ckptflow.trainer.nodes.topology import Topology, discover, single
from ckptflow.trainer.nodes.twolevel import recover
from ckptflow.trainer.probe import NextStepLoss, fixed_batch_record, next_step_record, none_recorded
from ckptflow.trainer.recall import Recall, find_recall
from ckptflow.trainer.restore import LoadResult, Resume, refuse_second_history, resume
from ckptflow.trainer.saver import AsyncSaver, SaveRequest
from ckptflow.trainer.state import LAYOUT, TrainState, build_save_state, rank_state, shared_state

__all__ = ["CheckpointManager"]


log = logging.getLogger(__name__)


def _agree(cfg: CheckpointConfig, env: DistEnv) -> None:
    """Every rank must run with the same checkpoint settings (checked on the ckpt group): a rank that saves at
    another interval or into another run would send the others into mismatched collectives."""
    if env.world_size == 1:
        return
    mine = (
        cfg.run_id,
        cfg.interval,
        cfg.async_mode,
        cfg.hot_scope,
        cfg.replicas,
        (cfg.mtbf_hours, cfg.auto_first_interval, cfg.auto_min_interval, cfg.auto_max_interval),
        (cfg.resume, cfg.tiers, cfg.tiers_wait_s),
    )
    every = gather(mine, env.ckpt_group)
    if any(e != every[0] for e in every):
        diff = {r: e for r, e in enumerate(every) if e != every[0]}
        raise ConfigError(
            f"ranks disagree on the checkpoint settings (run_id, interval, async_mode, hot_scope, "
            f"replicas, auto-interval settings, resume and tiers): rank 0 has {every[0]}, but {diff}; start every "
            "rank with the same"
        )


def _agreed_recall(cfg: CheckpointConfig, env: DistEnv) -> Recall | None:
    """The tiers beyond hot, found by every rank from ``cfg.tiers`` (``auto``: the CLI's own lookup, relative to
    each rank's working directory), and agreed: a rank that found none, or failed to read the config, while
    another found tiers would branch differently in the resume's collectives; all raise the same error."""
    found: Recall | None = None
    err = ""
    try:
        found = find_recall(None if cfg.tiers == "auto" else cfg.tiers)
    except Exception as e:  # noqa: BLE001 - a config error on one rank must reach every rank
        err = f"{type(e).__name__}: {e}"
    facts = gather((found is not None, err), env.ckpt_group) if env.world_size > 1 else [(found is not None, err)]
    errors = [f"rank {r}: {e}" for r, (_, e) in enumerate(facts) if e]
    if errors:
        raise ConfigError(f"reading the tiers of CheckpointConfig.tiers={cfg.tiers!r} failed: {errors[0]}")
    if len({has for has, _ in facts}) > 1:
        have = [r for r, (has, _) in enumerate(facts) if has]
        raise ConfigError(
            f"ranks disagree on the tiers beyond the hot root: ranks {have} found a ckptflow config "
            f"(CheckpointConfig.tiers={cfg.tiers!r}), the others none. Start every rank with the same "
            "$CKPTFLOW_CONFIG (or working directory), or set tiers to a config path, or 'none'"
        )
    return found


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
        recall: Recall | None = None,
    ) -> None:
        self.cfg = cfg
        self.state = TrainState(
            model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, sampler=sampler, extra=extra
        )
        """The live objects saved and restored (the loop's own; ``state.model`` is ``model``)."""
        self.sanity, self.provenance = sanity, provenance
        self.reshard_state = reshard_state
        """Resuming at another world size: ``fn(name, saved_states, rank, world) -> state`` for a sampler or
        ``extra`` state that differed between the saving ranks (``trainer/loader.py``)."""
        self.env = env or init_distributed()
        self.run_path = os.path.abspath(layout.run_dir(cfg.root, cfg.run_id))
        self.recall: Recall | None = recall
        """The tiers a resume looks in beyond ``root`` (``trainer/recall.py``), or None; unless given, found by
        ``load()`` from ``cfg.tiers`` (a training process that never resumes never reads a config)."""
        self.last_load: LoadResult | None = None
        self._code_version = provenance.code_version or code_version()
        # api_url None: PREFECT_API_URL; "": events off
        self._sender = events.EventSender(None if cfg.emit_events else "", exit_budget_s=cfg.event_exit_budget_s)
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
            topology=self.topology,
            replicas=cfg.replicas,
            timeout_s=self.env.ckpt_timeout_s,
        )
        # The staged copy must exist before parameters change; close() removes the hook before it drops the saver.
        self._hook = optimizer.register_step_pre_hook(lambda *_a, **_k: self._before_optimizer_step(saver))

    # -- public API -------------------------------------------------------------------
    def load(self) -> int:
        """Resume from the newest committed checkpoint that verifies; returns its step (0: fresh)."""
        if not self.cfg.enabled:
            return 0
        if self.recall is None and self.cfg.tiers != "none":
            self.recall = _agreed_recall(self.cfg, self.env)
        if self.cfg.resume == "never":
            refuse_second_history(self.run_path, self.env, self.recall, wait_s=self.cfg.tiers_wait_s)
            return 0
        t0 = time.perf_counter()
        self.last_load = resume(
            Resume(
                run_path=self.run_path,
                env=self.env,
                topology=self.topology,
                provenance=self.provenance,
                required=self.cfg.resume == "required",
                allow_mismatch=self.cfg.allow_mismatch,
                reshard_state=self.reshard_state,
                recall=self.recall,
                tiers_wait_s=self.cfg.tiers_wait_s,
            ),
            self.state,
        )
        step = self.last_load.step
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
        """Save the state after ``step`` if the interval (or ``force``) says so; True if a save started. With
        ``interval="auto"`` call it after every step: the time between calls is how it measures step and stall."""
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
        # The previous save first: its lane runs collectives on the checkpoint group, as does auto.plan below, and
        # only one thread may use that group at a time. A failed previous save is reported here; this one starts.
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
        """This rank's loss of step ``step`` as the loop computed it (before any all-reduce). With next-step sanity
        (``SanitySpec(reference="next_step")``) call it every step, after forward and before ``optimizer.step()``: the
        first step after a save is the reference. Other calls return before reading ``loss`` (no device sync)."""
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
        optimizer = self.state.optimizer
        assert optimizer is not None  # the constructor takes one (TrainState's is optional for loads)
        state = build_save_state(
            model=self.state.model,
            optimizer=optimizer,
            rank=self.env.rank,
            train=shared_state(step, scheduler=self.state.scheduler, scaler=self.state.scaler),
            per_rank=rank_state(sampler=self.state.sampler, extra=self.state.extra),
        )
        next_step = self.sanity is not None and self.sanity.reference == "next_step"
        live = self.sanity.probe_fn() if self.sanity is not None and not next_step else None
        ref: NextStepLoss | None = None
        if next_step:
            self._next_ref = ref = NextStepLoss(step)
        # The LR a resumed run will use first; the sanity step checks the restored scheduler reproduces it.
        next_lr = float(self.state.scheduler.get_last_lr()[0]) if self.state.scheduler is not None else None

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
        """No step followed the last save: the model still holds its parameters, so the fixed probe batch gives
        its reference. The ranks run it together (a collective under FSDP), so they agree first (training group)."""
        ref, self._next_ref = self._next_ref, None
        if ref is None or self.sanity is None:
            return
        pending = gather(not ref.done(), None) if self.env.world_size > 1 else [not ref.done()]
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
                "has_scheduler": self.state.scheduler is not None,
                "has_scaler": self.state.scaler is not None,
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
        events.announce_commit(self.run_path, ev_payload, self._sender)
