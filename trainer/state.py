"""What goes into a checkpoint, and how it is put back.

The DCP state dict: ``model`` and ``optim`` from DCP's ``get_state_dict`` (sharded under FSDP2: each rank writes its
shard, a load reshards), and ``ranks.rank<r>``, one pickle-free ``uint8`` tensor per rank (``safetree``): step,
scheduler, scaler, the rank's RNG states, sampler, ``extra`` and a copy of the module buffers, restored to the same
rank (scheduler and scaler from rank 0's elsewhere). At another world size the RNG of ranks in both is restored,
others reseeded; sampler or ``extra`` state equal on every rank goes to every rank, one that differed needs
``reshard_state``; new ranks get rank 0's buffers. What a forward pass may mutate, or is a live Python object, is
copied at save time; parameters and optimizer state change only in ``optimizer.step()``, which waits for staging.
See docs/architecture.md, "One save, per rank".
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

__all__ = [
    "LAYOUT",
    "OPTIM_STATE",
    "RANKS",
    "TrainState",
    "apply_loaded_state",
    "buffer_keys",
    "build_load_target",
    "build_save_state",
    "capture_rng",
    "plain_name",
    "prefill_optimizer_state",
    "rank_state",
    "reseed_rng",
    "restore_rng",
    "rng_key",
    "shared_state",
    "states_equal",
]


@dataclass(frozen=True, eq=False)
class TrainState:
    """The live objects a checkpoint saves and a resume restores (compared by identity). ``sampler``, ``extra``:
    anything with ``state_dict()`` and ``load_state_dict()``; each rank keeps its own."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    scaler: Any = None
    sampler: Any = None
    extra: Any = None


def capture_rng() -> dict[str, Any]:
    st: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def restore_rng(st: dict[str, Any]) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        cuda = st["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


def reseed_rng(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_key(rank: int) -> str:
    return f"rank{rank}"


LAYOUT = 2
"""``manifest.state["layout"]``: each rank's non-tensor state is one ``uint8`` tensor ``ranks.rank<r>``
(``safetree.py``). DCP flattens nested dicts to one entry per leaf and matches them by name on load, so plain
non-tensor state would need the same structure in both jobs; one encoded tensor per rank may differ freely.
Layout 1 (pickled tuples, before 0.1.0) is refused with an error saying how to read it."""
RANKS = "ranks"

# Wrappers whose prefix get_state_dict drops from state-dict keys but named_buffers keeps.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def plain_name(name: str) -> str:
    """A parameter or buffer name as DCP's state dict gives it (DDP's and ``torch.compile``'s prefixes dropped)."""
    while name.startswith(_WRAPPER_PREFIXES):
        name = name.split(".", 1)[1]
    return name


def buffer_keys(model: torch.nn.Module, model_sd: dict[str, Any]) -> list[str]:
    """The state-dict keys of the module's (persistent) buffers, DDP/compile prefixes resolved."""
    names = {plain_name(n) for n, _ in model.named_buffers()}
    return sorted(k for k in model_sd if plain_name(k) in names)


def shared_state(step: int, *, scheduler: Any = None, scaler: Any = None) -> dict[str, Any]:
    """The part every rank holds the same: saved once, from rank 0 (the canonical rank)."""
    return {
        "step": step,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
    }


def rank_state(*, sampler: Any = None, extra: Any = None) -> dict[str, Any]:
    """The user's state that may differ between ranks (a data loader's position, ``extra``)."""
    return {
        "sampler": sampler.state_dict() if sampler is not None else None,
        "extra": extra.state_dict() if extra is not None else None,
    }


def build_save_state(
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    train: dict[str, Any],
    per_rank: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The state dict handed to ``dcp.async_save`` for this rank. Model/optimizer tensors are
    *views* of live state, copied later by the async stager; the rest is a private copy made now. Replicated
    entries (the model under DDP, ``train``) are written from rank 0 (``dcp/planner.py``); each rank's RNG,
    ``per_rank`` state and module buffers go into its own entry, since they differ across ranks."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    # Buffers can change in a forward pass, which runs before staging completes.
    buffers = {}
    for name in buffer_keys(model, model_sd):
        t = model_sd[name]
        model_sd[name] = buffers[name] = t.detach().clone() if isinstance(t, torch.Tensor) else copy.deepcopy(t)
    from ckptflow.trainer.safetree import encode_tensor

    own = {**train, "rng": capture_rng(), **(per_rank or rank_state()), "buffers": buffers}
    return {"model": model_sd, "optim": optim_sd, RANKS: {rng_key(rank): encode_tensor(own)}}


def build_load_target(
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    rank: int,
    world: int,
    saved_ranks: int,
    entry_bytes: dict[str, int] | None = None,
) -> dict[str, Any]:
    """A state dict of the right structure for ``dcp.load`` to fill in place. At the saving world size each rank
    reads its own per-rank entry, at another every saved rank's (to decide what a resharded rank gets).
    ``entry_bytes``: the size of each ``ranks.rank<r>`` entry (from DCP's metadata)."""
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        target: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    elif not model.state_dict():  # the rest of the state alone (the bounded sanity step reads tensors later)
        target = {"model": {}}
    else:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        target = {"model": get_model_state_dict(model)}
    sizes = entry_bytes or {}
    wanted = [rank] if world == saved_ranks else list(range(saved_ranks))
    wanted = [r for r in wanted if f"{RANKS}.{rng_key(r)}" in sizes]
    target[RANKS] = {rng_key(r): torch.empty(sizes[f"{RANKS}.{rng_key(r)}"], dtype=torch.uint8) for r in wanted}
    return target


OPTIM_STATE = "optim.state."
"""How DCP's flattened keys of optimizer state begin: ``optim.state.<parameter fqn>.<state key>``."""


def prefill_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, metadata: Any) -> bool:
    """Give an optimizer without state the checkpoint's state tensors, uninitialised, for the load to fill;
    True if it did. Else ``get_state_dict`` runs a whole optimizer step on zero gradients to allocate state,
    costlier than the load. A tensor of the parameter's size is made like the parameter (a DTensor under
    FSDP2), a 0-dim one (Adam's ``step``) as a scalar; anything else leaves the optimizer to DCP's own way.
    The load then overwrites every tensor or fails (and resume raises unless an older checkpoint loads)."""
    if optimizer.state or metadata is None:
        return False
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    names = {plain_name(n): p for n, p in model.named_parameters() if id(p) in params}
    state: dict[Any, dict[str, torch.Tensor]] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not fqn.startswith(OPTIM_STATE):
            continue
        name, _, key = fqn[len(OPTIM_STATE) :].rpartition(".")
        p = names.get(name)
        if p is None or not isinstance(md, TensorStorageMetadata):
            return False
        dtype = md.properties.dtype
        if tuple(md.size) == tuple(p.shape):
            t = torch.empty_like(p, dtype=dtype, requires_grad=False)
        elif len(md.size) == 0:
            t = torch.zeros((), dtype=dtype)
        else:
            return False
        state.setdefault(p, {})[key] = t
    if not state:
        return False
    optimizer.state.update(state)
    return True


def states_equal(a: Any, b: Any) -> bool:
    """Deep equality of two state dicts (tensors bitwise)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(states_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(states_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    return bool(a == b)


def apply_loaded_state(
    loaded: dict[str, Any],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> None:
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    elif not loaded["model"] and not model.state_dict():
        return  # nothing of the model was asked for (``build_load_target``)
    else:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, loaded["model"], options=StateDictOptions(strict=True))
