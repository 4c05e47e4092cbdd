"""Fetch: one stored checkpoint into a local DCP directory, every byte checked first.

Two timed phases, because restore drills report them separately:

1. **download** — stored objects to this machine (parallel ranged GETs on S3), each
   stored digest checked against ``tier.json``; on a local tier this phase is a plain
   copy when the tier stores raw files, and empty otherwise (decoding reads the tier);
2. **decompress** — each stored file decoded to its raw name, raw size and digest
   checked against the trainer's manifest.

An optional ``progress`` callback hears about bytes as they move (see :func:`progress_total`).

Everything is written under a hidden ``<dst>.part-*`` sibling and renamed to ``dst_dir``
only when every file matched, so ``dst_dir`` either holds a whole, verified checkpoint
(DCP files plus ``manifest.json``) or does not exist. Nothing is unpickled here: DCP's
``.metadata`` is only ever loaded by the caller, after this returned.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any

from ckptflow.tasks.codec import get_codec
from ckptflow.tasks.storage.index import StoredFile, TierIndex
from ckptflow.tasks.storage.tier import StoredCheckpoint, Tier
from ckptflow.tasks.transfer import _streams as streams
from ckptflow.tasks.transfer._pool import run_all
from ckptflow.tasks.transfer.results import FetchResult
from ckptflow.trainer.errors import (
    CkptflowError,
    CodecError,
    ConfigError,
    DestinationError,
    IntegrityError,
    StorageError,
)
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.checksum import hash_file
from ckptflow.trainer.fsutil import WRITE_ERRNOS, make_sibling_dir
from ckptflow.trainer.safeopen import copy_fd, open_sized

Progress = Callable[[int], None]
"""Called with a number of bytes just processed (from worker threads: it must be thread-safe;
rich's ``Progress.advance`` is). May be negative: an S3 retry takes back what it re-reads."""


def progress_total(tier: Tier, index: TierIndex) -> int:
    """What a fetch's ``progress`` calls add up to: the stored bytes it downloads plus the
    raw bytes it decodes. A raw tier (codec "none") downloads only: ``total_raw_bytes``; a
    compressed local tier decodes only (no download phase): ``total_raw_bytes``; a
    compressed object store does both: stored + raw."""
    raw = index.codec == "none"
    downloads = raw or not tier.is_local
    return (index.total_stored_bytes if downloads and not raw else 0) + index.total_raw_bytes


def fetch(
    tier: Tier,
    run_id: str,
    step: int,
    dst_dir: str,
    *,
    threads: int | None = None,
    progress: Progress | None = None,
    only: set[str] | None = None,
) -> FetchResult:
    """Download and decode ``run_id``/``step`` from ``tier`` into ``dst_dir`` (absent or empty).

    ``only``: fetch these members alone (with the manifest, which lists them all): a node that brings back
    what its ranks read, not the whole checkpoint (``progress`` then adds up to their bytes). A member the
    stored copy lacks is IntegrityError, like a missing object: the caller tries another copy.

    Raises CheckpointNotFoundError if the step is not committed there, IntegrityError
    naming the object when any byte differs from the index or the manifest. ``progress``
    (optional) is called with byte counts as they are downloaded and decoded; they add up
    to :func:`progress_total` when the fetch succeeds.
    """
    t0 = time.perf_counter()
    ckpt = tier.open_checkpoint(run_id, step)
    items = sorted(ckpt.index.files.items())
    if only is not None:
        unknown = only - set(ckpt.index.files)
        if unknown:
            raise IntegrityError(
                f"{ckpt.uri}: holds no {sorted(unknown)[:3]}, which the load plan reads; restore from another tier or "
                "an older checkpoint",
                path=ckpt.uri,
            )
        items = [(n, f) for n, f in items if n in only]
    dst_dir = os.path.abspath(dst_dir)
    check_destination(dst_dir)
    part = ""
    try:
        part = make_sibling_dir(dst_dir, "part")
        # Compressed objects land in a sibling dir, never inside `part`: no stored name can
        # then collide with (or delete) a member of the checkpoint.
        stored = make_sibling_dir(dst_dir, "stored")
    except OSError as e:  # not even a folder beside it: the destination's problem, whatever the errno
        if part:
            shutil.rmtree(part, ignore_errors=True)
        raise DestinationError(
            f"{dst_dir}: cannot write the checkpoint there ({e.strerror or e}: {e.filename}); fix the folder's "
            "owner, mode or free space, or choose another destination"
        ) from e
    res = FetchResult(
        uri=ckpt.uri,
        tier=tier.name,
        run_id=run_id,
        step=step,
        dst_dir=dst_dir,
        files=len(items),
        bytes_raw=sum(f.size for _, f in items),
        bytes_stored=sum(f.stored_size for _, f in items),
        codec=ckpt.index.codec,
    )
    workers = max(1, min(threads or 4, len(items)))
    try:
        with _destination(dst_dir, part, stored):
            td = time.perf_counter()
            local = _download(tier, ckpt, items, part, stored, workers, progress)
            res.download_seconds = time.perf_counter() - td
            tz = time.perf_counter()
            if ckpt.index.codec != "none":
                codec_threads = tier.config.codec_threads
                run_all(lambda it: _decode(ckpt, it[0], local[it[0]], part, codec_threads, progress), items, workers)
            res.decompress_seconds = time.perf_counter() - tz
            if layout.DCP_METADATA in ckpt.manifest.files and (only is None or layout.DCP_METADATA in only):
                # What `ckptflow verify` checks beyond the digests: an unsigned manifest can vouch for any
                # bytes, so .metadata must also parse as DCP's (restricted, bounded) before it is handed on.
                from ckptflow.trainer.format.dcpmeta import read_dcp_metadata

                read_dcp_metadata(os.path.join(part, layout.DCP_METADATA), source=ckpt.object_url(layout.DCP_METADATA))
            with open(os.path.join(part, layout.MANIFEST), "wb") as f:
                f.write(ckpt.manifest_bytes)
            if os.path.isdir(dst_dir):
                os.rmdir(dst_dir)  # empty (checked above); rename needs the name free
            os.rename(part, dst_dir)
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(stored, ignore_errors=True)
    res.seconds = time.perf_counter() - t0
    return res


def check_destination(dst_dir: str) -> None:
    """A restore's destination: absent, or an empty directory that is not a symlink (a link would have the
    checkpoint land wherever it points). Raises :class:`DestinationError` naming it otherwise."""
    if os.path.islink(dst_dir):
        raise DestinationError(
            f"{dst_dir}: is a symbolic link ({os.readlink(dst_dir)}); give the real directory to restore into"
        )
    if os.path.lexists(dst_dir) and (not os.path.isdir(dst_dir) or os.listdir(dst_dir)):
        raise ConfigError(f"fetch destination {dst_dir} exists and is not an empty directory; give a new or empty one")


@contextlib.contextmanager
def _destination(dst_dir: str, *ours: str) -> Iterator[None]:
    """Turn a failure to write under ``ours`` (or a full, read-only or over-quota disk anywhere) into a
    :class:`DestinationError` naming ``dst_dir``: a restore stops at once instead of blaming every candidate."""
    try:
        yield
    except DestinationError:
        raise
    except OSError as e:
        if isinstance(e, CkptflowError) and not isinstance(e, StorageError):
            raise
        name = os.fsdecode(e.filename) if isinstance(e.filename, (str, bytes, os.PathLike)) else ""
        if e.errno in WRITE_ERRNOS or any(name == d or name.startswith(d + os.sep) for d in ours):
            raise DestinationError(
                f"{dst_dir}: cannot write the checkpoint there ({e.strerror or e}); free space or choose another "
                "destination, then run again (the checkpoint itself was not at fault)"
            ) from e
        raise


def _download(
    tier: Tier,
    ckpt: StoredCheckpoint,
    items: list[tuple[str, StoredFile]],
    part: str,
    stored: str,
    workers: int,
    progress: Progress | None = None,
) -> dict[str, str]:
    """Phase 1. Returns, per file, the local path of its stored bytes (checked)."""
    raw = ckpt.index.codec == "none"
    if tier.is_local and not raw:
        return {n: ckpt.object_url(n) for n, _ in items}  # decoded straight from the tier
    manager = tier.s3.transfer_manager() if (tier.s3 and not tier.is_local) else None
    loader = manager if manager is None or progress is None else _ReportingManager(manager, progress)

    def one(item: tuple[str, StoredFile]) -> tuple[str, str]:
        name, f = item
        url = ckpt.object_url(name)
        dest = _inside(part, name) if raw else _inside(stored, f.stored_name)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        try:
            if tier.is_local:
                with open_sized(url, f.stored_size, what=f"tier {tier.name}") as fi, open(dest, "wb") as fo:
                    copy_fd(fi.fileno(), fo, progress=progress)
            elif loader is not None:
                assert tier.s3 is not None  # a loader exists only when the tier has S3 (manager above)
                tier.s3.download(loader, url, dest)
            else:
                tier.fs.get_file(url, dest)
                if progress is not None:
                    progress(f.stored_size)
        except FileNotFoundError:
            raise IntegrityError(
                f"{url}: missing although {ckpt.uri} is committed; restore from another tier or an older checkpoint",
                path=url,
            ) from None
        # codec "none": what is stored is the file itself, so it answers to the manifest
        want = ckpt.manifest.files[name] if raw else None
        size, digest = (want.size, want.checksum) if want else (f.stored_size, f.stored_checksum)
        got, n = hash_file(dest)
        if (n, got) != (size, digest):
            raise IntegrityError(
                f"{url}: {n} B xxh3 {got}, expected {size} B {digest} "
                f"({'manifest' if raw else 'tier.json'}); the stored object is "
                "damaged — restore from another tier or an older checkpoint",
                path=url,
            )
        return name, dest

    try:
        return dict(run_all(one, items, workers))
    finally:
        if manager is not None:
            manager.shutdown()


def _decode(
    ckpt: StoredCheckpoint, name: str, src_path: str, part: str, threads: int | None, progress: Progress | None = None
) -> None:
    """Phase 2: one stored file to its raw name; raw digest must equal the manifest's."""
    url = ckpt.object_url(name)
    dest = _inside(part, name)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    entry = ckpt.manifest.files[name]
    try:
        with open_sized(src_path, ckpt.index.files[name].stored_size) as f, open(dest, "wb") as out:
            sink: Any = out if progress is None else _ReportingWriter(out, progress)
            st = get_codec(ckpt.index.codec).decompress(f, sink, threads=threads, name=url)
    except FileNotFoundError:
        raise IntegrityError(
            f"{url}: missing although {ckpt.uri} is committed; restore from another tier or an older checkpoint",
            path=url,
        ) from None
    except CodecError as e:
        raise IntegrityError(f"{url}: stored object does not decode ({e})", path=url) from None
    streams.check_raw(st, entry.size, entry.checksum, url, "stored")


def _inside(root: str, name: str) -> str:
    """Local path of a checkpoint member under ``root``; the name was validated, check again."""
    path = os.path.join(root, *layout.check_member_name(name).split("/"))
    if not os.path.abspath(path).startswith(os.path.abspath(root) + os.sep):
        raise IntegrityError(f"{name!r} resolves outside {root}; refusing", path=path)
    return path


class _ReportingWriter:
    """A decoder's output stream that reports every write (decoders only write and flush)."""

    def __init__(self, f: Any, progress: Progress) -> None:
        self._f, self._progress = f, progress

    def write(self, b: bytes | bytearray | memoryview) -> int:
        n = self._f.write(b)
        self._progress(len(b) if not isinstance(b, memoryview) else b.nbytes)
        return n

    def flush(self) -> None:
        self._f.flush()


class _ReportingManager:
    """An s3transfer manager whose downloads also report bytes (``S3Objects.download`` is
    reused unchanged, with its error mapping; only a subscriber is added)."""

    def __init__(self, manager: Any, progress: Progress) -> None:
        self._manager, self._progress = manager, progress

    def download(self, bucket: str, key: str, fileobj: Any, extra_args: Any = None, subscribers: Any = None) -> Any:
        from s3transfer.subscribers import BaseSubscriber

        report = self._progress

        class _Sub(BaseSubscriber):
            def on_progress(self, future: Any, bytes_transferred: int, **kwargs: Any) -> None:
                report(bytes_transferred)

        return self._manager.download(
            bucket, key, fileobj, extra_args=extra_args, subscribers=[*(subscribers or []), _Sub()]
        )

    def shutdown(self) -> None:
        self._manager.shutdown()
