"""The tiers' side of the trainer's way back (``trainer/recall.py``): warm and cold, as the config names them.

Registered as the entry point ``ckptflow.recall`` (pyproject.toml), so a training process that never names
the tiers still finds them in the config the CLI reads (``$CKPTFLOW_CONFIG``, ``./ckptflow.toml``); with no
config file there is no recall and a resume reads the hot root alone, as it always did.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ckptflow.tasks.config import find_config_file, load_config
from ckptflow.trainer.recall import Brought

if TYPE_CHECKING:
    from ckptflow.tasks.storage import Tier

__all__ = ["TierRecall", "from_config"]

log = logging.getLogger(__name__)


class TierRecall:
    """Warm then cold (the config's order after hot): list, and bring one step back verified."""

    def __init__(self, tiers: Sequence[Tier]) -> None:
        self.tiers = list(tiers)

    def describe(self) -> str:
        return ", ".join(f"{t.name} ({t.url})" for t in self.tiers)

    def steps(self, run_id: str) -> set[int]:
        held: set[int] = set()
        for t in self.tiers:
            try:
                held.update(s for s in t.committed_steps(run_id) if not t.is_quarantined(run_id, s))
            except Exception as e:  # noqa: BLE001 - name the tier: s3fs passes botocore's errors through
                raise OSError(f"the {t.name} tier ({t.url}) cannot be listed: {type(e).__name__}: {e}") from e
        return held

    def bring(self, run_id: str, step: int, step_dir: str, only: set[str] | None = None) -> Brought:
        from ckptflow.tasks.transfer import restore

        # a failed fetch leaves no step_dir
        got = restore(self.tiers, run_id, step_dir, step=step, holder="ckptflow resume", only=only)
        f = got.fetch
        log.info(
            "brought step %d of %s back from %s (%d files, %d bytes, %.2f s)",
            step,
            run_id,
            got.uri,
            f.files,
            f.bytes_stored,
            got.seconds,
        )
        return Brought(step, got.tier, got.uri, f.files, f.bytes_stored, got.seconds)


def from_config(config: str | None) -> TierRecall | None:
    """The recall for the config file ``config`` (None: the CLI's lookup), or None when no file is found or it
    configures no tier beyond hot."""
    if find_config_file(config) is None:
        return None  # every training process asks: without a config file it pays no import of the tiers
    from ckptflow.tasks.storage import open_tiers

    tiers = open_tiers(load_config(config))[1:]
    return TierRecall(tiers) if tiers else None
