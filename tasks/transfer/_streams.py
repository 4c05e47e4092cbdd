"""Moving one file's bytes between stored forms, streaming, digests checked on the way.

Three ways a file reaches a destination codec, chosen per file:

* **as-is**: the source already stores it with the destination's codec; the stored
  bytes are copied and their digest must equal the source index (no recompression);
* **encode**: the source stores raw bytes; they stream through the codec;
* **transcode**: the source stores another codec; its decoder feeds the encoder
  through an OS pipe (two threads), so no whole file is ever in memory or on disk.

Whatever the route, the raw digest seen on the way must equal the trainer manifest's,
otherwise the *source* is damaged and the error names it.
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import threading
from typing import BinaryIO

from ckptflow.tasks.codec import Codec, CodecStats, DtypeMap, get_codec
from ckptflow.tasks.storage.tier import StoredCheckpoint, Tier
from ckptflow.trainer.errors import CkptflowError, CodecError, IntegrityError
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.checksum import hash_file, new_hasher
from ckptflow.trainer.safeopen import open_sized
from ckptflow.trainer.verify import check_file

log = logging.getLogger(__name__)

READ_BLOCK = 8 << 20


def open_stored(tier: Tier, url: str, size: int) -> BinaryIO:
    """A stored object of ``size`` bytes (its index's) for streaming reads: on a local tier a regular file of
    exactly that size, opened without fsspec (``trainer.safeopen``)."""
    if tier.is_local:
        return open_sized(url, size, what=f"tier {tier.name}")
    return tier.fs.open(url, "rb", block_size=READ_BLOCK)


def stored_name(name: str, codec: str) -> str:
    return layout.check_member_name(name + get_codec(codec).suffix)


def encode_file(
    src: Tier,
    ckpt: StoredCheckpoint,
    name: str,
    dst: BinaryIO,
    *,
    codec: str,
    level: int | None,
    threads: int | None,
    dtype_map: DtypeMap | None = None,
) -> CodecStats:
    """Write file ``name`` of ``ckpt`` to ``dst`` in ``codec``'s stored form; see module doc."""
    entry = ckpt.index.files[name]
    src_url = ckpt.object_url(name)
    try:
        with open_stored(src, src_url, entry.stored_size) as f:
            if ckpt.index.codec == codec:
                copied = get_codec("none").compress(f, dst)
                if (copied.stored_bytes, copied.stored_checksum) != (entry.stored_size, entry.stored_checksum):
                    raise IntegrityError(
                        f"{src_url}: stored bytes ({copied.stored_bytes} B, {copied.stored_checksum}) "
                        f"differ from the tier index ({entry.stored_size} B, {entry.stored_checksum}); "
                        f"the source copy is damaged — copy {ckpt.run_id} step {ckpt.step} from "
                        "another tier",
                        path=src_url,
                    )
                return CodecStats(
                    entry.size, copied.stored_bytes, entry.checksum, copied.stored_checksum, copied.seconds
                )
            enc = get_codec(codec)
            if ckpt.index.codec == "none":
                stats = enc.compress(f, dst, level=level, threads=threads, dtype_map=dtype_map, name=src_url)
            else:
                stats = _transcode(f, get_codec(ckpt.index.codec), enc, dst, level=level, threads=threads, name=src_url)
    except FileNotFoundError:
        raise IntegrityError(
            f"{src_url}: missing from the source tier although {ckpt.uri} is "
            "committed; copy this checkpoint from another tier",
            path=src_url,
        ) from None
    except CodecError as e:
        raise IntegrityError(f"{src_url}: cannot be decoded ({e})", path=src_url) from None
    check_raw(stats, entry.size, entry.checksum, src_url, "source")
    return stats


def check_raw(stats: CodecStats, size: int, checksum: str, url: str, side: str) -> None:
    if (stats.raw_bytes, stats.raw_checksum) != (size, checksum):
        raise IntegrityError(
            f"{url}: raw content ({stats.raw_bytes} B, xxh3 {stats.raw_checksum}) differs from the "
            f"manifest ({size} B, {checksum}); the {side} copy is damaged — use another tier or "
            "an older checkpoint",
            path=url,
        )


def _transcode(
    src: BinaryIO, dec: Codec, enc: Codec, dst: BinaryIO, *, level: int | None, threads: int | None, name: str
) -> CodecStats:
    r, w = os.pipe()
    errors: list[BaseException] = []
    pr, pw = open(r, "rb"), open(w, "wb")

    def decode() -> None:
        try:
            dec.decompress(src, pw, threads=threads, name=name)
        except BrokenPipeError:
            pass  # the encoder stopped early; its own error is the one to report
        except BaseException as e:  # handed to the caller's thread
            errors.append(e)
        finally:
            try:
                pw.close()
            except BrokenPipeError:
                pass

    t = threading.Thread(target=decode, name="ckptflow-transcode", daemon=True)
    t.start()
    try:
        stats = enc.compress(pr, dst, level=level, threads=threads, name=name)
    finally:
        pr.close()  # unblocks a decoder still writing (BrokenPipeError above)
        t.join()
    if errors:
        raise errors[0]
    return stats


COPY_CHUNK = 32 << 20  # a multiple of mmap.ALLOCATIONGRANULARITY (the read-back maps chunks)


def copy_verified(src_path: str, dst_path: str, size: int, checksum: str) -> None:
    """Copy a local file in the kernel and check the copy against (size, checksum), in one pass.

    The copy runs in chunks (``copy_file_range``: no bytes through Python); a second
    thread reads each chunk back *from the destination* as soon as it is written and
    digests it, so the after-copy check overlaps the copy instead of following it. The
    file is fsynced before the digest is compared.
    """
    hasher = new_hasher()
    chunks: queue.Queue[tuple[int, int] | None] = queue.Queue()
    seen = [0]
    errors: list[BaseException] = []

    def read_back() -> None:
        try:
            with open(dst_path, "rb", buffering=0) as r:
                while (item := chunks.get()) is not None:
                    off, n = item
                    if os.fstat(r.fileno()).st_size < off + n:
                        raise IntegrityError(f"{dst_path}: shorter than written (at byte {off})", path=dst_path)
                    # mmap: the digest reads the page cache in place (no copy into Python),
                    # ~40 % cheaper than readinto; chunk offsets are page-aligned.
                    with mmap.mmap(r.fileno(), n, offset=off, access=mmap.ACCESS_READ) as mm:
                        hasher.update(mm)
                    seen[0] += n
        except BaseException as e:  # handed to the copying thread
            errors.append(e)
            while chunks.get() is not None:  # drain so the copier never blocks
                pass

    with open(src_path, "rb", buffering=0) as fi, open(dst_path, "wb", buffering=0) as fo:
        t = threading.Thread(target=read_back, name="ckptflow-readback", daemon=True)
        t.start()  # after the destination exists
        try:
            off = 0
            while True:
                n = _kernel_copy(fi, fo, COPY_CHUNK)
                if not n:
                    break
                chunks.put((off, n))
                off += n
            os.fsync(fo.fileno())
        finally:
            chunks.put(None)
            t.join()
    if errors:
        raise errors[0]
    digest = hasher.hexdigest()
    if (seen[0], digest) != (size, checksum):
        raise IntegrityError(
            f"{dst_path}: copy reads back as {seen[0]} B xxh3 {digest}, the manifest "
            f"says {size} B {checksum} (source {src_path} damaged, or the copy "
            "failed) — check both disks, then re-run",
            path=dst_path,
        )


def _kernel_copy(fi: BinaryIO, fo: BinaryIO, n: int) -> int:
    try:
        return os.copy_file_range(fi.fileno(), fo.fileno(), n)
    except (AttributeError, OSError):  # older kernels, cross-device on some file systems
        data = fi.read(n)
        fo.write(data)
        return len(data)


def verify_local(path: str, size: int, checksum: str, what: str) -> None:
    """Re-read a written file and compare its digest (the after-copy check)."""
    try:
        digest, n = hash_file(path)
    except FileNotFoundError:
        raise IntegrityError(f"{path}: missing right after it was written ({what})", path=path) from None
    if (n, digest) != (size, checksum):
        raise IntegrityError(
            f"{path}: reads back as {n} B xxh3 {digest}, expected {size} B {checksum} "
            f"({what}); the destination corrupted the copy — check the disk, then "
            "re-run",
            path=path,
        )


def decode_verify(path: str, codec: str, size: int, checksum: str, threads: int | None) -> None:
    """Decode a written file and compare the raw digest with the manifest (deep verify)."""

    class _Null:
        def write(self, b: bytes | bytearray | memoryview) -> int:
            return len(b)

    with open(path, "rb") as f:
        try:
            stats = get_codec(codec).decompress(f, _Null(), threads=threads, name=path)
        except CodecError as e:
            raise IntegrityError(f"{path}: does not decode ({e})", path=path) from None
    check_raw(stats, size, checksum, path, "destination")


def dtype_maps(src: Tier, ckpt: StoredCheckpoint, codec: str) -> dict[str, DtypeMap]:
    """Dtype maps for tensor-aware codecs, when the source holds raw files on local disk.

    DCP's ``.metadata`` is checked against the manifest before it is parsed. Without maps
    (a remote or compressed source) ``bytegroup`` still works, with a lower ratio.
    """
    if codec != "bytegroup" or ckpt.index.codec != "none" or not src.is_local:
        return {}
    entry = ckpt.manifest.files[layout.DCP_METADATA]
    problem = check_file(ckpt.uri, layout.DCP_METADATA, entry.size, entry.checksum)
    if problem is not None:
        raise IntegrityError(f"{problem}; not parsing it", path=problem.path)
    try:
        from ckptflow.tasks.codec import dtype_maps_for_checkpoint

        return dict(dtype_maps_for_checkpoint(ckpt.uri))
    except (CkptflowError, OSError, ValueError) as e:
        log.warning("no dtype maps for %s (%s); compressing without them", ckpt.uri, e)
        return {}
