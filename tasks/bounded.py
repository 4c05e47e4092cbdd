"""The restore sanity step in memory bounded by one module, not the model.

The model is built on the meta device (no storage). Just before a module runs in the probe forward, its own
parameters and buffers are read from the checkpoint (``RangeReader``: only the blocks under them verified, the
files mapped for that read alone) and put in place; just after, they are put back on the meta device. The forward
runs the same kernels on the same values as after a whole load, so the probe loss is the same, bit for bit. The
tensors brought in do not require grad, so with autograd on (the replay of the step after the save) no graph keeps
a weight past its module; nothing steps. Then every parameter and optimizer tensor is read once, one at a time
(the statistics the expectations check come from that pass), each checked against the shape the model gives it.
Peak memory: the largest module's tensors, the activations, and one optimizer tensor.

A model that cannot run this way raises :class:`NotStreamable` (its builder fails or makes real tensors on the meta
device, it keeps non-persistent buffers the checkpoint does not hold, its names or shapes are not the checkpoint's,
or a forward reads another module's weights directly), and the sanity step loads it whole instead, saying why in
its result: whatever the whole load then finds is the verdict.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ckptflow.trainer.distenv import DistEnv
from ckptflow.trainer.errors import IntegrityError, LoadError
from ckptflow.trainer.loader import load_local
from ckptflow.trainer.state import OPTIM_STATE, plain_name

__all__ = ["NotStreamable", "Streamer", "streamed_model"]

MODEL = "model"


class NotStreamable(Exception):
    """Why a model cannot run with its tensors brought in one module at a time."""


class Streamer:
    """Reads named tensors of the checkpoint (DCP's flattened keys: ``model.<fqn>``, ``optim.state.<fqn>.<key>``)
    into fresh tensors shaped as its ``.metadata`` says; nothing else stays in memory."""

    def __init__(self, reader: Any, env: DistEnv) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.reader, self.env = reader, env
        md = reader.read_metadata()
        self.sizes = {
            k: (tuple(v.size), v.properties.dtype)
            for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)
        }
        self.peak_bytes = 0
        """The most bytes of checkpoint tensors held at once by one read."""

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        from ckptflow.trainer.dcp.planner import SafeLoadPlanner

        missing = [k for k in keys if k not in self.sizes]
        if missing:
            raise NotStreamable(f"the checkpoint holds no tensor {', '.join(missing[:3])} under the model's names")
        got = {k: torch.empty(self.sizes[k][0], dtype=self.sizes[k][1]) for k in keys}
        target: dict[str, Any] = {}
        for k, t in got.items():  # DCP matches flattened names: {"model": {"tok.weight": t}} is model.tok.weight
            head, _, rest = k.partition(".")
            target.setdefault(head, {})[rest] = t
        failed = load_local(target, self.reader, SafeLoadPlanner(), self.env)
        if failed is not None:
            why, damage = failed
            raise (IntegrityError if damage else LoadError)(why)
        self.peak_bytes = max(self.peak_bytes, sum(t.numel() * t.element_size() for t in got.values()))
        return got


def _owned(
    model: torch.nn.Module, streamer: Streamer
) -> list[tuple[torch.nn.Module, list[tuple[str, str, torch.Tensor]]]]:
    """Each module with tensors of its own: (module, [(attribute, checkpoint key, meta tensor)]), every one of them
    in the checkpoint with its shape and dtype, and every model tensor of the checkpoint one of them."""
    out = []
    keys: set[str] = set()
    for mname, mod in model.named_modules():
        own: list[tuple[str, str, torch.Tensor]] = []
        for attr, t in [*mod._parameters.items(), *mod._buffers.items()]:
            if t is None:
                continue
            fqn = plain_name(f"{mname}.{attr}" if mname else attr)  # as DCP's state dict names it
            if t.device.type != "meta":
                raise NotStreamable(f"its builder made {fqn} on {t.device}, not on the meta device")
            if attr in mod._non_persistent_buffers_set:
                raise NotStreamable(f"{fqn} is a non-persistent buffer: the checkpoint does not hold it")
            key = f"{MODEL}.{fqn}"
            if streamer.sizes.get(key) != (tuple(t.shape), t.dtype):
                raise NotStreamable(f"{key}: {streamer.sizes.get(key)} in the checkpoint, the model's is {t.shape}")
            own.append((attr, key, t))
            keys.add(key)
        if own:
            out.append((mod, own))
    extra = sorted(k for k in streamer.sizes if k.startswith(f"{MODEL}.") and k not in keys)
    if extra:
        raise NotStreamable(f"the checkpoint holds model tensors this model has not: {', '.join(extra[:3])}")
    return out


@contextlib.contextmanager
def streamed_model(model: torch.nn.Module, streamer: Streamer) -> Iterator[None]:
    """While inside, ``model`` (built on the meta device) runs with each module's tensors read just before its
    forward and released just after (module doc)."""
    owned = _owned(model, streamer)
    handles = []

    def bring(mod: torch.nn.Module, own: list[tuple[str, str, torch.Tensor]]) -> None:
        got = streamer.read([key for _, key, _ in own])
        for attr, key, _ in own:
            if attr in mod._parameters:
                # no grad: an autograd graph would hold each weight (its AccumulateGrad node) to the end
                mod._parameters[attr] = torch.nn.Parameter(got[key], requires_grad=False)
            else:
                mod._buffers[attr] = got[key]

    def release(mod: torch.nn.Module, own: list[tuple[str, str, torch.Tensor]]) -> None:
        for attr, _, meta in own:
            if attr in mod._parameters:
                mod._parameters[attr] = meta  # type: ignore[assignment]
            else:
                mod._buffers[attr] = meta

    for mod, own in owned:
        handles.append(mod.register_forward_pre_hook(lambda m, _a, own=own: bring(m, own)))
        handles.append(mod.register_forward_hook(lambda m, _a, _o, own=own: release(m, own)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for mod, own in owned:
            release(mod, own)


def stream_stats(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, streamer: Streamer, row: Callable[[str, str, Any], dict]
) -> list[dict[str, Any]]:
    """``tasks.sanity.tensor_stats`` of the checkpoint's parameters and AdamW moments, read one parameter at a
    time, in the same order and under the same names; every optimizer tensor of a parameter is read (and its
    bytes verified) whether or not the statistics use it."""
    rows = []
    names = {id(p): n for n, p in model.named_parameters()}
    for n, _ in model.named_parameters():
        rows.append(row(n, "param", streamer.read([f"{MODEL}.{n}"])[f"{MODEL}.{n}"]))
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names.get(id(p), "?")
            got: dict[str, dict] = {}
            for k in sorted(k for k in streamer.sizes if k.startswith(f"{OPTIM_STATE}{name}.")):  # one at a time
                key = k.rpartition(".")[2]
                shape = streamer.sizes[k][0]
                if shape and shape != tuple(p.shape):
                    raise NotStreamable(f"{k}: {shape} in the checkpoint, its parameter's is {tuple(p.shape)}")
                t = streamer.read([k])[k]
                if key in ("exp_avg", "exp_avg_sq"):
                    got[key] = row(f"{name}.{key}", key, t)
                del t
            rows += [got[key] for key in ("exp_avg", "exp_avg_sq") if key in got]
    return rows
