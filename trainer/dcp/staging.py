"""Staging that reuses the previous save's staged tree when the state's layout has not changed.

DCP's ``StateDictStager`` keeps each tensor's CPU buffer between saves but redoes the deep copy around them (per
tensor a ``new_empty`` and ``set_``, through DTensor's dispatcher). After a DCP-staged save each live tensor is paired
with its staged twin (same path) and the layout recorded (:func:`layout_of`, shared storages included); a later save
with that layout (its tensors may be new objects) copies each live storage into its twin's once and rebuilds only
the containers, with this save's immutable scalars. Anything else is staged by DCP and becomes the new reference.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

from ckptflow.trainer._torch_private import StateDictStager, local_tensor, set_state_dict_stager

__all__ = ["ReusingStager", "ReusingStateDictStager", "layout_of"]


_DICTS = (dict, OrderedDict)
_SCALARS = (bool, int, float, str, bytes)


class _NotReusable(Exception):
    """The tree holds something this module does not restage (DCP stages it instead)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return local_tensor(t) if isinstance(t, DTensor) else t


def _tensor_layout(t: torch.Tensor) -> tuple:
    loc = _local(t)
    dt = (tuple(t.placements), id(t.device_mesh), tuple(t.shape)) if isinstance(t, DTensor) else None
    return (
        type(t),
        loc.dtype,
        loc.device.type,
        tuple(loc.shape),
        tuple(loc.stride()),
        loc.storage_offset(),
        loc.untyped_storage().nbytes(),
        loc.requires_grad,
        dt,
    )


def _walk(tree: Any, out: list, path: tuple = ()) -> Any:
    """Append ``(path, tensor)`` for every tensor leaf; return the tree's shape (containers, keys, leaf kinds) as a
    hashable value."""
    if isinstance(tree, torch.Tensor):
        out.append((path, tree))
        return "T"
    kind = type(tree)
    if kind in _DICTS:
        return (kind, tuple((k, _walk(v, out, (*path, k))) for k, v in tree.items()))
    if kind in (list, tuple):
        return (kind, tuple(_walk(v, out, (*path, i)) for i, v in enumerate(tree)))
    if tree is None or kind in _SCALARS:
        return kind  # immutable: rebuilt with this save's value
    raise _NotReusable(f"a {kind.__name__} at {path}")


def _storage_key(t: torch.Tensor, i: int) -> tuple:
    """Which memory a leaf's storage is (two leaves with one key share it); empty ones share none."""
    st = _local(t).untyped_storage()
    return (st.device.type, st.data_ptr()) if st.nbytes() else ("empty", i)


def _signature(tree: Any) -> tuple[tuple, list[tuple[tuple, torch.Tensor]]]:
    leaves: list[tuple[tuple, torch.Tensor]] = []
    shape = _walk(tree, leaves)
    first: dict[tuple, int] = {}
    layout = []
    for i, (_p, t) in enumerate(leaves):
        layout.append((_tensor_layout(t), first.setdefault(_storage_key(t, i), i)))  # whose storage it shares
    return (shape, tuple(layout)), leaves


def layout_of(tree: Any) -> tuple | None:
    """The layout ``ReusingStateDictStager`` compares (hashable), or None for a tree it does not cover. Two trees with
    one layout get the same DCP save plan (``dcp.planner.canonical_planner``)."""
    try:
        return _signature(tree)[0]
    except _NotReusable:
        return None


def _rebuild(src: Any, staged_leaves: dict[tuple, torch.Tensor], path: tuple = ()) -> Any:
    if isinstance(src, torch.Tensor):
        return staged_leaves[path]
    if isinstance(src, dict):
        return type(src)((k, _rebuild(v, staged_leaves, (*path, k))) for k, v in src.items())
    if isinstance(src, list):
        return [_rebuild(v, staged_leaves, (*path, i)) for i, v in enumerate(src)]
    if isinstance(src, tuple):
        return tuple(_rebuild(v, staged_leaves, (*path, i)) for i, v in enumerate(src))
    return src  # an immutable scalar (``_walk`` lets nothing else through)


def _find(tree: Any, path: tuple) -> Any:
    for k in path:
        tree = tree[k]
    return tree


class ReusingStateDictStager(StateDictStager):
    """DCP's ``StateDictStager`` that restages an unchanged layout by copies alone."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self._sig: tuple | None = None
        self._staged_leaves: dict[tuple, torch.Tensor] = {}
        self._pairs_from: list[int] = []
        """Per storage to copy: the index of the first leaf that holds it."""
        self.reused = 0
        """Saves staged by copies alone (tests, benchmarks)."""

    @torch.no_grad()
    def stage(self, state_dict: Any, non_blocking: bool = False) -> Any:
        try:
            sig, leaves = _signature(state_dict)
        except _NotReusable:
            self._sig = None
            return super().stage(state_dict, non_blocking)
        if sig == self._sig:
            for i in self._pairs_from:
                path, t = leaves[i]
                dst = _local(self._staged_leaves[path]).untyped_storage()
                dst.copy_(_local(t).untyped_storage(), non_blocking=non_blocking)
            self.reused += 1
            return _rebuild(state_dict, self._staged_leaves)
        staged = super().stage(state_dict, non_blocking)
        self._remember(sig, leaves, staged)
        return staged

    def _remember(self, sig: tuple, leaves: list, staged: Any) -> None:
        """Pair each live tensor with its staged twin; any doubt leaves restaging off."""
        self._sig = None
        twins: dict[tuple, torch.Tensor] = {}
        staged_storage: dict[tuple, int] = {}  # live storage -> the staged storage it went to
        pairs: list[int] = []
        for i, (path, t) in enumerate(leaves):
            try:
                s = _find(staged, path)
            except (KeyError, IndexError, TypeError):
                return
            if not isinstance(s, torch.Tensor) or type(s) is not type(t):
                return
            ls, lt = _local(s), _local(t)
            if (
                ls.dtype != lt.dtype
                or ls.shape != lt.shape
                or ls.stride() != lt.stride()
                or ls.storage_offset() != lt.storage_offset()
                or ls.untyped_storage().nbytes() != lt.untyped_storage().nbytes()
            ):
                return
            if ls.untyped_storage().data_ptr() == lt.untyped_storage().data_ptr() and lt.untyped_storage().nbytes():
                return  # not a copy (a stager that passed the tensor through): nothing to refresh
            twins[path] = s
            key = _storage_key(t, i)
            dst = ls.untyped_storage().data_ptr()
            if key not in staged_storage:
                staged_storage[key] = dst
                pairs.append(i)
            elif staged_storage[key] != dst:
                return  # tensors that share a storage live must share their staged one

        self._sig, self._staged_leaves, self._pairs_from = sig, twins, pairs


class ReusingStager(DefaultStager):
    """DCP's stager, restaging an unchanged layout by copies alone (``staging.py``)."""

    def __init__(self, options: StagingOptions) -> None:
        super().__init__(options)
        set_state_dict_stager(self, ReusingStateDictStager(pin_memory=options.use_pinned_memory, share_memory=False))
