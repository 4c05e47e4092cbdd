"""Loading a verified checkpoint into live objects, at any world size. Shared by resume
(``CheckpointManager.load``) and the read-only restore sanity step (``tasks.sanity``), which must not
create, clean or repair anything on a tier.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ckptflow.trainer.distenv import DistEnv
from ckptflow.trainer.errors import ConfigError, IntegrityError, LoadError, ManifestError, UntrustedError
from ckptflow.trainer.format.manifest import Manifest
from ckptflow.trainer.safetree import decode
from ckptflow.trainer.state import (
    LAYOUT,
    RANKS,
    TrainState,
    apply_loaded_state,
    buffer_keys,
    build_load_target,
    prefill_optimizer_state,
    reseed_rng,
    restore_rng,
    states_equal,
)

__all__ = ["files_read", "load_local", "load_target", "load_verified"]

Reshard = Callable[[str, list[Any], int, int], Any]
"""``reshard_state(name, saved_states, rank, world) -> state``: what rank ``rank`` of ``world`` takes for
``name`` ("sampler" or "extra") when resuming at another world size and the saved ranks' states differ."""

log = logging.getLogger(__name__)

WHY_BYTES = 2048
"""How much of a failed rank's error the other ranks get (its own log has all of it)."""


def load_target(manifest: Manifest, *, env: DistEnv, state: TrainState, metadata: Any = None) -> dict[str, Any]:
    """The state dict ``dcp.load`` fills for this rank (its structure decides what is read). ``metadata``:
    DCP's (parsed by the restricted reader), for the sizes of the per-rank entries."""
    layout = int(manifest.state.get("layout", 1))
    if layout != LAYOUT:
        raise ManifestError(
            f"step {manifest.step}: its non-tensor state is in layout {layout} (written by a development build "
            f"before 0.1.0); this version reads layout {LAYOUT} only. Its model and optimizer tensors are plain "
            "DCP: read them with dcp.load and save them again with this version",
        )
    model, optimizer = state.model, state.optimizer
    if optimizer is not None:
        prefill_optimizer_state(model, optimizer, metadata)
    sizes = {}
    if metadata is not None:
        for fqn, md in metadata.state_dict_metadata.items():
            if fqn.startswith(f"{RANKS}.") and hasattr(md, "size"):
                sizes[fqn] = int(md.size[0]) if len(md.size) else 0
    return build_load_target(
        model=model,
        optimizer=optimizer,
        rank=env.rank,
        world=env.world_size,
        saved_ranks=int(manifest.state.get("rng_ranks", 0)),
        entry_bytes=sizes,
    )


def files_read(step_dir: str, target: dict[str, Any], metadata: Any = None) -> set[str]:
    """The files a ``dcp.load`` of ``target`` from ``step_dir`` reads on this rank (DCP's own load plan, so
    resharding counts). Call it only once ``.metadata`` matched its manifest."""
    from ckptflow.trainer.dcp.planner import SafeLoadPlanner
    from ckptflow.trainer.format import layout
    from ckptflow.trainer.format.dcpmeta import read_dcp_metadata

    md = metadata if metadata is not None else read_dcp_metadata(step_dir)
    planner = SafeLoadPlanner()  # DCP's plan, item for item (tests/integration/test_fastload.py), built faster
    planner.set_up_planner(target, md, is_coordinator=False)
    plan = planner.create_local_plan()
    return {md.storage_data[item.storage_index].relative_path for item in plan.items} | {layout.DCP_METADATA}


def load_verified(
    path: str,
    manifest: Manifest,
    *,
    env: DistEnv,
    state: TrainState,
    reshard_state: Reshard | None = None,
    reader: Any = None,
) -> dict[str, Any]:
    """``dcp.load`` the checkpoint in ``path`` (manifest authenticated, files not yet read); all ranks call it.
    Every byte is read through :func:`~ckptflow.trainer.dcp.reader.open_reader`'s reader, checked against
    ``manifest`` before any of it is handed on; nothing is unpickled. A mismatch raises ``IntegrityError`` on
    every rank (:func:`load_local` agrees), so callers fall back together. Returns the loaded ``train`` dict.
    ``reader``: a reader of ``path`` to use instead (the bounded sanity step's ``RangeReader``)."""
    model, optimizer, scheduler, scaler = state.model, state.optimizer, state.scheduler, state.scaler
    sampler, extra = state.sampler, state.extra
    from ckptflow.trainer.dcp.planner import SafeLoadPlanner
    from ckptflow.trainer.dcp.reader import open_reader

    # At the saving world size a rank reads mostly its own files: hash them while DCP plans (a guess only)
    mine = (
        [n for n in manifest.files if n.startswith(f"__{env.rank}_")] if manifest.world_size == env.world_size else []
    )
    reader = reader if reader is not None else open_reader(path, manifest, prefetch=mine)
    # No cyclic GC during the load: its many short-lived objects trigger full-heap collections, while
    # reference counting frees them anyway; pausing skips the passes, not the freeing.
    gc_was = gc.isenabled()
    gc.disable()
    try:
        try:
            md = reader.read_metadata()
        except Exception:  # damaged, or not checkable here: the load below fails on this rank, and all agree
            md = None
        target = load_target(manifest, env=env, state=state, metadata=md)
        failed = load_local(target, reader, SafeLoadPlanner(), env)
        if failed is not None:
            why, damage = failed
            if damage:
                raise IntegrityError(
                    f"{path}: could not load it ({why}); its bytes differ from the manifest", path=path
                )
            raise LoadError(
                f"{path}: could not load it ({why}); the model or optimizer structure differs from the one that "
                "saved it, or a resource ran out",
                path=path,
            )
    finally:
        reader.close()  # stops a prefetch the load never reached (read_metadata or planning failed)
        reader.unmap()
        if gc_was:
            gc.enable()
    saved = int(manifest.state.get("rng_ranks", 0))
    per = {
        int(k[len("rank") :]): decode(v.numpy().tobytes(), source=f"{path}: {RANKS}.{k}")
        for k, v in target[RANKS].items()
    }
    own = per.get(env.rank)
    if own is not None and own.get("buffers"):  # this rank's own buffers (BatchNorm statistics, ...)
        for k in buffer_keys(model, target["model"]):
            if k in own["buffers"] and isinstance(target["model"][k], torch.Tensor):
                target["model"][k] = own["buffers"][k]
    apply_loaded_state(target, model=model, optimizer=optimizer)
    tr = own if own is not None else per.get(0) or {}  # scheduler, scaler: the same on every rank
    for obj, key in ((scheduler, "scheduler"), (scaler, "scaler")):
        if obj is not None and tr.get(key) is not None:
            obj.load_state_dict(tr[key])
    for obj, key in ((sampler, "sampler"), (extra, "extra")):
        if obj is not None:
            part = _rank_part(key, per, own, saved, env, reshard_state)
            if part is not None:
                obj.load_state_dict(part)
    if own is not None:
        restore_rng(own["rng"])
    else:
        # A rank new since the save: a deterministic, rank-distinct seed, not a copy of another rank's stream
        reseed_rng((manifest.step * 1_000_003 + env.rank) & 0x7FFFFFFF)
        log.info("rank %d: no saved RNG state (saved at world size %d); reseeded", env.rank, manifest.world_size)
    return {k: tr.get(k) for k in ("step", "scheduler", "scaler")} | {
        "sampler": None if own is None else own.get("sampler"),
        "extra": None if own is None else own.get("extra"),
    }


def load_local(target: dict[str, Any], reader: Any, planner: Any, env: DistEnv) -> tuple[str, bool] | None:
    """``dcp.load(target)`` without its plan exchange: what failed (on which ranks) and whether every failure
    was damage (bytes that differ from the manifest, not a structure mismatch or a resource), or None; all
    ranks call it. For a load DCP's global plan step changes nothing, so passing every rank's pickled plan
    through rank 0 is pure cost. Each rank plans and reads alone; then one small collective (the only one, so
    an early failure leaves no rank waiting) tells every rank whether all succeeded, so callers fall back
    together, and agree on whether what they fell back from was damaged."""
    err: BaseException | None = None
    try:
        md = reader.read_metadata()
        planner.set_up_planner(target, md, env.is_coordinator)
        reader.set_up_storage_reader(md, env.is_coordinator, rank=env.rank, use_collectives=False)
        plan = reader.prepare_local_plan(planner.create_local_plan())
        plan = reader.prepare_global_plan(planner.create_global_plan([plan]))[0]
        reader.read_data(planner.finish_plan(plan), planner).wait()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP's CheckpointException derives from BaseException
        err = e
    # An IntegrityError names the file and what is wrong with it; anything else needs its type.
    mine = "" if err is None else str(err) if isinstance(err, IntegrityError) else f"{type(err).__name__}: {err}"
    damage = isinstance(err, IntegrityError) and not isinstance(err, (UntrustedError, LoadError))
    if env.world_size == 1:
        return None if err is None else (f"rank 0: {mine}", damage)
    flags = torch.zeros(env.world_size, dtype=torch.int32)
    flags[env.rank] = 0 if err is None else 1 if damage else 2
    # Every rank gets here, whatever failed; the checkpoint group's timeout bounds the wait.
    dist.all_reduce(flags, group=env.ckpt_group)
    bad = [r for r in range(env.world_size) if flags[r]]
    if not bad:
        return None
    # bad[0] tells every rank why (as bytes, not a pickle), so every rank's log names the same cause
    why = torch.zeros(WHY_BYTES, dtype=torch.uint8)
    if env.rank == bad[0]:
        b = mine.encode()[:WHY_BYTES]
        why[: len(b)] = torch.frombuffer(bytearray(b), dtype=torch.uint8)
    dist.broadcast(why, src=bad[0], group=env.ckpt_group)
    text = bytes(why.numpy()).rstrip(b"\0").decode(errors="replace")
    more = f"; ranks {', '.join(map(str, bad[1:]))} failed too" if len(bad) > 1 else ""
    return f"rank {bad[0]}: {text}{more}", all(int(flags[r]) == 1 for r in bad)


def _rank_part(key: str, per: dict[int, Any], own: Any, saved: int, env: DistEnv, reshard_state: Reshard | None) -> Any:
    """This rank's ``key`` state: its own at the saving world size; at another, the state all saved ranks had
    (if equal), else what ``reshard_state`` says; never a silent copy of one rank's position for another."""
    if env.world_size == saved:
        return own.get(key) if own is not None else None
    states = [per[r].get(key) for r in range(saved)]
    if all(states_equal(x, states[0]) for x in states):
        return states[0]
    if reshard_state is not None:
        return reshard_state(key, states, env.rank, env.world_size)
    raise ConfigError(
        f"the {key} state was saved per rank at world size {saved} and differs between the ranks; resuming at "
        f"world size {env.world_size} cannot give rank {env.rank} one of them as its own. Pass "
        f"CheckpointManager(reshard_state=fn), fn(name, saved_states, rank, world) -> this rank's state "
        f"(e.g. re-split the data position), or resume at world size {saved}"
    )
