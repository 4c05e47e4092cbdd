"""The Hugging Face ``Trainer`` with ckptflow's lifecycle: every ``checkpoint-N`` adopted as it is
written, and a resume from the newest checkpoint that verifies on any tier.

    from ckptflow.integrations.transformers import CkptflowCallback, latest_verified

    trainer = Trainer(..., callbacks=[CkptflowCallback(run_id="gpt")])
    trainer.train(resume_from_checkpoint=latest_verified(args.output_dir, run_id="gpt"))

The callback copies each ``checkpoint-N`` into the hot root the moment the ``Trainer`` has finished
it (``on_save`` runs after ``trainer_state.json``, the last file, is written) and commits it with a
manifest and the ``ckptflow.checkpoint.committed`` event, as ``ckptflow adopt`` does; the deployed
lifecycle verifies, tiers, prunes and drills it from there. The copy runs in the training loop:
the ``Trainer`` deletes old folders (``save_total_limit``) at its next save, and a copy still being
made then would lose its source.

``save_total_limit`` and ckptflow's retention: they govern different copies. ``save_total_limit``
trims the ``Trainer``'s own ``output_dir``; the adopted copies are ckptflow's, kept per tier by the
config's retention (``[hot.retention]``, ``[warm.retention]``, ``[cold.retention]``). With the
callback, ``save_total_limit=1`` is enough: history lives in ckptflow's tiers.
"""

from __future__ import annotations

import os
from typing import Any

from ckptflow.integrations._resolve import newest_verified, run_tiers
from ckptflow.tasks.adopt import adopt
from ckptflow.tasks.config import load_config
from ckptflow.trainer.format import layout

try:  # the callback is a TrainerCallback when transformers is installed; latest_verified needs nothing
    from transformers import TrainerCallback as _Base
except ImportError:  # pragma: no cover - exercised only without the extra
    _Base = object  # type: ignore[assignment,misc]

__all__ = ["CkptflowCallback", "latest_verified"]


class CkptflowCallback(_Base):
    """Adopts each ``checkpoint-N`` the ``Trainer`` saves as ``run_id`` step N.

    ``config``: the ckptflow config file (default: ``$CKPTFLOW_CONFIG`` or ``./ckptflow.toml``);
    its ``[hot] url`` is where checkpoints are committed unless ``root`` is given. The event goes
    to ``$PREFECT_API_URL`` when set (the outbox line is written either way)."""

    def __init__(self, run_id: str, *, config: str | None = None, root: str | None = None) -> None:
        if _Base is object:
            raise ImportError("CkptflowCallback needs transformers: pip install 'ckptflow[transformers]'")
        self.run_id = layout.check_run_id(run_id)
        self.root = root if root is not None else load_config(config).hot.url  # always local
        self.adopted: list[dict[str, Any]] = []
        """The committed record of each checkpoint adopted in this process, in order."""

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        import torch.distributed as dist

        # Every process writes its own RNG file; process zero adopts once all have finished
        # (the barrier is on the Trainer's group, with its timeout, at the same step on each rank).
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        if not state.is_world_process_zero:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        self.adopted.append(
            adopt(
                folder,
                run_id=self.run_id,
                root=self.root,
                step=state.global_step,
                api_url=os.environ.get("PREFECT_API_URL"),
            )
        )


def latest_verified(
    output_dir: str,
    *,
    run_id: str,
    config: str | None = None,
    root: str | None = None,
) -> str | None:
    """The newest checkpoint of ``run_id`` that verifies, as a folder ``Trainer.train(
    resume_from_checkpoint=...)`` reads; None when the run has no committed checkpoint anywhere
    (a first start).

    The manager's walk: newest step first; for one step the hot copy is checked in place (every
    file's digest, then the pickle-free parse of each file), and when it is gone, damaged or
    quarantined the step is brought from warm or cold into the hot root, every byte checked,
    committed there under the tiers' manifest (the lifecycle sees the checkpoint it already
    carried). A step with no good copy anywhere is passed over for the one before it. Raises
    CheckpointNotFoundError, naming every copy tried and why it failed, when checkpoints exist and
    none verifies, and TierUnreachableError when a tier that may hold the newest cannot be listed:
    starting from scratch is never silent. ``output_dir`` (the ``Trainer``'s) is not written: the
    folder returned is on the hot root, where the ``Trainer`` reads it in place."""
    return newest_verified(run_tiers(config, root), run_id)
