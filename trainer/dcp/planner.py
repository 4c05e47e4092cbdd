"""DCP's default planners with their hooks overridden; a checkpoint they write or read is plain DCP.

Saving: :func:`canonical_planner` (replicated entries from rank 0; plan caching by layout). Loading:
:class:`SafeLoadPlanner` (byte items through a restricted unpickler; a wanted chunk that is one saved chunk planned
without DCP's resharding sweep).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem, SavePlan, SavePlanner
from torch.distributed.tensor import DTensor

from ckptflow.trainer._torch_private import (
    PLAN_CACHES,
    ShardedTensor,
    _create_chunk_list,
    _create_read_items,
    cached_local_plan,
    flatten_state_dict,
    pending_local_plan,
    plan_cache_key,
    set_element,
    set_plan_cache_key,
)
from ckptflow.trainer.dcp._tensoritem import NOT_PLAIN, plain_item
from ckptflow.trainer.dcp.staging import layout_of
from ckptflow.trainer.errors import IntegrityError

__all__ = ["SafeLoadPlanner", "canonical_planner", "drop_cached_plans", "restricted_load"]


def canonical_planner(cache_key: str | None = None) -> DefaultSavePlanner:
    """DCP's planner, writing every replicated entry from the lowest rank that has it: rank 0.

    DCP's default picks the least loaded rank, assuming replicas are equal; they are not always (DDP's buffers differ
    until the next forward), and a stitched checkpoint restores a model no rank had. ``cache_key``: reuse the previous
    save's plans under that key (DCP's plan caching, keyed per saver so two managers stay apart:
    :func:`drop_cached_plans`); an unchanged layout then also skips rebuilding the local plan
    (:class:`_LayoutCachedPlanner`).
    """
    if cache_key is None:
        return DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    planner = _LayoutCachedPlanner(dedup_save_to_lowest_rank=True, enable_plan_caching=True)
    set_plan_cache_key(planner, cache_key)
    return planner


_LOCAL_LAYOUTS: dict[str, tuple] = {}
"""Per plan-cache key: ((layout, coordinator role), the local plan made from it)."""


class _LayoutCachedPlanner(DefaultSavePlanner):
    """DCP's planner that skips rebuilding an unchanged local plan: DCP's plan caching still builds it each save to
    compare it, yet it is a function of the state's layout (``staging.layout_of``, far cheaper). Same layout and role:
    the cached plan is reused, and the rank sends the empty plan DCP sends for an unchanged one."""

    def create_local_plan(self) -> SavePlan:
        key = plan_cache_key(self)
        here = layout_of(self.state_dict)
        seen = (here, self.is_coordinator) if here is not None else None
        cached = cached_local_plan(self)
        known = _LOCAL_LAYOUTS.get(key)
        # The cached plan must be the one made from this layout: DCP caches it only once a save's global plan succeeded.
        if seen is not None and cached is not None and known is not None and known[0] == seen and known[1] is cached:
            self.plan = cached
            return SavePlan([], usable=False)
        out = super().create_local_plan()
        made = pending_local_plan(self) or cached  # new (cached when it succeeds), or equal
        if seen is None or made is None:
            _LOCAL_LAYOUTS.pop(key, None)
        else:
            _LOCAL_LAYOUTS[key] = (seen, made)
        return out


def drop_cached_plans(cache_key: str) -> None:
    """Forget DCP's cached plans for ``cache_key`` (they live as long as the process otherwise)."""
    for name in PLAN_CACHES:
        getattr(SavePlanner, name, {}).pop(cache_key, None)
    _LOCAL_LAYOUTS.pop(cache_key, None)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, but byte items come back through a restricted loader, and a tensor whose wanted chunk is
    exactly one saved chunk is planned without DCP's resharding sweep."""

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        """DCP's, minus the two passes that change nothing without meta tensors or ShardedTensors (materialising meta
        tensors; splitting ShardedTensors, which otherwise rebuilds a copy of the same dict)."""
        if not _plain_tree(state_dict):
            super().set_up_planner(state_dict, metadata, is_coordinator)
            return
        self.original_state_dict = state_dict
        if self.flatten_state_dict:
            state_dict, self.mappings = flatten_state_dict(state_dict)
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        """DCP's plan, item for item; a tensor that is one saved chunk (every one at the saving world size) is planned
        by a look-up instead of DCP's general path (~15 us an item); anything else goes through DCP's own code."""
        assert self.metadata is not None
        saved = self.metadata.state_dict_metadata
        if any(fqn not in saved for fqn in self.state_dict):
            return super().create_local_plan()  # missing keys: DCP's errors and its pre-2.4 fallback
        requests: list[ReadItem] = []
        for fqn, obj in self.state_dict.items():
            md = saved[fqn]
            if not isinstance(md, TensorStorageMetadata):
                requests += _create_read_items(fqn, md, obj)
                continue
            if getattr(obj, "size", None) is not None and md.size != obj.size():
                raise ValueError(f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}")
            if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
                continue  # not on this rank's part of the mesh (as DCP)
            requests += _whole_chunk_reads(fqn, md, obj) or _create_read_items(fqn, md, obj)
        return LoadPlan(requests)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = plain_item(value.getbuffer())
        if obj is NOT_PLAIN:
            obj = self._restricted_load(read_item, value)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:  # as DCP's own: back where the unflattened state dict has it
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj

    @staticmethod
    def _restricted_load(read_item: ReadItem, value: io.BytesIO) -> Any:
        try:
            return restricted_load(value)
        except Exception as e:  # anything the restricted loader refuses is not ours to run
            raise IntegrityError(
                f"{read_item.dest_index.fqn}: a non-tensor item the restricted loader refuses "
                f"({type(e).__name__}: {str(e)[:200]}); not loading it"
            ) from None


def restricted_load(f: Any, **kw: Any) -> Any:
    """``torch.load(f, weights_only=True)`` with numpy's array rebuilders allowed (RNG states are arrays: ckptflow's
    before state layout 2, Hugging Face's ``rng_state.pth``); anything else a pickle would build is refused."""
    import numpy as np

    allowed: list[Any] = [np.dtype, np.ndarray]
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        try:
            allowed.append(__import__(mod, fromlist=["_reconstruct"])._reconstruct)
        except (ImportError, AttributeError):
            pass
    allowed += [type(np.dtype(d)) for d in ("uint32", "float64", "int64")]
    with torch.serialization.safe_globals(allowed):
        return torch.load(f, weights_only=True, **kw)


def _whole_chunk_reads(fqn: str, md: TensorStorageMetadata, obj: Any) -> list[ReadItem]:
    """The reads of ``obj`` (a tensor or DTensor) if each of its local chunks is exactly one saved chunk (what DCP's
    sweep would return), or it is a whole plain tensor the saved chunks lie in; else [] for the general path."""
    if type(obj) is torch.Tensor and len(md.chunks) == 1:  # the common case, without chunk objects
        c = md.chunks[0]
        if c.sizes == md.size and not any(c.offsets) and all(c.sizes):
            return [
                ReadItem(
                    LoadItemType.TENSOR,
                    MetadataIndex(fqn, c.offsets, 0),
                    c.offsets,
                    MetadataIndex(fqn, c.offsets, 0),
                    c.offsets,
                    c.sizes,
                )
            ]
    if type(obj) is torch.Tensor and len(md.chunks) > 1:
        return _whole_tensor_reads(fqn, md)
    # Saved chunks do not overlap, so a local chunk equal to a saved one is read from it alone (as the sweep finds).
    local = _create_chunk_list(obj)
    where = {(tuple(c.offsets), tuple(c.sizes)): i for i, c in enumerate(md.chunks)}
    out = []
    for i, c in enumerate(local):
        k = where.get((tuple(c.offsets), tuple(c.sizes)))
        if k is None or not all(c.sizes):  # partial overlap, or an empty chunk (DCP reads none)
            return []
        zeros = torch.Size([0] * len(c.offsets))
        out.append(
            ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(fqn, c.offsets, i),
                dest_offsets=zeros,
                storage_index=MetadataIndex(fqn, md.chunks[k].offsets, k),
                storage_offsets=zeros,
                lengths=torch.Size(c.sizes),
            )
        )
    return out


def _whole_tensor_reads(fqn: str, md: TensorStorageMetadata) -> list[ReadItem]:
    """The reads of a whole plain tensor of size ``md.size`` from its saved chunks (saved sharded, loaded by fewer
    ranks): each non-empty chunk read whole into its place, as DCP's sweep returns them and in its order (chunk end
    along the sweep dimension, then index), without its cost; [] (general path) for a chunk outside the tensor."""
    size = tuple(md.size)
    nd = len(size)
    if not nd:
        return []
    chunks = md.chunks
    for c in chunks:
        if len(c.offsets) != nd or len(c.sizes) != nd:
            return []
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, size, strict=True)):
            return []
    sweep, extent = 0, 0  # DCP's: the dimension of largest extent, the first of equals
    for d in range(nd):
        e = max(size[d], *(c.offsets[d] + c.sizes[d] for c in chunks))
        if e > extent:
            sweep, extent = d, e
    zeros = torch.Size([0] * nd)
    dest = MetadataIndex(fqn, zeros, 0)
    order = sorted(
        (k for k, c in enumerate(chunks) if all(c.sizes)),  # an empty chunk overlaps nothing
        key=lambda k: (chunks[k].offsets[sweep] + chunks[k].sizes[sweep], k),
    )
    return [
        ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=dest,
            dest_offsets=torch.Size(chunks[k].offsets),
            storage_index=MetadataIndex(fqn, chunks[k].offsets, k),
            storage_offsets=zeros,
            lengths=torch.Size(chunks[k].sizes),
        )
        for k in order
    ]


def _plain_tree(obj: Any) -> bool:
    """Whether no leaf of a state dict is a ShardedTensor or on the meta device."""
    if isinstance(obj, Mapping):
        return all(_plain_tree(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(_plain_tree(v) for v in obj)
    if isinstance(obj, ShardedTensor):
        return False
    return not (isinstance(obj, torch.Tensor) and obj.is_meta)
