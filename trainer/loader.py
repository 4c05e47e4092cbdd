"""Loading a verified checkpoint into live objects, at any world size.

Shared by resume (``CheckpointManager.load``) and the read-only restore sanity step
(``trainer.sanity``), which must not create, clean or repair anything on a tier.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ckptflow.trainer.distenv import DistEnv
from ckptflow.trainer.errors import IntegrityError
from ckptflow.trainer.manifest import Manifest
from ckptflow.trainer.state import (
    RNG_TAG,
    TRAIN_TAG,
    apply_loaded_state,
    build_load_target,
    reseed_rng,
    restore_rng,
    rng_key,
    train_state,
    unwrap,
)

log = logging.getLogger(__name__)


def load_target(
    manifest: Manifest,
    *,
    env: DistEnv,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any = None,
    scaler: Any = None,
    sampler: Any = None,
    extra: Any = None,
) -> dict[str, Any]:
    """The state dict ``dcp.load`` fills for this rank (its structure decides what is read)."""
    return build_load_target(
        model=model,
        optimizer=optimizer,
        rank=env.rank,
        train=train_state(0, scheduler=scheduler, scaler=scaler, sampler=sampler, extra=extra),
        saved_rng_ranks=int(manifest.state.get("rng_ranks", 0)),
    )


def files_read(step_dir: str, target: dict[str, Any]) -> set[str]:
    """The files a ``dcp.load`` of ``target`` from ``step_dir`` reads on this rank: DCP's own
    load plan (so resharding at another world size is accounted for), with ``.metadata``
    parsed by the restricted reader — call it only once ``.metadata`` matched its manifest."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from ckptflow.trainer import layout
    from ckptflow.trainer.dcpmeta import read_dcp_metadata

    md = read_dcp_metadata(step_dir)
    planner = DefaultLoadPlanner()
    planner.set_up_planner(target, md, is_coordinator=False)
    plan = planner.create_local_plan()
    return {md.storage_data[item.storage_index].relative_path for item in plan.items} | {layout.DCP_METADATA}


def load_verified(
    path: str,
    manifest: Manifest,
    *,
    env: DistEnv,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any = None,
    scaler: Any = None,
    sampler: Any = None,
    extra: Any = None,
) -> dict[str, Any]:
    """``dcp.load`` a checkpoint that has *already been verified* against ``manifest``.

    Returns the loaded ``train`` dict. DCP reshards to the current world size.
    """
    import torch.distributed.checkpoint as dcp

    target = load_target(
        manifest,
        env=env,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        sampler=sampler,
        extra=extra,
    )
    try:
        dcp.load(target, checkpoint_id=path, process_group=env.ckpt_group)
    except BaseException as e:  # DCP's CheckpointException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise IntegrityError(
            f"{path}: DCP could not load a checkpoint that verified ({e!r}); the model "
            "or optimizer structure differs from the one that saved it",
            path=path,
        ) from None
    apply_loaded_state(target, model=model, optimizer=optimizer)
    tr = unwrap(TRAIN_TAG, target["train"])
    for obj, key in ((scheduler, "scheduler"), (scaler, "scaler"), (sampler, "sampler"), (extra, "extra")):
        if obj is not None and tr.get(key) is not None:
            obj.load_state_dict(tr[key])
    if "rng" in target:
        restore_rng(unwrap(RNG_TAG, target["rng"][rng_key(env.rank)]))
    else:
        # This rank did not exist when the checkpoint was saved (larger world now):
        # a deterministic, rank-distinct seed instead of a copy of another rank's stream.
        reseed_rng((manifest.step * 1_000_003 + env.rank) & 0x7FFFFFFF)
        log.info("rank %d: no saved RNG state (saved at world size %d); reseeded", env.rank, manifest.world_size)
    return tr
