"""Every private piece of torch the trainer uses, imported here and nowhere else, and why.

The trainer is built on DCP's public surface (``dcp.save``/``load``, planners, storage reader and writer,
``DefaultStager``, ``get_state_dict``/``set_state_dict``). Going beyond it (a writer DCP's own reader reads, a
stager reusing the last save's buffers, a cached local plan, whole-chunk read plans) needs the symbols below,
each with its reason. Each exists in every torch of the supported window (2.11-2.14, checked release by
release by ``make test-torch``); a torch lacking one fails at import naming it, not inside a save.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    # narrow_tensor_by_index (dcp/reader.py), ShardedTensor, flatten_state_dict, set_element, _create_chunk_list,
    # _create_read_items (dcp/planner.py): reads planned and narrowed with DCP's own helpers, exactly as DCP would.
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    # DefaultStager's CPU stager, keeping one buffer per live storage between saves: dcp/staging.py
    # subclasses it to skip the deep copy around the buffers.
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager
    from torch.distributed.checkpoint._traverse import set_element

    # _StorageInfo: what a FileSystemWriter's WriteResult carries (file, offset, length) and its reader looks
    # up; dcp/writer.py produces the same.
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner_helpers import _create_chunk_list, _create_read_items
except ImportError as e:  # pragma: no cover - a torch outside the window
    raise ImportError(f"ckptflow needs {e.name or e} from torch {torch.__version__}; supported: torch 2.11-2.14") from e

__all__ = [
    "PLAN_CACHES",
    "ShardedTensor",
    "StateDictStager",
    "_StorageInfo",
    "_create_chunk_list",
    "_create_read_items",
    "cached_local_plan",
    "flatten_state_dict",
    "local_tensor",
    "narrow_tensor_by_index",
    "pending_local_plan",
    "plan_cache_key",
    "set_element",
    "set_plan_cache_key",
    "set_state_dict_stager",
]


def local_tensor(t: Any) -> torch.Tensor:
    """A DTensor's local shard without autograd (``to_local()`` records a graph node and may reduce a partial
    placement): the stager and the writer only read and copy its bytes."""
    return t._local_tensor


def set_state_dict_stager(stager: Any, state_dict_stager: StateDictStager) -> None:
    """Give a ``DefaultStager`` the ``StateDictStager`` it copies with (it takes no argument for one):
    dcp/staging.py's, which reuses the previous save's layout."""
    stager._state_dict_stager = state_dict_stager


# DCP's plan caching (``enable_plan_caching=True``) keys its class-level caches by ``_cached_plans_key``, the
# planner's class name, so two managers in one process would share (and corrupt) one entry: one key per saver
# keeps them apart, and dcp/planner.py drops the entries when the saver closes (else they live forever).
PLAN_CACHES = (
    "_cached_save_plan",
    "_cached_final_save_plan",
    "_cached_all_plans",
    "_cached_global_plan",
    "_cached_metadata",
)


def set_plan_cache_key(planner: Any, key: str) -> None:
    planner._cached_plans_key = key


def plan_cache_key(planner: Any) -> str:
    return str(planner._cached_plans_key)


def cached_local_plan(planner: Any) -> Any:
    """The local plan DCP cached for this planner's key after the last successful save, if any."""
    from torch.distributed.checkpoint.planner import SavePlanner

    return SavePlanner._cached_save_plan.get(plan_cache_key(planner))


def pending_local_plan(planner: Any) -> Any:
    """The local plan DCP made in this save and caches only once the global plan succeeded
    (torch 2.13+; 2.11-2.12 cache it at once, and then there is none pending)."""
    return getattr(planner, "_pending_local_plan", None)
