"""DCP's ``get_state_dict`` and ``set_state_dict`` for one load, without doing their work twice.

Both public functions start by walking the module tree to map every parameter to its canonical
name (``_verify_options``: 1.6 ms for the reference small model here), and ``set_state_dict``
then walks it twice more per key to load the model (3.3 ms), although after a ``dcp.load`` in
place nearly every tensor it would copy *is* the module's own tensor. On a resume those fixed
costs are a fifth of a 167 MB load. :class:`StateDicts` keeps the mapping from the ``get`` for
the ``set`` of the same load, and applies an in-place model load without DCP's walk where
nothing but the default ``load_state_dict`` would run (see :func:`_in_place_copies`).

The mapping is DCP's private ``_StateDictInfo``; where this torch lacks the private functions,
everything goes through the public ones (the same result, slower).

Most of what is left of both is DCP's ``_get_fqns``, asked three times per parameter: it walks
the name's attributes to find wrappers that rename (DDP, FSDP1, ``torch.compile``, activation
checkpointing, a module's ``_fqn_modifiers``) — 7 of the 11 ms ``get`` took for a 218M-parameter
model here. In a module tree with none of them every canonical name is the name itself, so while
:class:`StateDicts` calls DCP it answers so for that model (:func:`_plain_names`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint import state_dict as dsd
from torch.distributed.tensor import DTensor

_PRIVATE = all(
    hasattr(dsd, n)
    for n in (
        "_verify_options",
        "_get_model_state_dict",
        "_get_optim_state_dict",
        "_verify_state_dict",
        "_unflatten_model_state_dict",
        "_load_optim_state_dict",
        "_load_model_state_dict",
        "_get_fqns",
    )
)


class StateDicts:
    """The model's and optimizer's state dicts for one load: :meth:`get` the target, ``dcp.load``
    into it, then :meth:`set` it. The model's structure must not change in between."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self._info: Any = None
        self.skipped_walk = False
        """Whether the last :meth:`set` loaded the model without DCP's walk (for tests)."""

    def get(self) -> tuple[dict[str, Any], dict[str, Any]]:
        if not _PRIVATE:
            return dsd.get_state_dict(self.model, self.optimizer)
        optims = (self.optimizer,)
        with _plain_names(self.model):
            # What get_state_dict does, keeping the info (its options: the defaults, as set_state_dict's).
            info = dsd._verify_options(self.model, optims, optim_only=False)
            model_sd = dsd._get_model_state_dict(self.model, info)
            optim_sd = dsd._get_optim_state_dict(self.model, optims, info)
            dsd._verify_state_dict(model_sd, optim_sd, info)
        self._info = info
        return model_sd, optim_sd

    def set(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        self.skipped_walk = False
        if self._info is None:
            dsd.set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
            return
        copies = self._set(model_sd, optim_sd)
        if copies is None:
            return
        with torch.no_grad():
            for dst, src in copies:
                dst.copy_(src)
        self.skipped_walk = True

    def _set(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> list[tuple[Any, Any]] | None:
        """Load the optimizer, and the model through DCP where it must (then None); else the
        copies that load the model in place (:func:`_in_place_copies`)."""
        optims = (self.optimizer,)
        if not _names_current(self._info, self.model):
            with _plain_names(self.model):
                self._info = dsd._verify_options(self.model, optims, optim_only=False)
        info = self._info
        model_sd = dsd._unflatten_model_state_dict(self.model, model_sd)
        dsd._verify_state_dict(model_sd, optim_sd, info)
        dsd._load_optim_state_dict(self.model, optims, optim_sd, info)  # names nothing (but for FSDP1)
        copies = _in_place_copies(self.model, model_sd)
        if copies is None:
            with _plain_names(self.model):
                dsd._load_model_state_dict(self.model, model_sd, info)
        return copies


MODIFIERS = "_fqn_modifiers"
"""The method by which a module renames its state for DCP (``_get_fqns``'s default)."""
_NAMES_LOCK = threading.Lock()
"""Held while ``dsd._get_fqns`` is replaced (one :func:`_plain_names` at a time)."""


@contextlib.contextmanager
def _plain_names(model: torch.nn.Module) -> Iterator[None]:
    """Within, DCP's ``_get_fqns(model, name)`` returns ``{name}`` at once where ``model``'s tree has
    nothing that renames (:func:`_module_names`) and ``name``'s module is one of its modules: what
    DCP's walk returns for it then (``tests/integration/test_fastload.py`` compares the two). Other models,
    other names and other arguments go to DCP's own function."""
    names = _module_names(model)
    if names is None:
        yield
        return
    with _NAMES_LOCK:
        dcps = dsd._get_fqns

        def plain(
            m: torch.nn.Module,
            name: str,
            dsd_fqn_modifiers: str = MODIFIERS,
            skip_ddp_prefix: bool = True,
            skip_compiler_prefix: bool = True,
        ) -> set[str]:
            # The skip_*_prefix flags change nothing without DDP or torch.compile's wrapper.
            if m is model and dsd_fqn_modifiers == MODIFIERS and name.rpartition(".")[0] in names:
                return {name}
            return dcps(m, name, dsd_fqn_modifiers, skip_ddp_prefix, skip_compiler_prefix)

        dsd._get_fqns = plain  # type: ignore[assignment]  # (mypy: a module function is not assignable)
        try:
            yield
        finally:
            dsd._get_fqns = dcps


def _module_names(model: torch.nn.Module) -> set[str] | None:
    """The names of ``model``'s modules (``""``: itself), or None where ``_get_fqns`` might map a
    name to another one: a module DCP unwraps (DDP, FSDP1, ``torch.compile``'s, activation
    checkpointing's), one with ``_fqn_modifiers``, or a name with checkpointing's prefix in it."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX, ActivationWrapper
    from torch.distributed.fsdp import FullyShardedDataParallel

    ddp = torch.nn.parallel.DistributedDataParallel
    renaming: tuple[type, ...] = (ddp, FullyShardedDataParallel, ActivationWrapper)
    frames = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing is compiled
    if frames is not None:
        renaming += (frames.OptimizedModule,)
    names = set()
    for name, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, renaming) or hasattr(m, MODIFIERS) or _CHECKPOINT_PREFIX in f"{name}.":
            return None
        names.add(name)
    return names


def _names_current(info: Any, model: torch.nn.Module) -> bool:
    """Whether ``info``'s mapping still holds the module's parameters, the very objects. After a
    forward without backward (an evaluation, the sanity probe) FSDP2's root module has its
    unsharded parameters registered, and taking a state dict registers the sharded ones again:
    a mapping made before then names tensors the optimizer does not hold, and DCP's optimizer
    load fails on it (``KeyError``). DCP's ``set_state_dict`` maps anew each time; here that is
    done only where it is needed (checking costs ~0.2 ms for 231 parameters)."""
    mapping = info.fqn_param_mapping
    return all(p in mapping for p in model.parameters())


_PLAIN_LOADS = (
    torch.nn.Module._load_from_state_dict,
    # BatchNorm's adds only a missing ``num_batches_tracked`` (from before version 2); the keys
    # are checked to be the model's own, so it is never missing here.
    torch.nn.modules.batchnorm._NormBase._load_from_state_dict,
)


def _in_place_copies(model: torch.nn.Module, model_sd: dict[str, Any]) -> list[tuple[Any, Any]] | None:
    """The copies ``model.load_state_dict(model_sd)`` would make that are not a tensor onto
    itself, where that is all it would do; None where it might do more.

    It does no more when every module loads with ``nn.Module``'s own ``_load_from_state_dict``
    (or BatchNorm's) and has no state-dict hooks or extra state, tensors are not swapped
    (``torch.__future__``), the keys are exactly the model's own state dict's (so DCP's renaming
    would change nothing; DDP's ``module.`` is taken off) and every tensor has its module
    tensor's shape, kind and dtype. Then loading copies each tensor, and a tensor that shares
    its module tensor's memory (what ``dcp.load`` filled in place) copies onto itself.
    """
    if torch.__future__.get_swap_module_params_on_conversion():
        return None
    base = torch.nn.Module
    for m in model.modules():
        cls = type(m)
        if (
            cls._load_from_state_dict not in _PLAIN_LOADS
            or cls.set_extra_state is not base.set_extra_state
            or m._load_state_dict_pre_hooks
            or m._load_state_dict_post_hooks
            or m._state_dict_pre_hooks
            or m._state_dict_hooks
        ):
            return None
    # DDP adds nothing to loading but its ``module.`` prefix, which DCP's names drop.
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    own = inner.state_dict(keep_vars=True)
    if own.keys() != model_sd.keys():
        return None
    copies = []
    for k, t in own.items():
        v = model_sd[k]
        if (
            not isinstance(v, torch.Tensor)
            or isinstance(v, DTensor) != isinstance(t, DTensor)
            or v.shape != t.shape
            or v.dtype != t.dtype
            or t.is_meta
        ):
            return None
        a, b = t, v
        if isinstance(t, DTensor) and isinstance(v, DTensor):
            if v.placements != t.placements or v.device_mesh != t.device_mesh:
                return None
            a, b = t._local_tensor, v._local_tensor
        if a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.shape == b.shape:
            continue  # the same memory: a copy onto itself
        copies.append((t, v))
    return copies
