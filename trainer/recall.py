"""The way back: committed checkpoints of a run held beyond the hot root (warm, cold), and bringing one back.

The trainer defines this seam and never imports what implements it: the tiers live a layer above
(``tasks/recall.py``). A :class:`Recall` is passed to the manager explicitly, or found through the entry point
group ``ckptflow.recall``: each entry is a factory ``fn(config: str | None) -> Recall | None``, called with
``CheckpointConfig.tiers`` (a config path, or None for the config the CLI would read); None means "no tiers
configured", and the resume behaves as if the hot root were all there is.

The resume (``trainer/restore.py``) asks rank 0's :meth:`Recall.steps` once, with bounded retries, and shares
the answer; a step a tier holds that is newer than every good step on hot is brought into the hot root with
:meth:`Recall.bring` (every byte checked against the manifest, committed there under the same manifest), then
loaded like any hot checkpoint.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Protocol

from ckptflow.trainer.errors import StorageError

__all__ = ["ENTRY_POINTS", "Brought", "Recall", "TierUnreachableError", "find_recall", "steps_with_retries"]

ENTRY_POINTS = "ckptflow.recall"

log = logging.getLogger(__name__)


class TierUnreachableError(StorageError):
    """A configured tier could not be listed within the retry bound: whether it holds newer checkpoints of the
    run is unknown, so starting over at step 0 could throw training away."""


@dataclass(frozen=True, slots=True)
class Brought:
    """One checkpoint brought back into the hot root."""

    step: int
    tier: str
    """The tier whose copy verified (``warm``, ``cold``)."""
    uri: str
    files: int
    bytes_fetched: int
    """Bytes read from the tier (stored, before decoding)."""
    seconds: float


class Recall(Protocol):
    def describe(self) -> str:
        """The tiers, for messages: ``warm (file:///...), cold (s3://...)``."""
        ...

    def steps(self, run_id: str) -> set[int]:
        """Committed steps of ``run_id`` on any of the tiers, not quarantined there. Raises OSError naming the
        tier when one cannot be listed."""
        ...

    def bring(self, run_id: str, step: int, step_dir: str, only: set[str] | None = None) -> Brought:
        """Fetch ``step`` into ``step_dir`` (absent), every byte verified, committed there with its manifest
        (``only``: these members alone, the manifest listing them all: a node's part).
        Raises IntegrityError (or CheckpointNotFoundError) naming every copy tried when none verifies, and
        DestinationError when ``step_dir`` cannot be written."""
        ...


def find_recall(config: str | None) -> Recall | None:
    """The recall the installed packages offer for ``config`` (see the module docstring), or None."""
    for ep in entry_points(group=ENTRY_POINTS):
        found = ep.load()(config)  # a bad config raises ConfigError: the operator hears it at start
        if found is not None:
            return found
    return None


def steps_with_retries(recall: Recall, run_id: str, *, wait_s: float = 60.0) -> set[int]:
    """:meth:`Recall.steps`, tried again 1, 2, 4... s apart until ``wait_s`` has passed: a tier that blinks (an S3
    endpoint restarting, a mount coming back) is waited for a bounded time, then TierUnreachableError."""
    deadline = time.monotonic() + wait_s
    pause, tries = 1.0, 0
    while True:
        tries += 1
        try:
            return recall.steps(run_id)
        except Exception as e:  # noqa: BLE001 - s3fs passes botocore's connection errors through unwrapped
            left = deadline - time.monotonic()
            log.warning("cannot list %s (try %d, %.0f s left): %s", recall.describe(), tries, max(left, 0), e)
            if left <= 0:
                raise TierUnreachableError(f"{e} (tried {tries} times in {wait_s:g} s)") from e
            time.sleep(min(pause, left))
            pause *= 2
