"""The zip container ``torch.save`` writes, read without ``zipfile`` (which would re-check CRCs
and copy), for the two places that touch it byte by byte: the reader (``reader.py``: where is a
tensor's data) and the writer (``fastwrite.py``: where are the CRC fields of a template)."""

from __future__ import annotations

import struct
from typing import NamedTuple

EOCD = b"PK\x05\x06"
CEN = b"PK\x01\x02"
LOC = b"PK\x03\x04"


class Entry(NamedTuple):
    data: int
    """Offset of the entry's first data byte."""
    size: int
    local: int
    """Offset of its local header (CRC at +14)."""
    central: int
    """Offset of its central directory record (CRC at +16)."""


def entries(buf: memoryview | bytes) -> dict[str, Entry]:
    """Every *stored* (uncompressed) entry of the zip in ``buf``, by name; ValueError if it is not one."""
    tail = bytes(buf[max(0, len(buf) - 65557) :])
    i = tail.rfind(EOCD)
    if i < 0:
        raise ValueError("no zip end record")
    eocd = len(buf) - len(tail) + i
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
        if bytes(buf[p : p + 4]) != CEN:
            raise ValueError("bad central directory entry")
        (method,) = struct.unpack_from("<H", buf, p + 10)
        csize, usize = struct.unpack_from("<II", buf, p + 20)
        nlen, xlen, clen = struct.unpack_from("<HHH", buf, p + 28)
        (hoff,) = struct.unpack_from("<I", buf, p + 42)
        name = bytes(buf[p + 46 : p + 46 + nlen]).decode()
        extra = bytes(buf[p + 46 + nlen : p + 46 + nlen + xlen])
        if 0xFFFFFFFF in (csize, usize, hoff):
            vals = _zip64_values(extra, usize == 0xFFFFFFFF, csize == 0xFFFFFFFF, hoff == 0xFFFFFFFF)
            usize, csize, hoff = (
                vals.pop(0) if usize == 0xFFFFFFFF else usize,
                vals.pop(0) if csize == 0xFFFFFFFF else csize,
                vals.pop(0) if hoff == 0xFFFFFFFF else hoff,
            )
        central = p
        p += 46 + nlen + xlen + clen
        if method != 0 or csize != usize:
            raise ValueError(f"{name} is compressed")
        if bytes(buf[hoff : hoff + 4]) != LOC:
            raise ValueError("bad local header")
        lnlen, lxlen = struct.unpack_from("<HH", buf, hoff + 26)
        start = hoff + 30 + lnlen + lxlen
        if start + usize > len(buf):
            raise ValueError(f"{name} runs past the item")
        out[name] = Entry(start, usize, hoff, central)
    return out


def _zip64_values(extra: bytes, *wanted: bool) -> list[int]:
    q = 0
    while q + 4 <= len(extra):
        hid, size = struct.unpack_from("<HH", extra, q)
        if hid == 1:
            return list(struct.unpack_from("<" + "Q" * sum(wanted), extra, q + 4))
        q += 4 + size
    raise ValueError("zip64 extra field missing")
