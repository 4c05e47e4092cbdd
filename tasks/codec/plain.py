"""The two codecs that know nothing about tensors: ``none`` and plain ``zstd``.

``zstd`` writes a standard zstd frame (``zstd -d`` reads it) with zstd's content
checksum, compressed by zstd's own worker threads. It stays available per tier:
for non-tensor files, for checkpoints without a dtype map, and for anyone who
wants a format every machine can read without ckptflow.

Why decompression walks the frame structure itself: python-zstandard's streaming
decoders stop quietly at the end of the input, so a stream cut mid-frame (a
partial download) would decode to a short file without any error. Walking the
block headers as they pass costs nothing and tells a cut frame from a whole one.
"""

from __future__ import annotations

import struct
import time
from typing import TYPE_CHECKING, BinaryIO

import zstandard

from ckptflow.tasks.codec.base import (
    CodecStats,
    HashingReader,
    HashingWriter,
    Writer,
    default_threads,
    read_full,
    where,
)
from ckptflow.trainer.errors import CodecError, ConfigError

if TYPE_CHECKING:
    from ckptflow.tasks.codec.dtypemap import DtypeMap

COPY_BLOCK = 1 << 20
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_SKIPPABLE_MASK = 0xFFFFFFF0
_SKIPPABLE_MAGIC = 0x184D2A50
_FCS_SIZES = (0, 2, 4, 8)
_DICT_ID_SIZES = (0, 1, 2, 4)


def check_level(level: int | None, default: int) -> int:
    if level is None:
        return default
    if not isinstance(level, int) or not -7 <= level <= 22:
        raise ConfigError(f"zstd level {level!r} must be an integer in [-7, 22]")
    return level


class NoneCodec:
    """Stores bytes as they are; still returns both digests (they are equal)."""

    name = "none"
    suffix = ""

    def compress(
        self,
        src: BinaryIO,
        dst: BinaryIO,
        *,
        level: int | None = None,
        threads: int | None = None,
        dtype_map: DtypeMap | None = None,
        name: str | None = None,
    ) -> CodecStats:
        return _copy(src, dst)

    def decompress(
        self, src: BinaryIO, dst: Writer, *, threads: int | None = None, name: str | None = None
    ) -> CodecStats:
        return _copy(src, dst)


def _copy(src: BinaryIO, dst: Writer) -> CodecStats:
    t0 = time.perf_counter()
    out = HashingWriter(dst)
    while True:
        b = src.read(COPY_BLOCK)
        if not b:
            break
        out.write(b)
    out.flush()
    digest = out.hexdigest()
    return CodecStats(out.count, out.count, digest, digest, time.perf_counter() - t0)


class ZstdCodec:
    """Plain zstd: one standard frame, multithreaded compression, checksummed content."""

    name = "zstd"
    suffix = ".zst"
    default_level = 3

    def compress(
        self,
        src: BinaryIO,
        dst: BinaryIO,
        *,
        level: int | None = None,
        threads: int | None = None,
        dtype_map: DtypeMap | None = None,
        name: str | None = None,
    ) -> CodecStats:
        t0 = time.perf_counter()
        n = default_threads(threads)
        cctx = zstandard.ZstdCompressor(
            level=check_level(level, self.default_level), threads=n if n > 1 else 0, write_checksum=True
        )
        reader, writer = HashingReader(src), HashingWriter(dst)
        # zstandard only calls read()/write() on these; its stub asks for IO[bytes]
        cctx.copy_stream(reader, writer, read_size=COPY_BLOCK, write_size=COPY_BLOCK)  # type: ignore[arg-type]
        writer.flush()
        return CodecStats(reader.count, writer.count, reader.hexdigest(), writer.hexdigest(), time.perf_counter() - t0)

    def decompress(
        self, src: BinaryIO, dst: Writer, *, threads: int | None = None, name: str | None = None
    ) -> CodecStats:
        t0 = time.perf_counter()
        reader, writer = HashingReader(src), HashingWriter(dst)
        frames = 0
        try:
            while True:
                magic = read_full(reader, 4)
                if not magic:
                    break
                if len(magic) < 4:
                    raise _truncated(name, reader.count, "a frame header")
                frames += 1
                (m,) = struct.unpack("<I", magic)
                if m & _SKIPPABLE_MASK == _SKIPPABLE_MAGIC:  # metadata frame: skip its body
                    (size,) = struct.unpack("<I", _need(reader, 4, name, "a skippable frame"))
                    _need(reader, size, name, "a skippable frame")
                    continue
                if magic != ZSTD_MAGIC:
                    raise CodecError(
                        f"{where(name)}not a zstd stream: bytes {magic!r} at offset "
                        f"{reader.count - 4} are no zstd frame magic (codec 'zstd'); the "
                        "object is damaged or was stored with another codec"
                    )
                _decode_frame(magic, reader, writer, name)
        except zstandard.ZstdError as e:
            raise CodecError(
                f"{where(name)}zstd frame {frames} is corrupt near stored byte offset "
                f"{reader.count} ({e}); the stored object is damaged, fetch it again or "
                "restore from another tier"
            ) from None
        writer.flush()
        return CodecStats(writer.count, reader.count, writer.hexdigest(), reader.hexdigest(), time.perf_counter() - t0)


def _need(reader: HashingReader, n: int, name: str | None, what: str) -> bytes:
    b = read_full(reader, n)
    if len(b) < n:
        raise _truncated(name, reader.count, what)
    return b


def _truncated(name: str | None, offset: int, what: str) -> CodecError:
    return CodecError(
        f"{where(name)}zstd stream is truncated at stored byte offset {offset}, inside "
        f"{what}; the object was cut short (partial upload or download): fetch it again"
    )


def _decode_frame(magic: bytes, reader: HashingReader, writer: HashingWriter, name: str | None) -> None:
    """Feed one frame to a streaming decoder, block by block, requiring its last block."""
    # zstandard only calls write() (and flush) on the writer; its stub asks for IO[bytes]
    dec = zstandard.ZstdDecompressor().stream_writer(
        writer,  # type: ignore[arg-type]
        write_size=COPY_BLOCK,
        closefd=False,
    )
    fhd = _need(reader, 1, name, "a frame header")
    d = fhd[0]
    fcs_flag, single, has_checksum, dict_flag = d >> 6, (d >> 5) & 1, (d >> 2) & 1, d & 3
    fcs = _FCS_SIZES[fcs_flag] if fcs_flag or not single else 1
    rest = _need(reader, (0 if single else 1) + _DICT_ID_SIZES[dict_flag] + fcs, name, "a frame header")
    dec.write(magic + fhd + rest)
    while True:
        bh = _need(reader, 3, name, "a block header")
        h = int.from_bytes(bh, "little")
        last, btype, bsize = h & 1, (h >> 1) & 3, h >> 3
        if btype == 3:
            raise zstandard.ZstdError(f"reserved block type in block header {bh.hex()}")
        payload = _need(reader, 1 if btype == 1 else bsize, name, "a block")
        dec.write(bh + payload)
        if last:
            break
    if has_checksum:
        dec.write(_need(reader, 4, name, "a frame checksum"))
    dec.flush()
