"""Small typed results of the storage actions (what a Prefect task returns and records)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

FaultHook = Callable[[str], None]
"""Called with a phase name (``"archive:uploaded:__0_0.distcp"``, ``"promote:before_commit"``)
as each phase completes; tests raise from it to simulate a crash right there."""


def no_fault(phase: str) -> None:
    return None


@dataclass(slots=True)
class TransferResult:
    """One checkpoint written to a tier (promote, compress, archive)."""

    uri: str
    """The checkpoint on the destination tier (step dir or prefix)."""
    run_id: str
    step: int
    codec: str
    """Codec of the stored form on the destination."""
    files: int = 0
    """Files written or uploaded by this call."""
    skipped_files: int = 0
    """Files already present and correct (a re-run after a crash, or a no-op)."""
    bytes_raw: int = 0
    """Raw (uncompressed) bytes of the whole checkpoint."""
    bytes_stored: int = 0
    """Stored bytes of the whole checkpoint on the destination."""
    bytes_moved: int = 0
    """Stored bytes this call actually wrote or uploaded."""
    seconds: float = 0.0
    """Wall time of the call."""
    encode_seconds: float = 0.0
    """Wall time of the write/upload phase (compression included when the tier compresses)."""
    verify_seconds: float = 0.0
    """Wall time of the after-copy check (re-read and digest, or HEAD of every object)."""
    already_committed: bool = False
    """The destination had this checkpoint committed before the call: nothing was written."""

    @property
    def ratio(self) -> float:
        return self.bytes_raw / self.bytes_stored if self.bytes_stored else 1.0

    def mb_per_s(self) -> float:
        """Raw MB (10^6 bytes) per second of the whole call."""
        return self.bytes_raw / max(self.seconds, 1e-9) / 1e6


@dataclass(slots=True)
class FetchResult:
    """One checkpoint brought from a tier into a local DCP directory, verified."""

    uri: str
    tier: str
    run_id: str
    step: int
    dst_dir: str
    files: int = 0
    bytes_raw: int = 0
    bytes_stored: int = 0
    seconds: float = 0.0
    download_seconds: float = 0.0
    """Bringing stored bytes to this machine (object stores; a plain copy on local tiers)."""
    decompress_seconds: float = 0.0
    """Decoding stored bytes to raw files, digests checked (0 for codec "none")."""
    codec: str = "none"

    def download_mb_s(self) -> float:
        return self.bytes_stored / max(self.download_seconds, 1e-9) / 1e6

    def decompress_mb_s(self) -> float:
        return self.bytes_raw / max(self.decompress_seconds, 1e-9) / 1e6


@dataclass(frozen=True, slots=True)
class Skipped:
    """A checkpoint restore did not use, and why."""

    uri: str
    step: int
    tier: str
    reason: str


@dataclass(slots=True)
class RestoreResult:
    """The newest checkpoint that verified, where it came from, and what was passed over."""

    uri: str
    tier: str
    run_id: str
    step: int
    dst_dir: str
    fetch: FetchResult
    skipped: list[Skipped] = field(default_factory=list)
    seconds: float = 0.0
