"""The checkpoint manifest: what a committed checkpoint contains and how to trust it.

``manifest.json`` is written last, by rank 0, after every rank checksummed its own files. It is the single
source of truth for integrity on every tier: each file's size and xxh3-128, the provenance (config hash, data
fingerprint, code and torch version), the step's training metrics, and what the sanity step needs to rebuild
the model and recompute a probe loss.

Optional signing: with ``CKPTFLOW_MANIFEST_KEY`` set (or a key passed in) it carries an HMAC-SHA256 over its
canonical JSON, and an unsigned or tampered manifest is refused everywhere it is read. Flows may name a
Prefect Secret block instead (``CKPTFLOW_MANIFEST_KEY_BLOCK``): see :func:`signing_key`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from ckptflow.trainer.errors import ConfigError, IntegrityError, ManifestError, UnsafePathError, UntrustedError
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.checksum import ALGORITHM, BLOCK_HEX
from ckptflow.trainer.safeopen import read_small

__all__ = [
    "ADOPTED",
    "FORMAT",
    "FORMAT_VERSION",
    "FileEntry",
    "KEY_BLOCK_ENV",
    "KEY_ENV",
    "MAX_MANIFEST_BYTES",
    "Manifest",
    "PLACEMENT",
    "read_manifest",
    "signing_key",
]


FORMAT = "ckptflow.manifest"
FORMAT_VERSION = 1
KEY_ENV = "CKPTFLOW_MANIFEST_KEY"
KEY_BLOCK_ENV = "CKPTFLOW_MANIFEST_KEY_BLOCK"
ADOPTED = "adopted"
"""An adopted checkpoint's manifest key (``tasks/adopt.py``): ``{"source", "format", "adopted_at"}``. One adopted
from a non-DCP format (a ``torch.save`` file, a Hugging Face ``checkpoint-N/``) has no DCP ``.metadata``."""
MAX_MANIFEST_BYTES = 64 << 20  # a manifest larger than this is not ours: refuse early
PLACEMENT = "placement"
"""The key (in ``Manifest.extra``) of a many-node save's record of where each file was placed."""


@dataclass(frozen=True, slots=True)
class FileEntry:
    size: int
    checksum: str
    block_size: int = 0
    """With ``blocks``: the digest per ``block_size`` bytes (``checksum.BLOCK_ALGORITHM``, ``BLOCK_HEX`` hex
    characters each, concatenated), so a load verifies in parallel. 0 and "": not recorded (``checksum`` rules)."""
    blocks: str = ""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"size": self.size, "checksum": self.checksum}
        if self.block_size:
            d |= {"block_size": self.block_size, "blocks": self.blocks}
        return d

    def block_digests(self) -> list[str]:
        return [self.blocks[i : i + BLOCK_HEX] for i in range(0, len(self.blocks), BLOCK_HEX)]


@dataclass(kw_only=True, slots=True)
class Manifest:
    """Typed view of ``manifest.json``. Unknown top-level keys are preserved in ``extra``."""

    run_id: str
    step: int
    world_size: int
    files: dict[str, FileEntry]
    created_at: float = field(default_factory=time.time)
    checksum_algorithm: str = ALGORITHM
    training: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    sanity: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    signature: dict[str, str] | None = None
    authenticated: bool = field(default=False, compare=False)
    """Read with a signing key whose signature it carries: it was written by a holder of the key, and so were
    the bytes its digests vouch for (``dcpmeta`` then parses ``.metadata`` in the caller, unbounded)."""

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.files.values())

    def body(self) -> dict[str, Any]:
        """Everything except the signature, in the order it is written."""
        d: dict[str, Any] = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "run_id": self.run_id,
            "step": self.step,
            "world_size": self.world_size,
            "created_at": self.created_at,
            "checksum_algorithm": self.checksum_algorithm,
            "total_bytes": self.total_bytes,
            "files": {k: v.to_dict() for k, v in sorted(self.files.items())},
            "training": self.training,
            "provenance": self.provenance,
            "sanity": self.sanity,
            "state": self.state,
        }
        d.update(self.extra)
        return d

    def to_json(self, key: bytes | None = None) -> bytes:
        body = self.body()
        key = key if key is not None else signing_key()
        if key:
            body["signature"] = {"alg": "hmac-sha256", "value": _sign(body, key), "key_id": key_id(key)}
        return (json.dumps(body, indent=1, sort_keys=False) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, *, source: str, key: bytes | None = None) -> Manifest:
        """Parse and authenticate; ``source`` (a path or URI) goes into every error."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(
                f"{source}: manifest is {len(data)} bytes, larger than any ckptflow writes; refusing to parse it",
                path=source,
            )
        try:
            d = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ManifestError(
                f"{source}: manifest is not valid JSON ({e}); the checkpoint is damaged, restore an older one",
                path=source,
            ) from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ManifestError(
                f"{source}: not a ckptflow manifest (format "
                f"{d.get('format') if isinstance(d, dict) else type(d).__name__!r})",
                path=source,
            )
        if d.get("format_version") != FORMAT_VERSION:
            raise UntrustedError(
                f"{source}: manifest format_version {d.get('format_version')!r} "
                f"is not supported by this ckptflow (reads {FORMAT_VERSION}); "
                "upgrade ckptflow",
                path=source,
            )
        used = key if key is not None else signing_key()
        _authenticate(d, source, used)
        try:
            files = {}
            for name, entry in d["files"].items():
                try:
                    layout.check_member_name(name)
                except UnsafePathError as err:
                    raise UnsafePathError(f"{source}: {err}", path=source) from None
                size, checksum = entry["size"], entry["checksum"]
                if not isinstance(size, int) or size < 0 or not isinstance(checksum, str):
                    raise ValueError(f"bad entry for {name!r}")
                files[name] = FileEntry(size, checksum, *_blocks(name, size, entry))
            if d.get("checksum_algorithm") != ALGORITHM:
                raise ValueError(f"checksum_algorithm {d.get('checksum_algorithm')!r}")
            known = {
                "format",
                "format_version",
                "run_id",
                "step",
                "world_size",
                "created_at",
                "checksum_algorithm",
                "total_bytes",
                "files",
                "training",
                "provenance",
                "sanity",
                "state",
                "signature",
            }
            m = cls(
                run_id=str(d["run_id"]),
                step=int(d["step"]),
                world_size=int(d["world_size"]),
                files=files,
                created_at=float(d["created_at"]),
                training=dict(d.get("training") or {}),
                provenance=dict(d.get("provenance") or {}),
                sanity=dict(d.get("sanity") or {}),
                state=dict(d.get("state") or {}),
                extra={k: v for k, v in d.items() if k not in known},
                signature=d.get("signature"),
                authenticated=bool(used),
            )
        except IntegrityError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ManifestError(
                f"{source}: manifest is malformed ({e!r}); the checkpoint is "
                "damaged or was edited, restore an older one",
                path=source,
            ) from None
        adopted_as = (m.extra.get(ADOPTED) or {}).get("format")
        if layout.DCP_METADATA not in m.files and adopted_as in (None, "dcp"):  # DCP's, or adopted as DCP
            raise ManifestError(f"{source}: manifest does not list DCP's {layout.DCP_METADATA}", path=source)
        return m


def _blocks(name: str, size: int, entry: dict[str, Any]) -> tuple[int, str]:
    """An entry's block digests, checked for shape: one per ``block_size`` bytes, hex."""
    if "block_size" not in entry and "blocks" not in entry:
        return 0, ""
    bs, blocks = entry.get("block_size"), entry.get("blocks")
    if (
        not isinstance(bs, int)
        or bs <= 0
        or bs % 4096
        or not isinstance(blocks, str)
        or len(blocks) != -(-size // bs) * BLOCK_HEX
        or blocks.strip("0123456789abcdef")
    ):
        raise ValueError(f"bad block digests for {name!r} (block_size {bs!r}, {len(str(blocks))} characters)")
    return bs, blocks


def signing_key() -> bytes | None:
    """The HMAC key, if one is configured: ``CKPTFLOW_MANIFEST_KEY``. ``CKPTFLOW_MANIFEST_KEY_BLOCK`` may name
    a Prefect Secret block instead, which the flows export as that variable (``flows/secrets.py``); the trainer
    never imports Prefect. A block named with no key exported fails closed rather than skip authentication."""
    k = os.environ.get(KEY_ENV)
    if k is not None and not k.strip():
        # An empty value must not read as "no key": a stripped signature plus an edit would then verify.
        raise ConfigError(
            f"{KEY_ENV} is set but empty: give the signing key, or unset the variable to accept unsigned "
            "checkpoints; refusing to guess which"
        )
    if not k and os.environ.get(KEY_BLOCK_ENV):
        raise ConfigError(
            f"{KEY_BLOCK_ENV}={os.environ[KEY_BLOCK_ENV]!r} names a Prefect Secret block, which only "
            f"the flows read; this process must get the key itself: set {KEY_ENV}"
        )
    return k.encode() if k else None


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _sign(body: dict[str, Any], key: bytes) -> str:
    return hmac.new(key, _canonical(body), hashlib.sha256).hexdigest()


def _authenticate(d: dict[str, Any], source: str, key: bytes | None) -> None:
    if not key:
        return  # signing not configured: checksums still protect against corruption
    sig = d.get("signature")
    if not isinstance(sig, dict) or sig.get("alg") != "hmac-sha256":
        raise UntrustedError(
            f"{source}: manifest is not signed but a signing key is configured "
            f"({KEY_ENV}); refusing it. Restore a signed copy from another tier, or "
            f"unset {KEY_ENV} to accept unsigned checkpoints",
            path=source,
        )
    body = {k: v for k, v in d.items() if k != "signature"}
    if not hmac.compare_digest(str(sig.get("value", "")), _sign(body, key)):
        if sig.get("key_id") == key_id(key):  # signed with this very key, and no longer matching: damage
            raise ManifestError(
                f"{source}: manifest signature does not match although it was signed with this key: the manifest "
                "was tampered with or damaged; refusing it",
                path=source,
            )
        raise UntrustedError(
            f"{source}: manifest signature does not match (tampered, or signed with another key); refusing it",
            path=source,
        )


def key_id(key: bytes) -> str:
    """Which key signed a manifest, without saying anything useful about the key: a manifest that no longer
    matches the key it names is damaged; one signed with another key is only not trusted here."""
    return hashlib.sha256(b"ckptflow manifest key id\0" + key).hexdigest()[:16]


def read_manifest(ckpt_dir: str, *, key: bytes | None = None) -> Manifest:
    """Read ``<ckpt_dir>/manifest.json`` from a local directory."""
    path = os.path.join(ckpt_dir, layout.MANIFEST)
    try:
        data = read_small(path, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise ManifestError(
            f"{path}: manifest is missing; the checkpoint was never committed or was damaged, restore an older one",
            path=path,
        ) from None
    return Manifest.from_json(data, source=path, key=key)
