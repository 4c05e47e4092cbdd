"""The sanity probe's reference loss, computed off the training thread.

A checkpoint records the loss of a fixed probe batch so that the restore sanity step can
rebuild the model from the files and check it reproduces that loss bitwise. Computing it on
the live model costs one forward pass on the training thread at every save (0.1-0.7 s on 2
cores, the largest part of the save stall). Here it is computed in the commit thread from
the *staged copy* — the very tensors DCP writes — by a shadow model the checkpoint's own
builder made (``SanitySpec.builder``, the code path the sanity step uses), so the training
thread does not run it. It still takes CPU: on a host whose cores training already fills it
cost more end to end than the live probe (docs/benchmarks.md, "Probe"), hence opt-in.

What this gives up, and how it is won back: a probe of the staged copy cannot see a staging
bug (a copy that is not the live state at step N). So the first save of every attempt (and
every ``live_check_every``-th, if set) also computes the live probe on the training thread
and the save fails unless the two agree bitwise (``ProbeMismatch``): a systematic staging or
mapping error is caught the first time, and the steady state costs nothing.

Sharded models (FSDP2: DTensor shards) are gathered to rank 0 on the checkpoint group, in
the commit thread, after DCP's upload and before the file entries are gathered — every rank
runs the same collectives in the same order, on the one thread that owns that group at that
moment. Only rank 0 builds the manifest, so only rank 0 holds the shadow and the full copy.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist

from ckptflow.trainer.errors import CkptflowError


class ProbeMismatch(CkptflowError):
    """The staged copy's probe loss is not the live model's: the snapshot is not step N's state."""


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def is_sharded(t: Any) -> bool:
    return _is_dtensor(t) and any(p.is_shard() for p in t.placements)


def supported(model_sd: dict[str, Any]) -> str | None:
    """None when the background probe can rebuild ``model_sd``'s full tensors; else why not.

    The same model on every rank gives the same answer, but the caller still agrees on it
    (all ranks must run the same gathers)."""
    for name, t in model_sd.items():
        if not _is_dtensor(t):
            continue
        mesh, placements = t.device_mesh, t.placements
        if mesh.ndim != 1 or len(placements) != 1:
            return f"{name}: a {mesh.ndim}-D mesh"
        p = placements[0]
        if not (p.is_replicate() or (p.is_shard() and p.dim == 0)):
            return f"{name}: placement {p}"
    return None


def full_model_state(
    staged: dict[str, Any] | None, *, rank: int, group: Any, world: int, gather: bool
) -> dict[str, Any] | None:
    """Rank 0: every entry of the staged model state as a full tensor; others: None.

    ``gather`` must be the same on every rank (agreed at the first save): then every rank
    joins the one gather, even one whose staging failed (it sends nothing, and rank 0 reports it).
    """
    sd = staged or {}
    shards = {k: v.to_local() for k, v in sd.items() if _is_dtensor(v) and v.placements[0].is_shard()}
    gathered: list | None = None
    if gather and world > 1:
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(shards if staged is not None else None, gathered, dst=0, group=group)
    if rank != 0:
        return None
    if staged is None:
        raise ValueError("probe: rank 0 has no staged copy (staging failed)")
    if gathered is not None and any(g is None for g in gathered):
        raise ValueError(f"probe: ranks {[r for r, g in enumerate(gathered) if g is None]} have no staged copy")
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if not _is_dtensor(v):
            out[k] = v
        elif k not in shards:  # replicated: rank 0's copy is the whole
            out[k] = v.to_local()
        else:
            # Mesh position i holds chunk i along dim 0 (torch.chunk), whichever rank that is.
            order = [int(r) for r in v.device_mesh.mesh.tolist()]
            parts = [gathered[r][k] for r in order] if gathered is not None else [shards[k]]
            full = torch.cat(parts, dim=0)
            if tuple(full.shape) != tuple(v.shape):
                raise ValueError(f"probe: {k} gathered to {tuple(full.shape)}, the model says {tuple(v.shape)}")
            out[k] = full
    return out


def build_shadow(builder: str, config: dict[str, Any], tokens: list) -> Any:
    """The builder's unsharded model with the probe batch (rank 0, training thread)."""
    # The builder seeds torch's global generator (identical initial weights): keep the
    # training loop's RNG stream untouched.
    with torch.random.fork_rng(devices=[]):
        from ckptflow.trainer.sanity import import_builder  # local: sanity pulls in the loader

        built = import_builder(builder)(config, parallel="none")
    built.probe = torch.tensor(tokens, dtype=torch.long)
    # Only the model is needed: without the optimizer's references the builder's own
    # weights are freed once the first staged copy is assigned.
    for name in ("optimizer", "scheduler"):
        if hasattr(built, name):
            setattr(built, name, None)
    return built


class BackgroundProbe:
    """Rank 0's shadow model; ``loss(staged)`` runs in the commit thread on every rank."""

    def __init__(self, shadow: Any, *, rank: int, world: int, group: Any, gather: bool) -> None:
        self.rank, self.world, self.group, self.gather = rank, world, group, gather
        self._built = shadow  # rank 0 only (build_shadow); None elsewhere

    def loss(self, staged_model: dict[str, Any] | None) -> float | None:
        """The probe loss of the staged model state (rank 0; None elsewhere). Collective."""
        full = full_model_state(staged_model, rank=self.rank, group=self.group, world=self.world, gather=self.gather)
        if full is None:
            return None
        # assign=True: the shadow runs on the staged buffers themselves (no second copy); they
        # stay unchanged until the next save stages, which waits for this one to commit.
        self._built.model.load_state_dict(full, strict=True, assign=True)
        return float(self._built.probe_loss())


# ---- SanitySpec(reference="next_step"): the loss the loop computes anyway -------------------


class NextStepLoss:
    """One save's sanity reference when it is the loss of the first training step after the save.

    That forward pass runs on exactly the checkpoint's state — the parameters of step N (the
    optimizer has not stepped yet), the next batch of the saved data position, the saved RNG
    (dropout) — so the sanity step can replay it from the files and must get the same bits. The
    loop computes it anyway: ``CheckpointManager.observe_loss`` hands it over and costs the
    training thread a float conversion once per save. Rank 0's commit thread waits for it before
    it writes the manifest (usually it is there before the files are: a step is shorter than a
    persist). Whoever settles it first wins: ``observe_loss``, the optimizer pre-hook (a step
    that came without it: nothing to record), ``close()`` (no step came: the fixed probe batch on
    the unchanged model), or the commit's timeout.
    """

    def __init__(self, step: int) -> None:
        self.step = step
        self._done = threading.Event()
        self._lock = threading.Lock()
        self.record: dict[str, Any] = {}

    def settle(self, record: dict[str, Any]) -> bool:
        """Set the manifest's ``probe`` record; False (and nothing changes) if already settled."""
        with self._lock:
            if self._done.is_set():
                return False
            self.record = record
            self._done.set()
            return True

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float) -> dict[str, Any]:
        if not self._done.wait(timeout_s):
            self.settle(
                none_recorded(
                    f"no loss of step {self.step + 1} arrived within {timeout_s:g} s "
                    "(SanitySpec.next_step_timeout_s); the sanity step checks the restore without a reference loss"
                )
            )
        return self.record


def next_step_record(loss: float, world_size: int) -> dict[str, Any]:
    return {
        "kind": "next_step",
        "loss": loss,
        "loss_hex": float(loss).hex(),
        "source": "next_step_loss",
        "rank": 0,
        "world_size": world_size,
    }


def fixed_batch_record(loss: float, tokens: list, source: str) -> dict[str, Any]:
    return {"kind": "fixed_batch", "tokens": tokens, "loss": loss, "loss_hex": float(loss).hex(), "source": source}


def none_recorded(reason: str) -> dict[str, Any]:
    return {"kind": "none", "loss": None, "reason": reason}
