"""What goes into a checkpoint, and how it is put back.

The DCP state dict has four parts:

``model`` / ``optim``  via DCP's ``get_state_dict`` — sharded (DTensor) under FSDP2,
                       so each rank writes only its shard and a load reshards.
``train``              step, LR scheduler, GradScaler, sampler position and user extras:
                       identical on every rank (DCP stores one copy).
``rng.rank<r>``        python, numpy, torch CPU (and CUDA) generator states: different
                       on every rank, so keyed by rank. A resume at another world size
                       restores the ranks that exist in both and reseeds the others.

Snapshot consistency: parameters and optimizer state are only mutated by
``optimizer.step()``, which waits for staging (a step pre-hook in the manager).
Everything else a forward pass may mutate (module buffers such as running stats)
or that is a live Python object (scheduler, sampler, RNG) is copied here,
synchronously, at save time.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)


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


# DCP flattens nested dicts into one entry per leaf and matches entries by name on
# load, so the *structure* of non-tensor state would have to be identical between the
# saving and the loading job (a job without a sampler could not load one with). A
# tuple is a leaf to DCP: wrapping each non-tensor part in one makes it a single
# entry whose content may differ freely. The tag says what it is and its version.
TRAIN_TAG = "ckptflow.train.v1"
RNG_TAG = "ckptflow.rng.v1"


def wrap(tag: str, value: Any) -> tuple[str, Any]:
    return (tag, value)


def unwrap(tag: str, leaf: Any) -> Any:
    if not (isinstance(leaf, tuple) and len(leaf) == 2 and leaf[0] == tag):
        raise ValueError(f"expected a {tag} entry in the checkpoint, found {type(leaf).__name__}")
    return leaf[1]


def _buffer_names(model: torch.nn.Module) -> set[str]:
    return {name for name, _ in model.named_buffers()}


def train_state(
    step: int, *, scheduler: Any = None, scaler: Any = None, sampler: Any = None, extra: Any = None
) -> dict[str, Any]:
    """The rank-independent ``train`` part of the state dict."""
    return {
        "step": step,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "sampler": sampler.state_dict() if sampler is not None else None,
        "extra": extra.state_dict() if extra is not None else None,
    }


def build_save_state(
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    train: dict[str, Any],
) -> dict[str, Any]:
    """The state dict handed to ``dcp.async_save`` for this rank.

    Model/optimizer tensors are *views* of live state, copied later by the async
    stager; everything else is a private copy made now.
    """
    model_sd, optim_sd = get_state_dict(model, optimizer)
    # Buffers can change in a forward pass, which runs before staging completes.
    for name in _buffer_names(model) & model_sd.keys():
        t = model_sd[name]
        model_sd[name] = t.detach().clone() if isinstance(t, torch.Tensor) else copy.deepcopy(t)
    return {
        "model": model_sd,
        "optim": optim_sd,
        "train": wrap(TRAIN_TAG, copy.deepcopy(train)),
        "rng": {rng_key(rank): wrap(RNG_TAG, capture_rng())},
    }


def build_load_target(
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    rank: int,
    train: dict[str, Any],
    saved_rng_ranks: int,
) -> dict[str, Any]:
    """A state dict of the right structure for ``dcp.load`` to fill in place."""
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        target: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    else:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        target = {"model": get_model_state_dict(model)}
    target["train"] = wrap(TRAIN_TAG, copy.deepcopy(train))
    if rank < saved_rng_ranks:
        target["rng"] = {rng_key(rank): wrap(RNG_TAG, capture_rng())}
    return target


def apply_loaded_state(
    loaded: dict[str, Any], *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> None:
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    else:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, loaded["model"], options=StateDictOptions(strict=True))
