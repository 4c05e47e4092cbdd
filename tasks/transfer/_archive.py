"""Archive: a checkpoint from a file-system tier (hot or warm) to the cold S3 tier.

Object stores cannot rename, so the commit is an order of writes::

    1  every data object, in parallel (multipart above the part size), each carrying its
       raw and stored xxh3 as object metadata, storage class from the tier policy
    2  HEAD of every object: present, right size, right digests    <- nothing missing
    3  tier.json   (stored names, sizes, digests; digest of manifest.json)
    4  manifest.json (the trainer's bytes, verbatim)
    5  _COMMITTED  (digest of tier.json)                           <- commit point

Readers trust a step only with its marker, so a crash anywhere before 5 leaves objects
nobody reads. A re-run HEADs each object first and skips those whose metadata already
names the right raw digest and codec: an interrupted archive resumes, and a finished
one uploads nothing. When the source already stores the cold tier's codec, its stored
bytes are uploaded as they are (no recompression); otherwise each file is encoded into
a local spool file first, because S3 metadata must be known before the upload starts
and the stored digest is known only at the end of the encoding.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptflow.tasks.storage.index import StoredFile, TierIndex, marker_json
from ckptflow.tasks.storage.s3 import META_CODEC, META_LEVEL, META_RAW, META_RAW_SIZE, META_STORED, ObjectInfo
from ckptflow.tasks.storage.tier import StoredCheckpoint, Tier
from ckptflow.tasks.transfer import _streams as streams
from ckptflow.tasks.transfer._pool import run_all
from ckptflow.tasks.transfer.results import FaultHook, TransferResult, no_fault
from ckptflow.trainer.errors import ConfigError, IntegrityError, ManifestError, StorageError
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.checksum import hash_bytes, hash_stream
from ckptflow.trainer.safeopen import open_sized

if TYPE_CHECKING:
    from ckptflow.tasks.codec import DtypeMap

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Plan:
    name: str
    url: str
    stored_name: str
    as_is: bool
    """The source stores the cold codec already: upload its stored bytes unchanged."""


def archive(
    src: Tier,
    cold: Tier,
    run_id: str,
    step: int,
    *,
    threads: int | None = None,
    spool_dir: str | None = None,
    fault: FaultHook | None = None,
) -> TransferResult:
    """Upload ``run_id``/``step`` from ``src`` to the S3 tier ``cold`` and commit it with a marker.

    ``threads`` bounds files prepared at once (default: up to 4); parts of all files share
    one pool of ``cold.config.max_concurrency`` connections. Encoded files are spooled
    under ``spool_dir`` (default: the system temp dir), one file per worker at a time.
    """
    t0 = time.perf_counter()
    fault = fault or no_fault
    if cold.s3 is None:
        raise ConfigError(
            f"tier {cold.name} ({cold.url}) is not an s3:// tier; archive needs S3 "
            "(storage class, multipart, object metadata)"
        )
    s3 = cold.s3  # checked above; the lambdas below cannot see that narrowing
    ckpt = src.open_checkpoint(run_id, step)
    uri = cold.url_for(run_id, step)
    res = TransferResult(uri=uri, run_id=run_id, step=step, codec=cold.codec, bytes_raw=ckpt.manifest.total_bytes)
    plans = _plan(ckpt, cold, uri)
    if cold.is_committed(run_id, step):
        done = _check_committed(cold, ckpt, uri)
        if done is not None:
            done.seconds = time.perf_counter() - t0
            return done

    # 1. data objects: HEAD first, upload only what is missing or different
    te = time.perf_counter()
    workers = max(1, min(threads or 4, len(plans)))
    nhead = min(16, cold.config.max_concurrency)
    heads = dict(zip([p.name for p in plans], run_all(lambda p: s3.head(p.url), plans, nhead), strict=True))
    files: dict[str, StoredFile] = {}
    todo = []
    for p in plans:
        have = _matching(heads[p.name], ckpt, p, cold.codec)
        if have is not None:
            files[p.name] = have
            res.skipped_files += 1
        else:
            todo.append(p)
    maps = streams.dtype_maps(src, ckpt, cold.codec) if any(not p.as_is for p in todo) else {}
    spool = tempfile.mkdtemp(prefix="ckptflow-archive-", dir=spool_dir)
    manager = cold.s3.transfer_manager()
    try:
        uploaded = run_all(
            lambda p: _upload(src, cold, ckpt, p, manager, spool, maps.get(p.name), fault), todo, workers
        )
    finally:
        manager.shutdown()
        shutil.rmtree(spool, ignore_errors=True)
    for p, f in zip(todo, uploaded, strict=True):
        files[p.name] = f
        res.files += 1
        res.bytes_moved += f.stored_size
    res.encode_seconds = time.perf_counter() - te

    # 2. every object present with the right size and digests, before anything vouches for it
    tv = time.perf_counter()
    after = run_all(lambda p: s3.head(p.url), plans, nhead)
    for p, info in zip(plans, after, strict=True):
        if _matching(info, ckpt, p, cold.codec) != files[p.name]:
            raise StorageError(
                f"{p.url}: missing or different right after the upload (deleted "
                "concurrently?); not committing — re-run archive"
            )
    res.verify_seconds = time.perf_counter() - tv

    # 3-5. index, manifest, marker last
    fault("archive:before_index")
    level = ckpt.index.level if ckpt.index.codec == cold.codec else cold.config.level
    index = TierIndex(
        run_id=run_id,
        step=step,
        codec=cold.codec,
        level=level,
        manifest_checksum=hash_bytes(ckpt.manifest_bytes),
        files=files,
    )
    index_bytes = index.to_json()
    cold.write_bytes(layout.join(uri, layout.TIER_MANIFEST), index_bytes)
    cold.write_bytes(layout.join(uri, layout.MANIFEST), ckpt.manifest_bytes)
    fault("archive:before_marker")
    cold.commit(run_id, step, marker=marker_json(index_bytes))  # <- the commit point
    fault("archive:committed")
    res.bytes_stored = index.total_stored_bytes
    res.seconds = time.perf_counter() - t0
    log.info(
        "archived %s -> %s (%d uploaded, %d already there, %.1f MB stored, %.2f s)",
        ckpt.uri,
        uri,
        res.files,
        res.skipped_files,
        res.bytes_stored / 1e6,
        res.seconds,
    )
    return res


def _plan(ckpt: StoredCheckpoint, cold: Tier, uri: str) -> list[_Plan]:
    out = []
    for name in sorted(ckpt.manifest.files):
        as_is = ckpt.index.codec == cold.codec
        stored = ckpt.index.files[name].stored_name if as_is else streams.stored_name(name, cold.codec)
        out.append(_Plan(name, layout.join(uri, layout.check_member_name(stored)), stored, as_is))
    return out


def _matching(info: ObjectInfo | None, ckpt: StoredCheckpoint, p: _Plan, codec: str) -> StoredFile | None:
    """The object's entry if its metadata says it holds exactly this file in this codec."""
    if info is None:
        return None
    entry = ckpt.manifest.files[p.name]
    m = info.metadata
    if (
        m.get(META_RAW) != entry.checksum
        or m.get(META_RAW_SIZE) != str(entry.size)
        or m.get(META_CODEC) != codec
        or not m.get(META_STORED)
    ):
        return None
    if p.as_is:  # stored bytes are the source's: size and digest must be those
        src = ckpt.index.files[p.name]
        if (info.size, m[META_STORED]) != (src.stored_size, src.stored_checksum):
            return None
    return StoredFile(entry.size, entry.checksum, p.stored_name, info.size, m[META_STORED])


def _upload(
    src: Tier,
    cold: Tier,
    ckpt: StoredCheckpoint,
    p: _Plan,
    manager: object,
    spool: str,
    dtype_map: DtypeMap | None,
    fault: FaultHook,
) -> StoredFile:
    entry = ckpt.index.files[p.name]
    cfg = cold.config
    if p.as_is and src.is_local:
        # Upload the source file itself; digest it first so a damaged source is never
        # archived under a digest it does not have.
        path = ckpt.object_url(p.name)
        with open_sized(path, entry.stored_size, what=f"tier {src.name}") as f:  # a swollen file: not read
            digest, n = hash_stream(f)
        if (n, digest) != (entry.stored_size, entry.stored_checksum):
            raise IntegrityError(
                f"{path}: {n} B xxh3 {digest}, but the tier index says "
                f"{entry.stored_size} B {entry.stored_checksum}; not archiving a "
                "damaged source — archive from another tier",
                path=path,
            )
        out = StoredFile(entry.size, entry.checksum, p.stored_name, n, digest)
        _put(cold, ckpt, manager, path, p, out, level=ckpt.index.level)
    else:
        fd, path = tempfile.mkstemp(dir=spool, suffix=".spool")
        try:
            with os.fdopen(fd, "wb") as f:
                st = streams.encode_file(
                    src,
                    ckpt,
                    p.name,
                    f,
                    codec=cold.codec,
                    level=cfg.level,
                    threads=cfg.codec_threads,
                    dtype_map=dtype_map,
                )
            out = StoredFile(st.raw_bytes, st.raw_checksum, p.stored_name, st.stored_bytes, st.stored_checksum)
            level = ckpt.index.level if p.as_is else cfg.level
            _put(cold, ckpt, manager, path, p, out, level=level)
        finally:
            os.unlink(path)
    fault(f"archive:uploaded:{p.name}")
    return out


def _put(
    cold: Tier, ckpt: StoredCheckpoint, manager: object, path: str, p: _Plan, f: StoredFile, *, level: int | None
) -> None:
    meta = {
        META_RAW: f.checksum,
        META_RAW_SIZE: str(f.size),
        META_STORED: f.stored_checksum,
        META_CODEC: cold.codec,
        META_LEVEL: "" if level is None else str(level),
    }
    tags = {"ckptflow-run": ckpt.run_id, "ckptflow-step": str(ckpt.step)}
    assert cold.s3 is not None  # archive() checked it before uploading anything
    cold.s3.upload(manager, path, p.url, cold.s3.upload_args(metadata=meta, tags=tags))


def _check_committed(cold: Tier, ckpt: StoredCheckpoint, uri: str) -> TransferResult | None:
    """Already archived? Returns the no-op result, or None to (re)upload what is missing."""
    # A marker that vouches for a damaged index: set aside (the marker withdrawn, a note kept), then archived
    # again (objects that are still right are skipped by their metadata).
    there = cold.open_or_set_aside(ckpt.run_id, ckpt.step, found_by="archive")
    if there is None:
        return None
    if hash_bytes(there.manifest_bytes) != hash_bytes(ckpt.manifest_bytes):
        raise ManifestError(
            f"{there.uri}: already archived with a different manifest than "
            f"{ckpt.uri}; an archived checkpoint is never replaced — delete it on "
            "purpose (prune) if the source is the one to keep",
            path=there.uri,
        )
    assert cold.s3 is not None  # archive() checked it before calling this
    missing = [
        n
        for n, f in there.index.files.items()
        if (info := cold.s3.head(there.object_url(n))) is None or info.size != f.stored_size
    ]
    if missing:
        log.warning(
            "%s is committed but %s are missing or truncated; withdrawing the marker and uploading them again",
            there.uri,
            missing,
        )
        cold.rule.withdraw(layout.run_dir(cold.url, ckpt.run_id), ckpt.step)
        return None
    return TransferResult(
        uri=there.uri,
        run_id=ckpt.run_id,
        step=ckpt.step,
        codec=there.index.codec,
        skipped_files=len(there.index.files),
        bytes_raw=there.index.total_raw_bytes,
        bytes_stored=there.index.total_stored_bytes,
        already_committed=True,
    )
