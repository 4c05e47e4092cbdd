"""Compress and promote: a checkpoint onto a file-system tier (hot -> warm), commit by rename.

Call order, and what a crash at each point leaves behind::

    compress  1  lock step_N.tmp/ (flock; a second promote of the step fails fast)
              2  each file -> tmp/<name><suffix> through the tier's codec, fsynced
                 (raw digest checked against the manifest on the way)
              3  tmp/tier.json written and fsynced             <- the compress stage's work
    promote   4  re-read every stored file, digest == tier.json (or the manifest, codec none;
                 a raw copy from a local tier is read back chunk by chunk *during* 2)
              5  tmp/manifest.json: the trainer's bytes, verbatim
              6  rename step_N.tmp -> step_N, fsync the run dir <- commit point

A crash before 3 leaves a tmp dir that the next run clears and redoes; after 3 the
next promote finds a complete staging (its tier.json names this exact manifest) and
goes straight to 4. Nothing before 6 is ever trusted. Promoting a step that is
already committed checks that it is the same checkpoint and returns at once.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ckptflow.tasks.storage.index import StoredFile, TierIndex
from ckptflow.tasks.storage.tier import StoredCheckpoint, Tier
from ckptflow.tasks.transfer import _streams as streams
from ckptflow.tasks.transfer._pool import run_all
from ckptflow.tasks.transfer.results import FaultHook, TransferResult, no_fault
from ckptflow.trainer.errors import ConfigError, IntegrityError, ManifestError, StorageError
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.checksum import hash_bytes
from ckptflow.trainer.format.manifest import MAX_MANIFEST_BYTES
from ckptflow.trainer.fsutil import fsync_dir, remove_tree, write_durable
from ckptflow.trainer.safeopen import read_small

log = logging.getLogger(__name__)


def compress(
    src: Tier, dst: Tier, run_id: str, step: int, *, threads: int | None = None, fault: FaultHook | None = None
) -> TransferResult:
    """The compress stage: write ``run_id``/``step`` from ``src`` into ``dst``'s staging dir in
    ``dst``'s stored form (its codec and level), durably, without committing it.

    Idempotent: a complete staging for the same manifest is kept as it is. ``promote``
    does this itself when it finds no staging, so calling it first is optional.
    """
    t0 = time.perf_counter()
    _require_rename_tier(dst)
    ckpt = src.open_checkpoint(run_id, step)
    if dst.is_committed(run_id, step) and (done := _already_committed(dst, ckpt, t0, locked=False)) is not None:
        return done
    with _locked_tmp(dst, run_id, step) as tmp:
        if dst.is_committed(run_id, step) and (done := _already_committed(dst, ckpt, t0, locked=True)) is not None:
            remove_tree(tmp)  # a promote committed meanwhile
            return done
        res, _ = _stage(src, dst, ckpt, tmp, threads, fault or no_fault, durable=True)
    res.seconds = time.perf_counter() - t0
    return res


def promote(
    src: Tier,
    dst: Tier,
    run_id: str,
    step: int,
    *,
    threads: int | None = None,
    deep_verify: bool = False,
    fault: FaultHook | None = None,
) -> TransferResult:
    """Copy ``run_id``/``step`` from ``src`` to the file-system tier ``dst`` and commit it.

    Every stored file is re-read after the copy and its digest compared with the index
    (``deep_verify`` also decodes it and compares the raw digest with the manifest).
    Returns at once, with ``already_committed``, when ``dst`` holds the same checkpoint.
    """
    t0 = time.perf_counter()
    fault = fault or no_fault
    _require_rename_tier(dst)
    ckpt = src.open_checkpoint(run_id, step)
    if dst.is_committed(run_id, step) and (done := _already_committed(dst, ckpt, t0, locked=False)) is not None:
        return done
    final = dst.url_for(run_id, step)
    with _locked_tmp(dst, run_id, step) as tmp:
        if dst.is_committed(run_id, step) and (done := _already_committed(dst, ckpt, t0, locked=True)) is not None:
            remove_tree(tmp)  # another promote committed meanwhile: the empty tmp our lock re-created goes
            return done
        # durable=False: the commit below fsyncs tmp's entries once, after manifest.json
        res, checked = _stage(src, dst, ckpt, tmp, threads, fault, durable=False)
        tv = time.perf_counter()
        try:
            index = _verify_tmp(tmp, ckpt, dst, threads, deep_verify, checked)
        except IntegrityError as e:
            if not res.skipped_files:
                raise  # written by this very call: report it, do not loop
            # A staging left by an earlier call (a crash can lose a file it listed, a disk
            # can rot it): never commit it, never get stuck on it — stage again.
            log.warning("staged copy in %s does not verify (%s); staging again", tmp, e)
            _clear(tmp)
            res, checked = _stage(src, dst, ckpt, tmp, threads, fault, durable=False)
            index = _verify_tmp(tmp, ckpt, dst, threads, deep_verify, checked)
        res.verify_seconds = time.perf_counter() - tv
        fault("promote:verified")
        write_durable(os.path.join(tmp, layout.MANIFEST), ckpt.manifest_bytes)
        fault("promote:before_commit")
        dst.commit(run_id, step)
    fault("promote:committed")
    res.seconds = time.perf_counter() - t0
    log.info(
        "promoted %s -> %s (%d files, %.1f MB raw, %.1f MB stored, %.2f s)",
        ckpt.uri,
        final,
        len(index.files),
        res.bytes_raw / 1e6,
        res.bytes_stored / 1e6,
        res.seconds,
    )
    return res


# ---- the steps ----------------------------------------------------------------------


def _stage(
    src: Tier, dst: Tier, ckpt: StoredCheckpoint, tmp: str, threads: int | None, fault: FaultHook, *, durable: bool
) -> tuple[TransferResult, set[str]]:
    """Steps 2-3 unless a complete staging for this manifest is already in ``tmp``.
    Also returns the files whose copy was already read back and checked (step 4 done)."""
    t0 = time.perf_counter()
    res = TransferResult(
        uri=dst.url_for(ckpt.run_id, ckpt.step),
        run_id=ckpt.run_id,
        step=ckpt.step,
        codec=dst.codec,
        bytes_raw=ckpt.manifest.total_bytes,
    )
    staged = _complete_staging(tmp, ckpt, dst.codec)
    if staged is not None:
        res.skipped_files = len(staged.files)
        res.bytes_stored = staged.total_stored_bytes
        return res, set()
    _clear(tmp)  # a crashed attempt's leftovers: never trusted, redo
    cfg = dst.config
    maps = streams.dtype_maps(src, ckpt, dst.codec)
    names = sorted(ckpt.manifest.files)
    checked: set[str] = set()

    def one(name: str) -> tuple[str, StoredFile]:
        entry = ckpt.index.files[name]
        stored = streams.stored_name(name, dst.codec)
        path = os.path.join(tmp, *stored.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if dst.codec == "none" and ckpt.index.codec == "none" and src.is_local:
            # Fast path: the kernel copies, and the copy is read back and digested
            # against the manifest while it is being made (the after-copy check).
            streams.copy_verified(ckpt.object_url(name), path, entry.size, entry.checksum)
            checked.add(name)
            out = StoredFile(entry.size, entry.checksum, stored, entry.size, entry.checksum)
        else:
            with open(path, "wb") as f:
                st = streams.encode_file(
                    src,
                    ckpt,
                    name,
                    f,
                    codec=dst.codec,
                    level=cfg.level,
                    threads=cfg.codec_threads,
                    dtype_map=maps.get(name),
                )
                f.flush()
                os.fsync(f.fileno())
            out = StoredFile(st.raw_bytes, st.raw_checksum, stored, st.stored_bytes, st.stored_checksum)
        fault(f"compress:file:{name}")
        return name, out

    files = dict(run_all(one, names, _workers(threads, len(names))))
    level = ckpt.index.level if ckpt.index.codec == dst.codec else cfg.level
    index = TierIndex(
        run_id=ckpt.run_id,
        step=ckpt.step,
        codec=dst.codec,
        level=level,
        manifest_checksum=hash_bytes(ckpt.manifest_bytes),
        files=files,
    )
    fsync_dir(tmp)  # every stored file's entry is durable before the index that lists them
    fault("compress:before_index")
    write_durable(os.path.join(tmp, layout.TIER_MANIFEST), index.to_json())
    if durable:
        fsync_dir(tmp)
    res.files = len(files)
    res.bytes_stored = res.bytes_moved = index.total_stored_bytes
    res.encode_seconds = time.perf_counter() - t0
    return res, checked


def _clear(tmp: str) -> None:
    for name in os.listdir(tmp):
        p = os.path.join(tmp, name)
        remove_tree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)


def _complete_staging(tmp: str, ckpt: StoredCheckpoint, codec: str) -> TierIndex | None:
    path = os.path.join(tmp, layout.TIER_MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        index = TierIndex.from_json(_read(path), source=path)
        index.check_against(ckpt.manifest, ckpt.manifest_bytes, path)
    except IntegrityError as e:  # torn by a crash, or staged for another manifest: redo
        log.info("discarding incomplete staging %s (%s)", tmp, e)
        return None
    return index if index.codec == codec else None


def _verify_tmp(
    tmp: str, ckpt: StoredCheckpoint, dst: Tier, threads: int | None, deep: bool, checked: set[str]
) -> TierIndex:
    """Step 4; returns the staged index (checked against the manifest)."""
    path = os.path.join(tmp, layout.TIER_MANIFEST)
    index = TierIndex.from_json(_read(path), source=path)
    index.check_against(ckpt.manifest, ckpt.manifest_bytes, path)

    def one(item: tuple[str, StoredFile]) -> None:
        name, f = item
        path = os.path.join(tmp, *f.stored_name.split("/"))
        if name not in checked:  # checked = read back while copying, in this very call
            streams.verify_local(path, f.stored_size, f.stored_checksum, f"stored form of {name}")
        if deep and index.codec != "none":
            streams.decode_verify(path, index.codec, f.size, f.checksum, dst.config.codec_threads)

    run_all(one, sorted(index.files.items()), _workers(threads, len(index.files)))
    return index


def _already_committed(dst: Tier, ckpt: StoredCheckpoint, t0: float, *, locked: bool) -> TransferResult | None:
    """The no-op result when ``dst`` holds this very checkpoint; None when its copy is damaged (the caller
    promotes it again). ``locked``: the caller holds the step's staging lock, so no other promote can commit
    the step meanwhile, and the damaged copy is set aside now (never without the lock: it could be another
    promote's fresh commit)."""
    there = dst.open_or_set_aside(ckpt.run_id, ckpt.step, found_by="promote" if locked else None)
    if there is None:
        return None
    if hash_bytes(there.manifest_bytes) != hash_bytes(ckpt.manifest_bytes):
        raise ManifestError(
            f"{there.uri}: already committed with a different manifest than {ckpt.uri}; a "
            "committed checkpoint is never replaced — delete it on purpose (prune) if the "
            "source is the one to keep",
            path=there.uri,
        )
    return TransferResult(
        uri=there.uri,
        run_id=ckpt.run_id,
        step=ckpt.step,
        codec=there.index.codec,
        skipped_files=len(there.index.files),
        bytes_raw=there.index.total_raw_bytes,
        bytes_stored=there.index.total_stored_bytes,
        seconds=time.perf_counter() - t0,
        already_committed=True,
    )


@contextmanager
def _locked_tmp(dst: Tier, run_id: str, step: int) -> Iterator[str]:
    """``step_N.tmp`` created if needed and exclusively locked (flock: released by the kernel
    if this process dies, so a crash never leaves a lock behind)."""
    tmp = dst.tmp_url(run_id, step)
    os.makedirs(tmp, exist_ok=True)
    fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StorageError(
                f"{tmp}: another promote of {run_id} step {step} is in progress; "
                "re-run after it finishes (it is then a no-op)"
            ) from None
        except OSError as e:  # a file system without locks: proceed, say so
            log.warning("cannot lock %s (%s); concurrent promotes of one step are unsafe here", tmp, e)
        yield tmp
    finally:
        os.close(fd)


def _require_rename_tier(dst: Tier) -> None:
    if dst.rule.kind != "rename":
        raise ConfigError(
            f"tier {dst.name} ({dst.url}) is an object store: promote writes to "
            "file-system tiers, use archive for object stores"
        )


def _workers(threads: int | None, n: int) -> int:
    if threads is not None and threads < 1:
        raise ConfigError(f"threads={threads!r} must be >= 1")
    return max(1, min(threads or 4, n))


def _read(path: str) -> bytes:
    return read_small(path, MAX_MANIFEST_BYTES)
