"""What a checkpoint records for its restore sanity step: the reference loss and where it came from.

The sanity step rebuilds the model from the files and must reproduce a loss bit for bit: a fixed probe
batch's, computed on the live model at save time (``SanitySpec.probe_fn``, :func:`fixed_batch_record`), or
the first step's after the save (``SanitySpec(reference="next_step")``, :class:`NextStepLoss`).
"""

from __future__ import annotations

import threading
from typing import Any


class NextStepLoss:
    """One save's sanity reference when it is the loss of the first training step after the save: that forward
    pass runs on exactly the checkpoint's state (step N's parameters, the saved data position's next batch, the
    saved RNG), so the sanity step replays it bit for bit. ``CheckpointManager.observe_loss`` hands it over;
    rank 0's commit thread waits for it before writing the manifest. The first to settle it wins:
    ``observe_loss``, the optimizer pre-hook (a step without it: nothing recorded), ``close()`` (no step
    came: the fixed probe batch), or the commit's timeout."""

    def __init__(self, step: int) -> None:
        self.step = step
        self._done = threading.Event()
        self._lock = threading.Lock()
        self.record: dict[str, Any] = {}

    def settle(self, record: dict[str, Any]) -> bool:
        """Set the manifest's ``probe`` record; False (and nothing changes) if already settled."""
        with self._lock:
            if self._done.is_set():
                return False
            self.record = record
            self._done.set()
            return True

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float) -> dict[str, Any]:
        if not self._done.wait(timeout_s):
            self.settle(
                none_recorded(
                    f"no loss of step {self.step + 1} arrived within {timeout_s:g} s "
                    "(SanitySpec.next_step_timeout_s); the sanity step checks the restore without a reference loss"
                )
            )
        return self.record


def next_step_record(loss: float, world_size: int) -> dict[str, Any]:
    return {
        "kind": "next_step",
        "loss": loss,
        "loss_hex": float(loss).hex(),
        "source": "next_step_loss",
        "rank": 0,
        "world_size": world_size,
    }


def fixed_batch_record(loss: float, tokens: list, source: str) -> dict[str, Any]:
    return {"kind": "fixed_batch", "tokens": tokens, "loss": loss, "loss_hex": float(loss).hex(), "source": source}


def none_recorded(reason: str) -> dict[str, Any]:
    return {"kind": "none", "loss": None, "reason": reason}
