"""The restore sanity step: prove a checkpoint restores, not just that its bytes match.

    python -m ckptflow.tasks.sanity CKPT_DIR [--out result.json] [--stats stats.json]
    torchrun --nproc-per-node=3 -m ckptflow.tasks.sanity CKPT_DIR ...   # at another world size

In a fresh process: verify every file against the manifest, rebuild the model,
optimizer and LR schedule with the builder the manifest names, load the checkpoint
at the current world size (DCP reshards), recompute the reference loss and compare it
with the one recorded at save time, and check the restored scheduler yields the recorded
next learning rate. The reference is either the loss of the recorded probe batch, or
(``SanitySpec(reference="next_step")``) the loss the training loop computed at the first
step after the save: replayed here from the restored data position and the saving rank 0's
RNG, in train mode, so it also proves those two were restored. Read-only: nothing on the tier
is created, cleaned or repaired.

Tolerance: on the same platform (torch version, thread count) the probe loss is
reproduced **bitwise** — the forward pass sees the same parameter bits whatever
the sharding. Across platforms a relative tolerance of ``--rtol`` (1e-5) applies and
the result says which rule was used.

``--stats`` also writes per-tensor statistics of the restored model and optimizer
state (finite, norm, min/max, mean) for the expectation suite of the verify stage.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from ckptflow.tasks.bounded import NotStreamable
from ckptflow.trainer.distenv import DistEnv, exit_process, init_distributed, shutdown
from ckptflow.trainer.errors import CkptflowError, ConfigError, IntegrityError, LoadError
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.manifest import ADOPTED, Manifest
from ckptflow.trainer.loader import load_verified
from ckptflow.trainer.resume import verify_together
from ckptflow.trainer.state import TrainState

__all__ = ["BUILDERS_ENV", "allowed_builders", "import_builder", "main", "resolve_builder", "run", "tensor_stats"]


BUILDERS_ENV = "CKPTFLOW_SANITY_BUILDERS"


def allowed_builders() -> set[str]:
    """Builders the sanity step may import: the reference job's, plus ``$CKPTFLOW_SANITY_BUILDERS``
    (comma-separated ``module:function``; register your own model's builder there)."""
    from ckptflow.trainer.reference.build import BUILDER

    extra = os.environ.get(BUILDERS_ENV, "")
    return {BUILDER} | {b.strip() for b in extra.split(",") if b.strip()}


def resolve_builder(name: str):
    """Import the builder a manifest names — only if it is on the allow-list.

    The name comes from storage: importing whatever a manifest says would let an
    edited manifest run code from any installed module, checksums or not.
    """
    _split(name)  # a malformed name gets its own error first
    if name not in allowed_builders():
        raise ConfigError(
            f"sanity builder {name!r} named by the manifest is not allowed; add it to "
            f"${BUILDERS_ENV} (comma-separated module:function) if it is your model's builder"
        )
    return import_builder(name)


def import_builder(name: str):
    """Import a ``module:function`` builder, no allow-list: for names from the user's own code
    (``SanitySpec.builder`` in the training process), never for names read from storage."""
    mod, fn = _split(name)
    try:
        return getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:  # not installed where this runs: a fact about the worker
        raise ConfigError(
            f"sanity builder {name!r} cannot be imported here ({type(e).__name__}: {e}); install the model's "
            "code where the lifecycle runs"
        ) from e


def _split(name: str) -> tuple[str, str]:
    mod, _, fn = str(name).partition(":")
    if not mod or not fn:
        raise ConfigError(f"sanity builder {name!r} must be 'module:function'")
    return mod, fn


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def tensor_stats(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Per-tensor statistics of parameters and AdamW moments (collective under FSDP)."""
    rows = []
    names = {id(p): n for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        rows.append(_row(n, "param", _full(p.detach())))
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st:
                    rows.append(_row(f"{names.get(id(p), '?')}.{key}", key, _full(st[key])))
    return rows


def _row(name: str, kind: str, t: torch.Tensor) -> dict[str, Any]:
    f = t.float()
    finite = torch.isfinite(f)
    n_finite = int(finite.sum())
    fin = f if n_finite == f.numel() else f[finite]  # no copy in the common case: every value finite
    return {
        "name": name,
        "kind": kind,
        "numel": f.numel(),
        "finite_frac": n_finite / f.numel() if f.numel() else 1.0,
        "norm": float(fin.norm()) if fin.numel() else 0.0,
        "min": float(fin.min()) if fin.numel() else 0.0,
        "max": float(fin.max()) if fin.numel() else 0.0,
        "mean": float(fin.mean()) if fin.numel() else 0.0,
    }


def run(ckpt_dir: str, *, rtol: float = 1e-5, want_stats: bool = False, whole: bool = False) -> dict[str, Any]:
    t0 = time.perf_counter()
    env = init_distributed()
    # The cheap checks (manifest, every file present with its size) here; the load verifies
    # every byte as it reads it, before any of it reaches the model.
    manifest, problems, _ = verify_together(ckpt_dir, env.rank, env.world_size, env.ckpt_group, deep=False)
    t_verify = time.perf_counter() - t0
    out: dict[str, Any] = {"ckpt": ckpt_dir, "world_size": env.world_size, "ok": False}
    if manifest is None:
        out.update(error="integrity", problems=problems)
        return out
    san = manifest.sanity
    out.update(step=manifest.step, saved_world_size=manifest.world_size)
    if ADOPTED in manifest.extra and os.path.exists(os.path.join(ckpt_dir, layout.DCP_METADATA)):
        out.update(_every_item(ckpt_dir, manifest, env))
        out["seconds"]["verify"] = t_verify
        return out
    if not san.get("builder"):
        out.update(error="no-sanity-spec", problems=["manifest records no sanity builder"])
        return out
    if san.get("torch_threads"):
        torch.set_num_threads(int(san["torch_threads"]))
    builder = resolve_builder(san["builder"])
    probe = san.get("probe") or {}
    kind = probe.get("kind", "fixed_batch")  # checkpoints before SanitySpec.reference have no kind
    got: dict[str, Any] | None = None
    if env.world_size == 1 and not whole:
        try:
            got = _restore_and_probe(ckpt_dir, manifest, env, builder, san, want_stats, bounded=True)
        except NotStreamable as e:  # the whole load decides, and the result says why
            out["bounded_note"] = f"loaded whole: {e}"
        else:
            if "error" not in got and _match(got["loss"], probe.get("loss"), manifest, rtol) == "mismatch":
                # a verdict of the streamed run alone never quarantines: the whole load decides
                out["bounded_note"] = f"the streamed probe gave {got['loss']!r}; loaded whole to decide"
                got = None
    if got is None:
        got = _restore_and_probe(ckpt_dir, manifest, env, builder, san, want_stats, bounded=False)
    if "error" in got:
        out.update(got)
        return out
    loss, rec = got["loss"], probe.get("loss")
    match = _match(loss, rec, manifest, rtol)
    rec_lr = san.get("next_lr")
    lr_ok = rec_lr is None or got["lr"] == float(rec_lr)
    out.update(
        probe_kind=kind,
        probe_loss_recorded=rec,
        probe_loss_restored=loss,
        probe_match=match,
        probe_abs_diff=abs(loss - float(rec)) if loss is not None and rec is not None else None,
        lr_recorded=rec_lr,
        lr_restored=got["lr"],
        lr_match=lr_ok,
        same_platform=manifest.provenance.get("torch_version") == torch.__version__,
        rtol=rtol,
        memory=got["memory"],
        seconds={"verify": t_verify, **got["seconds"], "total": time.perf_counter() - t0},
    )
    if match == "not_recorded":
        out["probe_note"] = probe.get("reason", "no reference loss recorded")
    out["ok"] = match != "mismatch" and lr_ok
    if want_stats:
        out["stats"] = got["stats"]
    if "largest_read_bytes" in got:
        out["largest_read_bytes"] = got["largest_read_bytes"]
    return out


def _match(loss: float | None, rec: Any, manifest: Manifest, rtol: float) -> str:
    if rec is None or loss is None:
        return "not_recorded"  # the restore is still proven; the reason is in the manifest
    if loss == float(rec):
        return "bitwise"
    same_platform = manifest.provenance.get("torch_version") == torch.__version__
    return "within_rtol" if not same_platform and math.isclose(loss, float(rec), rel_tol=rtol) else "mismatch"


def _restore_and_probe(
    ckpt_dir: str, manifest: Manifest, env: DistEnv, builder: Any, san: dict, want_stats: bool, *, bounded: bool
) -> dict[str, Any]:
    """Rebuild, restore and run the probe: whole (every tensor loaded first), or ``bounded`` (``tasks/bounded.py``:
    raises NotStreamable when the model cannot run that way). ``{"error": ...}`` when the model is not one the
    manifest's reference can be replayed on, or the load fails."""
    from ckptflow.tasks.bounded import NotStreamable, Streamer, stream_stats, streamed_model
    from ckptflow.trainer.dcp.reader import RangeReader

    parallel = "fsdp" if env.world_size > 1 else "none"
    if bounded:
        try:
            with torch.device("meta"):
                built = builder(san["config"], parallel=parallel)
        except Exception as e:  # noqa: BLE001 - a builder that needs real tensors (.item(), numpy, file reads)
            raise NotStreamable(f"its builder failed on the meta device ({type(e).__name__}: {e})"[:500]) from e
    else:
        built = builder(san["config"], parallel=parallel)
    probe = san.get("probe") or {}
    kind = probe.get("kind", "fixed_batch")
    sampler = None
    if kind == "next_step":
        if not (hasattr(built, "replay_sampler") and hasattr(built, "replay_loss")):
            return {
                "error": "no-replay",
                "problems": [
                    f"the manifest's reference is the loss of the step after the save, and builder "
                    f"{san['builder']} cannot replay a step (its Built needs replay_sampler and replay_loss)"
                ],
            }
        sampler = built.replay_sampler(int(probe["world_size"]))
    t1 = time.perf_counter()
    reader = RangeReader(ckpt_dir, manifest) if bounded else None
    try:
        # Restores this rank's RNG of the saving run (rank 0's here on rank 0) and the data position; bounded,
        # the model's and optimizer's tensors are read later, as they are used
        model = torch.nn.Module() if bounded else built.model
        opt = None if bounded else built.optimizer
        state = TrainState(model=model, optimizer=opt, scheduler=built.scheduler, sampler=sampler)
        load_verified(ckpt_dir, manifest, env=env, state=state, reader=reader)
    except LoadError as e:  # verified bytes this model could not take: this worker's builder, or its memory
        return {"error": "load", "problems": [str(e)]}
    except IntegrityError as e:
        return {"error": "integrity", "problems": [str(e)]}
    t_load = time.perf_counter() - t1
    t2 = time.perf_counter()
    streamer = Streamer(reader, env) if reader is not None else None
    stats = None
    try:
        with streamed_model(built.model, streamer) if streamer is not None else contextlib.nullcontext():
            loss = _probe_loss(built, kind, probe, sampler)
        t_probe = time.perf_counter() - t2
        if streamer is not None:  # every parameter and optimizer tensor read once, its bytes verified as it is
            stats = stream_stats(built.model, built.optimizer, streamer, _row)
    except NotStreamable:
        raise
    except (LoadError, IntegrityError) as e:
        return {"error": "integrity" if not isinstance(e, LoadError) else "load", "problems": [str(e)]}
    except RuntimeError as e:
        if streamer is None:
            raise
        raise NotStreamable(f"its forward failed with each module's tensors brought in alone ({e})"[:500]) from e
    if streamer is None and want_stats:
        stats = tensor_stats(built.model, built.optimizer)
    return {
        "loss": loss,
        "lr": float(built.scheduler.get_last_lr()[0]),
        "stats": stats,
        "memory": "bounded" if streamer is not None else "whole",
        "seconds": {"load": t_load, "probe": t_probe},
        **({"largest_read_bytes": streamer.peak_bytes} if streamer is not None else {}),
    }


def _probe_loss(built: Any, kind: str, probe: dict, sampler: Any) -> float | None:
    if kind == "next_step":
        return built.replay_loss(sampler)  # every rank: a collective under FSDP; rank 0's is compared
    if kind == "fixed_batch":
        built.probe = torch.tensor(probe["tokens"], dtype=torch.long)
        return built.probe_loss()
    return None


def _every_item(ckpt_dir: str, manifest: Manifest, env: DistEnv) -> dict[str, Any]:
    """A DCP checkpoint another tool wrote, restored at this world size with no model to build:
    every item its metadata lists is loaded whole on every rank (DCP reshards from the saved
    chunks), through the verifying reader (every block's digest) and the restricted loader (byte
    items), and the ranks compare what they got, tensor by tensor."""
    import io

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ckptflow.trainer.dcp.planner import SafeLoadPlanner
    from ckptflow.trainer.dcp.reader import open_reader
    from ckptflow.trainer.format.checksum import hash_bytes
    from ckptflow.trainer.format.dcpmeta import read_dcp_metadata

    t0 = time.perf_counter()
    md = read_dcp_metadata(ckpt_dir)
    state: dict[str, Any] = {}
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            state[fqn] = torch.empty(item.size, dtype=item.properties.dtype)
        else:
            state[fqn] = io.BytesIO()
    try:
        dcp.load(
            state,
            storage_reader=open_reader(ckpt_dir, manifest),
            planner=SafeLoadPlanner(),
            process_group=env.ckpt_group,
        )
    except CkptflowError as e:
        return {"error": "integrity", "problems": [str(e)], "check": "every_item"}
    except MemoryError as e:
        return {"error": "resources", "problems": [f"MemoryError: {e}"], "check": "every_item"}
    except (Exception, dcp.CheckpointException) as e:  # the latter is a BaseException
        return {"error": "load", "problems": [f"{type(e).__name__}: {str(e)[:500]}"], "check": "every_item"}
    t_load = time.perf_counter() - t0
    # Tensors only: a byte item comes back as whatever object it pickled, with no stable bytes.
    mine = {
        k: hash_bytes(v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        for k, v in state.items()
        if isinstance(v, torch.Tensor)
    }
    every: list[Any] = [None] * env.world_size
    dist.all_gather_object(every, mine, group=env.ckpt_group)
    differ = sorted(k for k in mine if any(r[k] != mine[k] for r in every))
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    return {
        "ok": not differ,
        "check": "every_item",
        "items": len(state),
        "tensors": len(tensors),
        "bytes": sum(t.numel() * t.element_size() for t in tensors),
        "problems": [f"ranks loaded different values for {k}" for k in differ[:10]],
        "seconds": {"load": t_load, "total": time.perf_counter() - t0},
    }


def _first_to_go() -> None:
    """If the kernel must kill a process for memory (the machine's, or a container's limit), this check is the one
    to go: the worker that runs the lifecycle survives and records the checkpoint as unproven, not lost with it.
    Raising one's own OOM score needs no privilege; where /proc is not Linux's, nothing changes."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ckptflow.tasks.sanity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("ckpt_dir")
    p.add_argument("--out", help="write the JSON result here (rank 0)")
    p.add_argument("--stats", action="store_true", help="include per-tensor statistics")
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument(
        "--whole", action="store_true", help="load every tensor before the probe (default at world size 1: bounded)"
    )
    a = p.parse_args(argv)
    _first_to_go()
    try:
        res = run(os.path.abspath(a.ckpt_dir), rtol=a.rtol, want_stats=a.stats, whole=a.whole)
    except CkptflowError as e:
        res = {"ckpt": a.ckpt_dir, "ok": False, "error": type(e).__name__, "problems": [str(e)]}
    except MemoryError as e:
        res = {"ckpt": a.ckpt_dir, "ok": False, "error": "resources", "problems": [f"MemoryError: {e}"]}
    # What this check cost in CPU, imports included: a fresh process pays for torch and DCP, a child
    # forked from the fork server only for the check (a process's CPU time starts at its fork).
    res["process_cpu_seconds"] = time.process_time()
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        text = json.dumps(res, indent=1)
        if a.out:
            with open(a.out, "w") as f:
                f.write(text)
        else:
            print(text)
    shutdown()
    return 0 if res.get("ok") else 1


if __name__ == "__main__":
    exit_process(main())
