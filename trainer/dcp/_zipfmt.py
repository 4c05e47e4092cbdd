"""The zip container ``torch.save`` writes, read without ``zipfile`` (which re-checks CRCs and copies), for the reader
(where a tensor's data lies) and the writer (``fastwrite.py``: where a template's CRC fields lie)."""

from __future__ import annotations

import struct
from typing import NamedTuple

EOCD = b"PK\x05\x06"
CEN = b"PK\x01\x02"
LOC = b"PK\x03\x04"
_CEN = struct.Struct("<4s6H3I5HII")  # a central directory record's 46 fixed bytes
_LOC = struct.Struct("<4s22xHH")  # a local header's signature and its name and extra lengths


LOCAL_CRC = 14
"""Where a local header keeps its entry's CRC-32."""
CENTRAL_CRC = 16
"""Where a central directory record keeps it."""


class Entry(NamedTuple):
    data: int
    """Offset of the entry's first data byte."""
    size: int
    local: int
    """Offset of its local header (CRC at ``LOCAL_CRC``)."""
    central: int
    """Offset of its central directory record (CRC at ``CENTRAL_CRC``)."""


def entries(buf: memoryview | bytes) -> dict[str, Entry]:
    """Every *stored* (uncompressed) entry of the zip in ``buf``, by name; ValueError if it is not one."""
    eocd = _end_record(buf)
    n_entries, cd_size, cd_off = struct.unpack_from("<HII", buf, eocd + 10)
    if cd_off == 0xFFFFFFFF or n_entries == 0xFFFF:  # ZIP64 end record, just before the locator
        loc = bytes(buf[eocd - 20 : eocd])
        if loc[:4] != b"PK\x06\x07":
            raise ValueError("zip64 locator missing")
        (z64,) = struct.unpack_from("<Q", loc, 8)
        n_entries, cd_size, cd_off = struct.unpack_from("<QQQ", buf, z64 + 32)
    out: dict[str, Entry] = {}
    p = cd_off
    for _ in range(n_entries):
        name, entry, p = record(buf, p)
        out[name] = entry
    return out


def end_record(buf: memoryview | bytes) -> bytes:
    """The zip's end-of-central-directory record (record count, directory size and offset)."""
    eocd = _end_record(buf)
    return bytes(buf[eocd : eocd + 22])


def record(buf: memoryview | bytes, p: int) -> tuple[str, Entry, int]:
    """The *stored* entry whose central directory record is at ``p``: its name, where its data lies, and where the
    next record starts; ValueError if there is none such."""
    # one unpack per record: the reader parses every tensor item's zip
    sig, _v, _n, _f, method, _t, _d, _crc, csize, usize, nlen, xlen, clen, _s, _i, _a, hoff = _CEN.unpack_from(buf, p)
    if sig != CEN:
        raise ValueError("bad central directory entry")
    name = bytes(buf[p + 46 : p + 46 + nlen]).decode()
    if 0xFFFFFFFF in (csize, usize, hoff):
        extra = bytes(buf[p + 46 + nlen : p + 46 + nlen + xlen])
        vals = _zip64_values(extra, usize == 0xFFFFFFFF, csize == 0xFFFFFFFF, hoff == 0xFFFFFFFF)
        usize, csize, hoff = (
            vals.pop(0) if usize == 0xFFFFFFFF else usize,
            vals.pop(0) if csize == 0xFFFFFFFF else csize,
            vals.pop(0) if hoff == 0xFFFFFFFF else hoff,
        )
    if method != 0 or csize != usize:
        raise ValueError(f"{name} is compressed")
    lsig, lnlen, lxlen = _LOC.unpack_from(buf, hoff)
    if lsig != LOC:
        raise ValueError("bad local header")
    start = hoff + 30 + lnlen + lxlen
    if start + usize > len(buf):
        raise ValueError(f"{name} runs past the item")
    return name, Entry(start, usize, hoff, p), p + 46 + nlen + xlen + clen


def record_end(buf: memoryview | bytes, p: int) -> int:
    """Where the central directory record at ``p`` ends (its name, extra field and comment included)."""
    nlen, xlen, clen = struct.unpack_from("<3H", buf, p + 28)
    return p + 46 + nlen + xlen + clen


def _end_record(buf: memoryview | bytes) -> int:
    """Offset of the end-of-central-directory record; the last 22 bytes are checked first (``torch.save`` writes no
    zip comment), sparing a scan of the 64 KiB a comment may take for every tensor item."""
    if len(buf) >= 22 and bytes(buf[len(buf) - 22 : len(buf) - 18]) == EOCD:
        return len(buf) - 22
    tail = bytes(buf[max(0, len(buf) - 65557) :])
    i = tail.rfind(EOCD)
    if i < 0:
        raise ValueError("no zip end record")
    return len(buf) - len(tail) + i


def _zip64_values(extra: bytes, *wanted: bool) -> list[int]:
    q = 0
    while q + 4 <= len(extra):
        hid, size = struct.unpack_from("<HH", extra, q)
        if hid == 1:
            return list(struct.unpack_from("<" + "Q" * sum(wanted), extra, q + 4))
        q += 4 + size
    raise ValueError("zip64 extra field missing")
