"""The ``.ckz`` container: byte layout, packing and checking. Spec: docs/codec.md.

Layout (all integers little-endian)::

    file header   magic(8) version(u16) flags(u16) params_len(u32) params(JSON) check(u64)
    chunk record  magic "CKZC"(4) index(u32) raw_offset(u64) raw_len(u32) body_len(u32)
                  raw_digest(16) body_check(u64) header_check(u64)   -> 56 bytes, then body
    ...           one record per chunk, in raw order
    end record    magic "CKZE"(4) reserved(u32) chunk_count(u64) raw_total(u64)
                  raw_digest(16) check(u64)                         -> 48 bytes, then EOF

``check`` fields are xxh3-64 of the bytes before them in the same record;
``raw_digest`` is xxh3-128 (``trainer.checksum``'s algorithm) of the chunk's raw
bytes, or of the whole raw content in the end record.

Why every record has its own check: a reader must never act on a corrupted length
(allocating gigabytes, or reading the next chunk from the wrong offset), and an
error must say *which* chunk is bad. Why an end record: a stream cut exactly at a
chunk boundary is otherwise indistinguishable from a whole one.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import xxhash

from ckptflow.trainer.errors import CodecError

MAGIC = b"\x89CKZ\r\n\x1a\n"  # PNG-style: catches 7-bit and CRLF-mangling transfers
VERSION = 1
CHUNK_MAGIC = b"CKZC"
END_MAGIC = b"CKZE"
MAX_PARAMS = 64 << 10
MAX_CHUNK = 256 << 20

_FILE_FIXED = struct.Struct("<8sHHI")
_CHUNK = struct.Struct("<4sIQII16sQ")  # everything before header_check
_END = struct.Struct("<4sIQQ16s")  # everything before check
_U64 = struct.Struct("<Q")
CHUNK_HEADER_SIZE = _CHUNK.size + 8
END_SIZE = _END.size + 8
FILE_FIXED_SIZE = _FILE_FIXED.size


class ContainerError(CodecError):
    """A container is truncated, corrupt or unknown; says which file, chunk and offset."""

    def __init__(
        self, message: str, *, path: str | None = None, chunk: int | None = None, offset: int | None = None
    ) -> None:
        parts = [
            p
            for p in (
                path,
                None if chunk is None else f"chunk {chunk}",
                None if offset is None else f"stored byte offset {offset}",
            )
            if p
        ]
        super().__init__(f"{', '.join(parts)}: {message}" if parts else message)
        self.path, self.chunk, self.offset = path, chunk, offset


def check64(*parts: bytes | bytearray | memoryview) -> int:
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return h.intdigest()


# ---- file header ------------------------------------------------------------------


def pack_file_header(params: dict) -> bytes:
    body = json.dumps(params, sort_keys=True, separators=(",", ":")).encode()
    head = _FILE_FIXED.pack(MAGIC, VERSION, 0, len(body)) + body
    return head + _U64.pack(check64(head))


def unpack_file_header(fixed: bytes, rest_reader, path: str | None) -> tuple[dict, int]:
    """Parse the header from its fixed part and a ``read(n)`` for the rest; returns (params, size)."""
    if fixed and len(fixed) < FILE_FIXED_SIZE and MAGIC.startswith(fixed[:8]):
        raise ContainerError(f"truncated inside the file header ({len(fixed)} bytes)", path=path, offset=len(fixed))
    if len(fixed) < FILE_FIXED_SIZE or fixed[:8] != MAGIC:
        hint = (
            " (it is a plain zstd stream: decompress it with codec 'zstd')"
            if fixed.startswith(b"\x28\xb5\x2f\xfd")
            else ""
        )
        raise ContainerError(f"not a ckptflow .ckz container (magic {fixed[:8]!r}){hint}", path=path, offset=0)
    _, version, flags, plen = _FILE_FIXED.unpack(fixed)
    if version != VERSION:
        raise ContainerError(
            f"container version {version} is not supported (this ckptflow reads version {VERSION}); upgrade ckptflow",
            path=path,
            offset=8,
        )
    if flags:
        raise ContainerError(
            f"container flags {flags:#06x} are unknown to this ckptflow; upgrade ckptflow", path=path, offset=10
        )
    if plen > MAX_PARAMS:
        raise ContainerError(
            f"header declares {plen} bytes of parameters (at most {MAX_PARAMS}); the header is corrupt",
            path=path,
            offset=12,
        )
    rest = rest_reader(plen + 8)
    if len(rest) < plen + 8:
        raise ContainerError("truncated inside the file header", path=path, offset=FILE_FIXED_SIZE + len(rest))
    body, (check,) = rest[:plen], _U64.unpack(rest[plen:])
    if check64(fixed, body) != check:
        raise ContainerError("file header checksum mismatch; the header is corrupt", path=path, offset=0)
    try:
        params = json.loads(body)
        if not isinstance(params, dict):
            raise ValueError("not an object")
    except ValueError as e:
        raise ContainerError(
            f"header parameters are not a JSON object ({e})", path=path, offset=FILE_FIXED_SIZE
        ) from None
    return params, FILE_FIXED_SIZE + plen + 8


# ---- chunk and end records ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    index: int
    raw_offset: int
    raw_len: int
    body_len: int
    raw_digest: bytes
    body_check: int


def pack_chunk_header(h: ChunkHeader) -> bytes:
    head = _CHUNK.pack(CHUNK_MAGIC, h.index, h.raw_offset, h.raw_len, h.body_len, h.raw_digest, h.body_check)
    return head + _U64.pack(check64(head))


def unpack_chunk_header(b: bytes, *, path: str | None, chunk: int, offset: int, max_body: int) -> ChunkHeader:
    """Parse and check a 56-byte chunk header; every length is bounded before use."""
    if len(b) < CHUNK_HEADER_SIZE:
        raise ContainerError(
            f"truncated inside the chunk header ({len(b)} of {CHUNK_HEADER_SIZE} bytes)",
            path=path,
            chunk=chunk,
            offset=offset,
        )
    head, (check,) = b[: _CHUNK.size], _U64.unpack(b[_CHUNK.size : CHUNK_HEADER_SIZE])
    if head[:4] != CHUNK_MAGIC:
        raise ContainerError(
            f"expected a chunk header, found bytes {head[:4]!r}; the container is corrupt here",
            path=path,
            chunk=chunk,
            offset=offset,
        )
    if check64(head) != check:
        raise ContainerError(
            "chunk header checksum mismatch; the container is corrupt here", path=path, chunk=chunk, offset=offset
        )
    _, index, raw_offset, raw_len, body_len, raw_digest, body_check = _CHUNK.unpack(head)
    h = ChunkHeader(index, raw_offset, raw_len, body_len, raw_digest, body_check)
    if index != chunk:
        raise ContainerError(
            f"chunk header says it is chunk {index}; chunks are missing or out of order",
            path=path,
            chunk=chunk,
            offset=offset,
        )
    if raw_len > MAX_CHUNK or body_len > max_body:
        raise ContainerError(
            f"chunk lengths raw={raw_len} stored={body_len} exceed the container's limits; the container is corrupt",
            path=path,
            chunk=chunk,
            offset=offset,
        )
    return h


def pack_end(chunk_count: int, raw_total: int, raw_digest: bytes) -> bytes:
    head = _END.pack(END_MAGIC, 0, chunk_count, raw_total, raw_digest)
    return head + _U64.pack(check64(head))


def unpack_end(b: bytes, *, path: str | None, chunk: int, offset: int) -> tuple[int, int, bytes]:
    if len(b) < END_SIZE:
        raise ContainerError("truncated inside the end record", path=path, chunk=chunk, offset=offset)
    head, (check,) = b[: _END.size], _U64.unpack(b[_END.size : END_SIZE])
    if check64(head) != check:
        raise ContainerError(
            "end record checksum mismatch; the container is corrupt", path=path, chunk=chunk, offset=offset
        )
    _, _, count, total, digest = _END.unpack(head)
    return count, total, digest


# ---- chunk body: segment table, stream table, streams -----------------------------

_SEG = struct.Struct("<BI")
_STREAM = struct.Struct("<BI")
METHOD_RAW = 0
METHOD_ZSTD = 1


def pack_body(
    segments: list[tuple[int, int]], streams: list[tuple[int, bytes | memoryview]]
) -> list[bytes | memoryview]:
    """Body parts: ``u32 nseg, nseg x (u8 kind, u32 len), u8 nstreams,
    nstreams x (u8 method, u32 stored_len)``, then the stored streams."""
    table = bytearray(struct.pack("<I", len(segments)))
    for kind, n in segments:
        table += _SEG.pack(kind, n)
    table += struct.pack("<B", len(streams))
    for method, data in streams:
        table += _STREAM.pack(method, _nbytes(data))
    return [bytes(table), *(d for _, d in streams)]


def _nbytes(b: bytes | memoryview) -> int:
    return b.nbytes if isinstance(b, memoryview) else len(b)


def unpack_body(body: memoryview) -> tuple[list[tuple[int, int]], list[tuple[int, memoryview]]]:
    """Inverse of :func:`pack_body`; raises ``ValueError`` on any inconsistency."""
    if len(body) < 5:
        raise ValueError("body shorter than its tables")
    (nseg,) = struct.unpack_from("<I", body, 0)
    pos = 4
    if pos + nseg * _SEG.size + 1 > len(body):
        raise ValueError(f"segment table of {nseg} entries overruns the body")
    segments = [_SEG.unpack_from(body, pos + i * _SEG.size) for i in range(nseg)]
    pos += nseg * _SEG.size
    nstreams = body[pos]
    pos += 1
    if pos + nstreams * _STREAM.size > len(body):
        raise ValueError(f"stream table of {nstreams} entries overruns the body")
    heads = [_STREAM.unpack_from(body, pos + i * _STREAM.size) for i in range(nstreams)]
    pos += nstreams * _STREAM.size
    streams = []
    for method, n in heads:
        if pos + n > len(body):
            raise ValueError("a stream overruns the body")
        streams.append((method, body[pos : pos + n]))
        pos += n
    if pos != len(body):
        raise ValueError(f"{len(body) - pos} unexplained bytes after the streams")
    return segments, streams
