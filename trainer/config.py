"""What a training loop configures: ``CheckpointConfig`` (where, how often, how), ``Provenance`` (what a resume
must match) and ``SanitySpec`` (how a later process rebuilds the model and the loss it must reproduce). Plain
values, checked as they are made; the manager acts on them."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ckptflow.trainer.errors import ConfigError
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.checksum import hash_bytes
from ckptflow.trainer.nodes.topology import SCOPES

ASYNC_MODES = ("async_staging", "sync")
"""``async_staging``: the state is copied into reused CPU buffers off the training thread and written in the
background; ``sync``: written on the training thread, no CPU copy (for hosts without the memory for one)."""

__all__ = ["ASYNC_MODES", "REFERENCES", "CheckpointConfig", "Provenance", "SanitySpec", "Stateful", "code_version"]


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
    """Save every ``interval`` steps (``save(..., force=True)`` saves regardless), or ``"auto"``: picked from the
    measured stall, persist and step times and ``mtbf_hours``, re-evaluated each save (``trainer/interval.py``)."""
    mtbf_hours: float | None = None
    """``interval="auto"``: the job's mean time between failures, in hours (required there)."""
    auto_first_interval: int = 10
    """``interval="auto"``: steps to the first save, before anything is measured."""
    auto_min_interval: int = 1
    auto_max_interval: int = 1_000_000
    """``interval="auto"``: bounds on the interval it picks, in steps."""
    async_mode: str = "async_staging"
    """``async_staging`` (default): copied to CPU buffers in the background and written from there, training
    blocked only while the copy starts. ``sync``: ``dcp.save`` on the training thread, which blocks for the whole
    write but holds no CPU copy of the state — for a host without the memory for one."""
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
    emit_events: bool = True
    """Send ``ckptflow.checkpoint.committed`` to Prefect when PREFECT_API_URL is set."""
    event_exit_budget_s: float = 1.0
    """Longest ``close()`` waits for undelivered events (the outbox keeps them anyway)."""
    hot_scope: str = "auto"
    """Whether ``root`` is one folder all ranks share or each node's own disk: ``auto`` finds out at start-up
    (``trainer/nodes/topology.py``); ``shared`` or ``node`` say what to expect, and start-up fails with the reason
    if it finds otherwise. Node-local roots commit in two levels (``trainer/nodes/twolevel.py``)."""
    replicas: int = 2
    """Node-local roots: how many nodes hold each shard file (the writer's node and the next ones on a ring), so
    a lost node loses no checkpoint. 1 turns replication off."""
    tiers: str = "auto"
    """Where a resume looks beyond ``root`` (``trainer/recall.py``): ``auto``, the warm and cold tiers of the
    ckptflow config the CLI reads ($CKPTFLOW_CONFIG, ./ckptflow.toml; none without one); a config file's path;
    ``none``, the hot root alone. A run whose hot copy is gone resumes from warm, else cold."""
    tiers_wait_s: float = 60.0
    """How long a resume retries a tier it cannot list (1, 2, 4... s apart). With the hot root empty it then
    stops, naming the tier, rather than start at step 0."""

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
        if not isinstance(self.tiers, str) or not self.tiers:
            raise ConfigError(f"CheckpointConfig.tiers={self.tiers!r}: 'auto', 'none' or a config file's path")
        if not isinstance(self.tiers_wait_s, (int, float)) or not 0 <= self.tiers_wait_s < float("inf"):
            raise ConfigError(f"CheckpointConfig.tiers_wait_s={self.tiers_wait_s!r} must be a number of seconds >= 0")
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
    """Computes the probe loss now (all ranks call it; eval mode, no grad), on the training thread at every save."""
    reference: str = "probe"
    """The loss the sanity step must reproduce. ``probe`` (default): ``probe_fn`` on the fixed probe batch at save
    time. ``next_step``: the loss the loop computes anyway at the first step after the save, handed over with
    ``CheckpointManager.observe_loss(step, loss)``, so no extra forward pass (``trainer/probe.py``). It needs a
    builder whose ``Built`` can replay that step: ``replay_sampler(world_size)`` (rank 0's data at the saving world
    size) and ``replay_loss(sampler)`` (the loop's forward, train mode, on its next batch), as the reference has."""
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
