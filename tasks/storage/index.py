"""A tier's own index of one stored checkpoint (``tier.json``) and the commit marker.

The trainer's ``manifest.json`` says what the checkpoint *is* (raw bytes, checksums,
provenance); it is copied byte for byte to every tier. ``tier.json`` says how this
tier *stores* it: the codec, and per file the stored object's name, size and digest::

    {"format": "ckptflow.tier-index", "format_version": 1,
     "run_id": "r1", "step": 6, "codec": "zstd", "level": 3,
     "checksum_algorithm": "xxh3_128",
     "manifest_checksum": "<xxh3-128 of the manifest.json bytes stored next to it>",
     "created_at": 1795945694.4, "total_raw_bytes": ..., "total_stored_bytes": ...,
     "files": {"__0_0.distcp": {"size": 1851324, "checksum": "<raw xxh3>",
                                 "stored_name": "__0_0.distcp.zst",
                                 "stored_size": 903211, "stored_checksum": "<stored xxh3>"}}}

Raw size and checksum must equal the manifest's, so the signed manifest stays the one
source of truth and the index only adds the stored form. On object stores the marker
``_COMMITTED`` (uploaded last) carries the digest of ``tier.json``, which carries the
digest of ``manifest.json``: a reader follows marker -> index -> manifest and trusts
nothing it cannot chain back to the marker.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from ckptflow.trainer.errors import ManifestError, UnsafePathError, UntrustedError
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.checksum import ALGORITHM, hash_bytes
from ckptflow.trainer.format.manifest import Manifest

INDEX_FORMAT = "ckptflow.tier-index"
INDEX_VERSION = 1
MARKER_FORMAT = "ckptflow.commit-marker"
MAX_INDEX_BYTES = 64 << 20
# Names a stored object may never take: they would shadow the checkpoint's own records.
RESERVED = frozenset({layout.MANIFEST, layout.TIER_MANIFEST, layout.COMMIT_MARKER})


@dataclass(frozen=True, slots=True)
class StoredFile:
    size: int
    """Raw bytes (equals the trainer manifest)."""
    checksum: str
    """Raw xxh3-128 (equals the trainer manifest)."""
    stored_name: str
    """Object name inside the step dir/prefix, e.g. ``__0_0.distcp.zst``."""
    stored_size: int
    stored_checksum: str


@dataclass(kw_only=True, slots=True)
class TierIndex:
    run_id: str
    step: int
    codec: str
    level: int | None
    manifest_checksum: str
    files: dict[str, StoredFile]
    created_at: float = field(default_factory=time.time)

    @property
    def total_raw_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    @property
    def total_stored_bytes(self) -> int:
        return sum(f.stored_size for f in self.files.values())

    def to_json(self) -> bytes:
        d = {
            "format": INDEX_FORMAT,
            "format_version": INDEX_VERSION,
            "run_id": self.run_id,
            "step": self.step,
            "codec": self.codec,
            "level": self.level,
            "checksum_algorithm": ALGORITHM,
            "manifest_checksum": self.manifest_checksum,
            "created_at": self.created_at,
            "total_raw_bytes": self.total_raw_bytes,
            "total_stored_bytes": self.total_stored_bytes,
            "files": {
                n: {
                    "size": f.size,
                    "checksum": f.checksum,
                    "stored_name": f.stored_name,
                    "stored_size": f.stored_size,
                    "stored_checksum": f.stored_checksum,
                }
                for n, f in sorted(self.files.items())
            },
        }
        return (json.dumps(d, indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, *, source: str) -> TierIndex:
        """Parse and validate (every name checked); ``source`` names the file in errors."""
        if len(data) > MAX_INDEX_BYTES:
            raise ManifestError(f"{source}: tier index is {len(data)} bytes; not ours", path=source)
        try:
            d = json.loads(data)
            if not isinstance(d, dict) or d.get("format") != INDEX_FORMAT:
                raise ValueError("not a ckptflow tier index")
            newer = d.get("format_version") != INDEX_VERSION or d.get("checksum_algorithm") != ALGORITHM
            if newer and isinstance(d.get("format_version"), int) and d["format_version"] > INDEX_VERSION:
                # Written by a newer ckptflow: not damage (a copy is never set aside for it), upgrade to read it.
                raise UntrustedError(
                    f"{source}: tier index format_version {d['format_version']} is newer than this ckptflow reads "
                    f"({INDEX_VERSION}); upgrade ckptflow",
                    path=source,
                )
            if newer:
                raise ValueError(
                    f"format_version {d.get('format_version')!r}, checksum_algorithm "
                    f"{d.get('checksum_algorithm')!r} (this ckptflow reads {INDEX_VERSION}, {ALGORITHM})"
                )
            files = {}
            for name, e in d["files"].items():
                files[name] = StoredFile(
                    int(e["size"]),
                    str(e["checksum"]),
                    str(e["stored_name"]),
                    int(e["stored_size"]),
                    str(e["stored_checksum"]),
                )
            idx = cls(
                run_id=str(d["run_id"]),
                step=int(d["step"]),
                codec=str(d["codec"]),
                level=None if d.get("level") is None else int(d["level"]),
                manifest_checksum=str(d["manifest_checksum"]),
                files=files,
                created_at=float(d["created_at"]),
            )
        except UntrustedError:
            raise
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise ManifestError(
                f"{source}: tier index is malformed ({e}); the stored checkpoint "
                "is damaged, restore it from another tier",
                path=source,
            ) from None
        idx.check_names(source)
        return idx

    def check_names(self, source: str) -> None:
        """Every raw and stored name is safe, stored names are unique and not reserved.

        An index is data from storage: an edited one must not make fetch write, or
        prune delete, anything outside the checkpoint.
        """
        seen: set[str] = set()
        for name, f in self.files.items():
            layout.check_member_name(name)
            layout.check_member_name(f.stored_name)
            if f.stored_name in RESERVED or f.stored_name in seen:
                raise UnsafePathError(
                    f"{source}: stored name {f.stored_name!r} is reserved or "
                    "listed twice; the index was edited, do not use it",
                    path=source,
                )
            seen.add(f.stored_name)

    def check_against(self, manifest: Manifest, manifest_bytes: bytes, source: str) -> None:
        """The index describes exactly this manifest: same run, step, files, raw digests."""
        problems = []
        if hash_bytes(manifest_bytes) != self.manifest_checksum:
            problems.append("manifest.json does not match the digest recorded in the index")
        if (self.run_id, self.step) != (manifest.run_id, manifest.step):
            problems.append(
                f"index is for {self.run_id} step {self.step}, manifest for {manifest.run_id} step {manifest.step}"
            )
        if set(self.files) != set(manifest.files):
            problems.append(f"files differ: index {sorted(self.files)}, manifest {sorted(manifest.files)}")
        for name, f in self.files.items():
            m = manifest.files.get(name)
            if m is not None and (m.size, m.checksum) != (f.size, f.checksum):
                problems.append(f"{name}: raw size/checksum differ from the manifest")
        if problems:
            raise ManifestError(
                f"{source}: tier index and manifest disagree ({'; '.join(problems)}); "
                "the stored checkpoint is damaged or was edited, restore it from "
                "another tier",
                path=source,
            )


def identity_index(manifest: Manifest, manifest_bytes: bytes) -> TierIndex:
    """The index of a checkpoint stored as the trainer wrote it (the hot tier has no tier.json)."""
    return TierIndex(
        run_id=manifest.run_id,
        step=manifest.step,
        codec="none",
        level=None,
        manifest_checksum=hash_bytes(manifest_bytes),
        created_at=manifest.created_at,
        files={n: StoredFile(e.size, e.checksum, n, e.size, e.checksum) for n, e in manifest.files.items()},
    )


def marker_json(index_bytes: bytes) -> bytes:
    """Content of ``_COMMITTED``: the digest of the tier index it vouches for."""
    return (
        json.dumps(
            {"format": MARKER_FORMAT, "tier_index_checksum": hash_bytes(index_bytes), "committed_at": time.time()}
        )
        + "\n"
    ).encode()


def parse_marker(data: bytes, *, source: str) -> str:
    """The tier index digest a marker vouches for."""
    try:
        d: Any = json.loads(data)
        if d.get("format") != MARKER_FORMAT:
            raise ValueError("not a ckptflow commit marker")
        return str(d["tier_index_checksum"])
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise ManifestError(
            f"{source}: commit marker is malformed ({e}); treat the checkpoint as uncommitted and archive it again",
            path=source,
        ) from None
