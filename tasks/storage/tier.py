"""One storage tier: a root URL and an fsspec file system, with the tier's commit rule.

Every tier stores runs the same way (``trainer.layout``); what differs is how a
checkpoint becomes trusted:

* **rename tiers** (local and shared file systems: hot, warm) write ``step_N.tmp/``
  and rename it to ``step_N/``; a step dir with its ``manifest.json`` is committed.
* **marker tiers** (object stores: cold) cannot rename, so every object is uploaded
  first, then ``tier.json``, then ``manifest.json``, then ``_COMMITTED`` last; only a
  step with the marker is committed, however many of its objects exist.

Reads go through ``fs`` for every tier (one code path); local writes that must be
durable use ``trainer.fsutil`` (fsync of file and directory), which fsspec does not do.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import fsspec

from ckptflow.tasks.config import TierConfig
from ckptflow.tasks.storage.index import TierIndex, identity_index, parse_marker
from ckptflow.tasks.storage.s3 import S3Objects
from ckptflow.trainer.errors import (
    CheckpointNotFoundError,
    IntegrityError,
    ManifestError,
    StorageError,
    UnsafePathError,
    UntrustedError,
)
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.atomicity import RENAME, CommitRule, MarkerCommit, RenameCommit
from ckptflow.trainer.format.checksum import hash_bytes
from ckptflow.trainer.format.manifest import MAX_MANIFEST_BYTES, Manifest
from ckptflow.trainer.fsutil import remove_tree, replace_atomic
from ckptflow.trainer.safeopen import read_small
from ckptflow.trainer.verify import resolve_member

log = logging.getLogger(__name__)


def _io_errors() -> tuple[type[BaseException], ...]:
    """What a storage call may raise for a store that is down or refuses us.

    s3fs translates most botocore errors into OSError, but lets connection errors
    (``EndpointConnectionError``, a ``BotoCoreError``) out of ``exists``/``info``.
    botocore is optional: without it only folder tiers exist, which raise OSError.
    """
    try:
        from botocore.exceptions import BotoCoreError
    except ImportError:  # no S3 support installed: only OSError can happen
        return (OSError, ValueError)
    return (OSError, ValueError, BotoCoreError)


_IO_ERRORS = _io_errors()

_MAX_RECORD = 1 << 20  # pins, leases, markers, `latest`: small by construction


@dataclass(frozen=True, slots=True)
class StoredCheckpoint:
    """A committed checkpoint on a tier, its manifest authenticated and its index checked."""

    tier: str
    uri: str
    run_id: str
    step: int
    manifest: Manifest
    manifest_bytes: bytes
    index: TierIndex
    has_tier_index: bool
    """False on a tier that stores the trainer's files as they are (hot: no tier.json)."""

    local: bool = False
    """The tier is a local/shared file system, where a member may be a symlink."""

    def object_url(self, name: str) -> str:
        """URL of the stored object of manifest file ``name``.

        On a folder tier the name is resolved on disk too: a symlink leading out of the
        checkpoint is refused before anything reads it (a matching digest would not
        make an outside file part of this checkpoint).
        """
        stored = layout.check_member_name(self.index.files[name].stored_name)
        if self.local:
            return resolve_member(self.uri, stored)
        return layout.join(self.uri, stored)


class Tier:
    """A tier from its config. ``fs`` may be passed in (tests, a pre-built file system)."""

    def __init__(self, config: TierConfig, *, fs: fsspec.AbstractFileSystem | None = None) -> None:
        self.config = config
        self.name = config.name
        if config.is_local:
            path = config.url[len("file://") :] if config.url.startswith("file://") else config.url
            self.url = os.path.abspath(os.path.expanduser(path))
            self.fs = fs or fsspec.filesystem("file")
        else:
            self.url = config.url.rstrip("/")
            self.fs = fs or _object_fs(config)
        self.s3 = S3Objects(config) if config.is_s3 else None
        self.rule: CommitRule = RENAME if config.is_local else MarkerCommit(self.fs)
        """How a checkpoint is committed here, and what "committed" means (``trainer.atomicity``)."""

    def __repr__(self) -> str:
        return f"Tier({self.name!r}, {self.url!r}, codec={self.config.codec!r})"

    @property
    def is_local(self) -> bool:
        """A local or shared file system: paths are OS paths, files can be fsynced, symlinks exist."""
        return self.config.is_local

    @property
    def codec(self) -> str:
        return self.config.codec

    # ---- names ------------------------------------------------------------------

    def url_for(self, run_id: str, step: int | None = None, name: str | None = None) -> str:
        """URL of a run, a step dir, or a file in it; run id and name are validated."""
        url = layout.run_dir(self.url, run_id)
        if step is not None:
            url = layout.join(url, layout.step_name(step))
        if name is not None:
            url = layout.join(url, layout.check_member_name(name))
        return url

    def tmp_url(self, run_id: str, step: int) -> str:
        """Where a checkpoint is staged before its commit (``step_N.tmp`` or ``step_N`` itself)."""
        return self.rule.staging_url(layout.run_dir(self.url, run_id), step)

    def check_inside(self, url: str, run_id: str) -> str:
        """Refuse a URL that is not strictly inside this tier's run (defence for deletes)."""
        run = layout.run_dir(self.url, run_id) + "/"
        if not url.startswith(run) or ".." in url[len(run) :].split("/"):
            raise UnsafePathError(
                f"{url} is outside run {run_id} of tier {self.name} ({run}); refusing to touch it", path=url
            )
        return url

    # ---- listing ----------------------------------------------------------------

    def list_runs(self) -> list[str]:
        """Run ids stored on this tier (entries that are not valid run ids are ignored)."""
        out = []
        for p in self._ls(self.url):
            name = p.rstrip("/").rsplit("/", 1)[-1]
            try:
                out.append(layout.check_run_id(name))
            except ValueError:
                continue
        return sorted(out)

    def committed_steps(self, run_id: str) -> list[int]:
        """Committed steps, newest first, by this tier's commit rule: a ``step_N`` dir (file
        systems) or a step with its marker (object stores: objects alone are never listed)."""
        run = layout.run_dir(self.url, run_id)
        try:
            return self.rule.committed_steps(run)
        except _IO_ERRORS as e:
            raise _wrap(run, "list", e) from None

    def is_committed(self, run_id: str, step: int) -> bool:
        run = layout.run_dir(self.url, run_id)
        try:
            return self.rule.is_committed(run, step)
        except _IO_ERRORS as e:
            raise _wrap(layout.join(run, layout.step_name(step)), "exists", e) from None

    def latest_step(self, run_id: str) -> int | None:
        """The step ``latest`` names on this tier (the trainer writes it on hot), or None: also for a ``latest``
        that is not a small regular file (a FIFO, a device, garbage), which is never trusted anyway."""
        url = layout.join(layout.run_dir(self.url, run_id), layout.LATEST)
        try:
            data = self.read_bytes(url, limit=64, missing_ok=True)
            return layout.parse_step(data.decode().strip()) if data else None
        except (UnicodeDecodeError, IntegrityError) as e:
            log.warning("ignoring %s: %s", url, e)
            return None

    def is_quarantined(self, run_id: str, step: int) -> bool:
        return self.exists(layout.quarantine_record(layout.run_dir(self.url, run_id), step))

    def has_stage_record(self, run_id: str, step: int, stage: str) -> bool:
        return self.exists(layout.stage_record(layout.run_dir(self.url, run_id), step, stage))

    # ---- reading a checkpoint ------------------------------------------------------

    def open_checkpoint(self, run_id: str, step: int) -> StoredCheckpoint:
        """Read and cross-check what makes a checkpoint trusted on this tier.

        Object stores: marker -> tier.json (digest in the marker) -> manifest.json (digest
        in the index). Rename tiers: manifest.json, plus tier.json when the tier keeps
        one. The manifest is authenticated (``Manifest.from_json``) and must name this
        run and step; every name is validated. Raises CheckpointNotFoundError when the
        checkpoint is not committed, IntegrityError when it is damaged.
        """
        uri = self.url_for(run_id, step)
        index_bytes = None
        if self.rule.kind == "marker":
            marker_url = layout.join(uri, layout.COMMIT_MARKER)
            marker = self.read_bytes(marker_url, limit=_MAX_RECORD, missing_ok=True)
            if marker is None:
                raise CheckpointNotFoundError(
                    f"{uri}: no commit marker ({layout.COMMIT_MARKER}); the upload never completed. "
                    f"Run archive for {run_id} step {step} again"
                )
            want = parse_marker(marker, source=marker_url)
            index_bytes = self._read_required(layout.join(uri, layout.TIER_MANIFEST), MAX_MANIFEST_BYTES)
            if hash_bytes(index_bytes) != want:
                raise ManifestError(
                    f"{uri}/{layout.TIER_MANIFEST}: digest differs from the one in "
                    f"{layout.COMMIT_MARKER}; the index was replaced or damaged, "
                    "restore from another tier",
                    path=f"{uri}/{layout.TIER_MANIFEST}",
                )
        manifest_url = layout.join(uri, layout.MANIFEST)
        manifest_bytes = self.read_bytes(manifest_url, limit=MAX_MANIFEST_BYTES + 1, missing_ok=True)
        if manifest_bytes is None:
            if self.rule.kind == "rename" and not self.is_committed(run_id, step):
                raise CheckpointNotFoundError(f"{uri}: no such checkpoint (not committed on tier {self.name})")
            raise ManifestError(
                f"{manifest_url}: missing although the checkpoint is marked committed; restore from another tier",
                path=manifest_url,
            )
        manifest = Manifest.from_json(manifest_bytes, source=manifest_url)
        if (manifest.run_id, manifest.step) != (run_id, step):
            raise ManifestError(
                f"{manifest_url}: manifest is for {manifest.run_id} step "
                f"{manifest.step}, not {run_id} step {step}; it was moved or "
                "edited, do not use it",
                path=manifest_url,
            )
        if index_bytes is None and self.rule.kind == "rename":
            index_bytes = self.read_bytes(
                layout.join(uri, layout.TIER_MANIFEST), limit=MAX_MANIFEST_BYTES, missing_ok=True
            )
        if index_bytes is None:
            index, has_index = identity_index(manifest, manifest_bytes), False
        else:
            source = layout.join(uri, layout.TIER_MANIFEST)
            index, has_index = TierIndex.from_json(index_bytes, source=source), True
            index.check_against(manifest, manifest_bytes, source)
        return StoredCheckpoint(
            self.name, uri, run_id, step, manifest, manifest_bytes, index, has_index, local=self.is_local
        )

    def read_manifest(self, run_id: str, step: int) -> Manifest:
        """The authenticated trainer manifest of a committed checkpoint on this tier."""
        return self.open_checkpoint(run_id, step).manifest

    def read_index(self, run_id: str, step: int) -> TierIndex:
        """The tier index (derived from the manifest on a tier without tier.json)."""
        return self.open_checkpoint(run_id, step).index

    # ---- small records ----------------------------------------------------------

    def exists(self, url: str) -> bool:
        try:
            return bool(self.fs.exists(url))
        except _IO_ERRORS as e:
            raise _wrap(url, "exists", e) from None

    def read_bytes(self, url: str, *, limit: int, missing_ok: bool = False) -> bytes | None:
        """A small file's bytes (at most ``limit``; a bigger file is refused, not truncated). On a folder tier
        only a regular file is opened (``trainer.safeopen``): a FIFO or device there is refused by name."""
        try:
            if self.is_local:
                data = read_small(url, limit + 1, what=f"tier {self.name}")
            else:
                with self.fs.open(url, "rb") as f:
                    data = f.read(limit + 1)
        except FileNotFoundError:
            if missing_ok:
                return None
            raise
        except IntegrityError:
            raise  # not a regular file, or far too large: what the tier holds is wrong, not the tier
        except _IO_ERRORS as e:
            raise _wrap(url, "read", e) from None
        if len(data) > limit:
            raise ManifestError(f"{url}: larger than {limit} bytes; not a ckptflow record", path=url)
        return data

    def _read_required(self, url: str, limit: int) -> bytes:
        data = self.read_bytes(url, limit=limit, missing_ok=True)
        if data is None:
            raise ManifestError(
                f"{url}: missing although the checkpoint is marked committed; restore from another tier", path=url
            )
        return data

    def write_bytes(self, url: str, data: bytes) -> None:
        """Write a small record: atomically and durably on local tiers, one PUT on stores."""
        try:
            if self.is_local:
                os.makedirs(os.path.dirname(url), exist_ok=True)
                replace_atomic(url, data)
            else:
                self.fs.pipe_file(url, data)
        except _IO_ERRORS as e:
            raise _wrap(url, "write", e) from None

    def remove(self, url: str, *, missing_ok: bool = True) -> None:
        try:
            self.fs.rm_file(url)
        except FileNotFoundError:
            if not missing_ok:
                raise
        except _IO_ERRORS as e:
            raise _wrap(url, "delete", e) from None

    def ls_names(self, url: str) -> list[str]:
        """Base names of the entries in a directory/prefix ([] if it does not exist)."""
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self._ls(url))

    def _ls(self, url: str) -> list[str]:
        try:
            return list(self.fs.ls(url, detail=False))
        except FileNotFoundError:
            return []
        except _IO_ERRORS as e:
            raise _wrap(url, "list", e) from None

    # ---- pins -------------------------------------------------------------------

    def pin(self, run_id: str, step: int, reason: str = "") -> str:
        """Pin a checkpoint: prune never deletes it (whatever the policy) until unpinned."""
        url = layout.pin_path(layout.run_dir(self.url, run_id), step)
        self.write_bytes(url, (json.dumps({"reason": reason, "pinned_at": time.time()}) + "\n").encode())
        return url

    def unpin(self, run_id: str, step: int) -> None:
        self.remove(layout.pin_path(layout.run_dir(self.url, run_id), step))

    def pinned_steps(self, run_id: str) -> set[int]:
        pins = layout.join(layout.run_dir(self.url, run_id), layout.PINS_DIR)
        return {s for n in self.ls_names(pins) if (s := layout.parse_step(n)) is not None}

    # ---- deleting -----------------------------------------------------------------

    def delete_checkpoint(self, run_id: str, step: int) -> None:
        """Delete one checkpoint so that no crash can leave a half of it looking committed.

        Rename tiers: rename ``step_N`` to ``step_N.deleting`` (no longer committed), then
        remove the tree. Object stores: delete ``_COMMITTED`` first (no longer trusted),
        then every object under the step prefix. Callers (prune) decide *whether*; this
        only refuses paths outside the tier's run.
        """
        uri = self.check_inside(self.url_for(run_id, step), run_id)
        try:
            left = self.rule.withdraw(layout.run_dir(self.url, run_id), step)  # no longer committed
        except _IO_ERRORS as e:
            raise _wrap(uri, "delete", e) from None
        if left is None:
            return
        if self.is_local:
            remove_tree(left)  # tolerates a concurrent delete removing it first
            return
        try:
            keys = [k for k in self.fs.find(uri) if k]
        except FileNotFoundError:
            keys = []
        prefix = self.fs._strip_protocol(uri).rstrip("/") + "/"
        for k in keys:  # find() lists under the prefix; check anyway before deleting
            if not self.fs._strip_protocol(k).startswith(prefix):
                raise UnsafePathError(f"{k}: listed under {uri} but outside it; refusing", path=k)
        if keys:
            try:
                self.fs.rm(keys)
            except FileNotFoundError:
                pass  # a concurrent delete removed them first: gone is what was asked
            except OSError as e:
                raise _wrap(uri, "delete", e) from None

    def set_aside(self, run_id: str, step: int, reasons: list[str], *, found_by: str) -> str | None:
        """Damaged means no longer committed (``trainer.format.atomicity``): take this tier's copy of the step
        out of its committed names, kept for inspection under ``_damaged/``; returns where (None: not
        committed here)."""
        run = layout.run_dir(self.url, run_id)
        try:
            where = self.rule.set_aside(run, step, {"found_by": found_by, "reasons": reasons, "tier": self.name})
        except _IO_ERRORS as e:
            raise _wrap(layout.join(run, layout.step_name(step)), "set aside", e) from None
        if where is not None:
            log.warning(
                "%s is damaged (%s); set aside as %s", self.url_for(run_id, step), "; ".join(reasons)[:300], where
            )
        return where

    def open_or_set_aside(self, run_id: str, step: int, *, found_by: str | None) -> StoredCheckpoint | None:
        """The committed copy of the step here (:meth:`open_checkpoint`), or None when it is damaged, so the
        caller writes the step again; set aside now, unless ``found_by`` is None (a caller that may not move
        it yet). A manifest this process cannot trust (``UntrustedError``: another key, a newer format) is not
        damage and raises."""
        try:
            return self.open_checkpoint(run_id, step)
        except UntrustedError:
            raise
        except IntegrityError as e:
            if found_by is not None:
                self.set_aside(run_id, step, [str(e)], found_by=found_by)
            return None

    def set_aside_names(self, run_id: str) -> list[str]:
        """What this tier's ``_damaged/`` holds for the run (names; [] if nothing was set aside)."""
        return layout.set_aside_entries(
            self.ls_names(layout.join(layout.run_dir(self.url, run_id), layout.DAMAGED_DIR))
        )

    def clean_stale(self, run_id: str, *, older_than_s: float = 3600.0) -> list[str]:
        """Remove ``step_N.tmp`` and ``step_N.deleting`` dirs older than ``older_than_s``
        (rename tiers; a crashed promote or prune). Young ones may still be in use."""
        if self.rule.kind != "rename":
            return []
        run = layout.run_dir(self.url, run_id)
        removed = []
        now = time.time()
        for name in self.ls_names(run):
            stale = RenameCommit.is_leftover(name)
            path = os.path.join(run, name)
            try:
                if stale and now - os.stat(path).st_mtime > older_than_s:
                    remove_tree(path)
                    removed.append(path)
            except OSError as e:  # never fatal: it is not trusted; the next pass retries
                log.warning("could not remove stale %s: %s", path, e)
        return removed

    def commit(self, run_id: str, step: int, *, marker: bytes = b"") -> str:
        """The commit point of this tier's rule: rename the staging dir, or write the marker.
        Everything staged must be durable (file systems) or uploaded (object stores) already."""
        run = layout.run_dir(self.url, run_id)
        try:
            return self.rule.commit(run, step, marker=marker)
        except _IO_ERRORS as e:
            raise _wrap(layout.join(run, layout.step_name(step)), "commit", e) from None


def _object_fs(config: TierConfig) -> fsspec.AbstractFileSystem:
    if config.is_s3:
        import s3fs

        # No listing cache: another process (an archive, a prune) changes the bucket under us,
        # and a stale listing would report a deleted checkpoint as committed.
        kw: dict[str, Any] = {"use_listings_cache": False}
        if config.endpoint_url:
            kw["endpoint_url"] = config.endpoint_url
        if config.region:
            kw["client_kwargs"] = {"region_name": config.region}
        return s3fs.S3FileSystem(**kw)
    fs, _ = fsspec.core.url_to_fs(config.url)
    return fs


def _wrap(url: str, what: str, e: BaseException) -> StorageError:
    return StorageError(
        f"{url}: {what} failed ({type(e).__name__}: {e}); check that the tier is reachable and writable, then re-run"
    )
