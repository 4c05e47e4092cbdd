"""The lifecycle of node-local checkpoints, run in the campaign's process (the ``net`` trials).

The promote is the flow's own (``flows.nodes.node_promote``): every node that can be reached stages its part
into warm; a node that cannot is not waited for, and its files are taken over from the replicas the other nodes
hold; the parts are joined and committed on warm. Then archive from warm to cold, as any lifecycle does. Only the
runner of a node's part differs from a deployment's: here it is this process, reading the node's hot root, where
a deployment sends it to the node's worker; a node behind a cut link counts as a node whose worker stopped
polling (``NO_WORKER``). Verify is the trial's check that follows (``checks.tier_views``: every committed
checkpoint on warm and cold fetched, every byte checked, then verified).
"""

from __future__ import annotations

import logging
from typing import Any

from ckptflow.chaos.workspace import Scratch
from ckptflow.tasks.checkpoint import CheckpointRef
from ckptflow.tasks.config import TierConfig
from ckptflow.tasks.storage import Tier
from ckptflow.trainer.nodes.topology import node_id

log = logging.getLogger("ckptflow.chaos")


class NodeLifecycle:
    """Takes checkpoints saved on the node-local ``roots`` to warm and cold (``scratch``'s tiers)."""

    def __init__(self, scratch: Scratch, roots: list[str]) -> None:
        self.scratch = scratch
        self.cfg = scratch.config()
        self.hots = {node_id(r): Tier(TierConfig(name="hot", url=r)) for r in roots}
        self.nodes = list(self.hots)
        self.done: set[int] = set()
        self.part_states: dict[int, dict[str, str]] = {}
        """Per step, how each node's part ended (``(take-over)``: files of another node, from its replicas)."""

    def run(self, steps: list[int], reachable: list[str]) -> dict[int, str]:
        """Each of ``steps`` not done yet to cold, only the ``reachable`` nodes running their parts. Returns the
        steps that failed, with why (they are tried again at the next call)."""
        from ckptflow.flows.nodes import node_promote
        from ckptflow.tasks.transfer import archive

        failed: dict[int, str] = {}
        warm, cold = self.scratch.tier("warm"), self.scratch.tier("cold")
        for step in sorted(set(steps) - self.done):
            ref = CheckpointRef(self.cfg, self.scratch.run_id, step, records_tier="warm", nodes=tuple(self.nodes))
            try:
                body = node_promote(ref, self.nodes, fan=self._parts(set(reachable)), log=log)
                self.part_states[step] = body["part_states"]
                archive(warm, cold, self.scratch.run_id, step)
                self.done.add(step)
            except Exception as e:  # reported by the trial: a committed step that did not reach cold
                failed[step] = f"{type(e).__name__}: {e}"
        return failed

    def _parts(self, reachable: set[str]) -> Any:
        """``flows.nodes.fan_out``'s contract, each reachable node's part staged here from its hot root."""
        from ckptflow.flows.nodes import NO_WORKER
        from ckptflow.tasks.transfer._parts import stage_part

        def fan(
            action: str, ref: CheckpointRef, nodes: list[str], *, timeout_s: float, take: dict | None = None, **_: Any
        ) -> dict[str, str]:
            assert action == "stage", action
            out: dict[str, str] = {}
            for node in nodes:
                if node not in reachable:
                    out[node] = NO_WORKER
                    continue
                try:
                    mine = (take or {}).get(node, [])
                    stage_part(self.hots[node], ref.tier("warm"), ref.run_id, ref.step, node=node, take=mine)
                    out[node] = "COMPLETED"
                except Exception as e:  # the part failed on that node: the promote takes over or fails
                    log.warning("node %s: part of step %d failed: %r", node, ref.step, e)
                    out[node] = "FAILED"
            return out

        return fan
