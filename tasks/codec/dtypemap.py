"""Which byte ranges of a shard file are tensor data of which dtype.

A :class:`DtypeMap` is a *hint* to the compressor: it decides only how bytes are
grouped, never what is stored, so a wrong or stale map costs ratio, not data (the
container records every segment it made). That is why building one may skip
anything unusual — an unknown record layout, a transformed item — and fall back to
plain bytes.

Where the ranges come from, for a DCP checkpoint directory:

* ``.metadata`` (read with the restricted unpickler of :mod:`trainer.dcpmeta`)
  maps each tensor chunk to ``(file, offset, length)`` and its tensor to a dtype;
* with DCP's default ``torch.save`` serialization that range is a whole zip
  archive (stored, not deflated); the raw tensor bytes are its ``…/data/<n>``
  members. We find them from the archive's central directory and local headers —
  a few small reads per tensor, nothing unpickled;
* ``*.safetensors`` files (Hugging Face / DCP's safetensors writers) describe
  themselves in a JSON header, read directly.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import BinaryIO

from ckptflow.tasks.codec.grouping import PLAIN, kind_for_dtype
from ckptflow.trainer.errors import ConfigError
from ckptflow.trainer.format import layout
from ckptflow.trainer.safeopen import open_regular

_DATA_MEMBER = re.compile(r"(^|/)data/\d+$")
_EOCD = b"PK\x05\x06"
_EOCD64_LOCATOR = b"PK\x06\x07"
_EOCD64 = b"PK\x06\x06"
_CDIR = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"
_TAIL_READ = 64 << 10  # EOCD (22 bytes) plus a comment; torch writes no comment
MAX_SAFETENSORS_HEADER = 100 << 20


@dataclass(frozen=True, slots=True)
class Range:
    offset: int
    length: int
    dtype: str
    """Dtype name as torch prints it, without ``torch.`` (``"bfloat16"``)."""

    @property
    def kind(self) -> int:
        return kind_for_dtype(self.dtype)


@dataclass(frozen=True, slots=True)
class DtypeMap:
    """Sorted, non-overlapping tensor-data ranges of one file. Other bytes are plain."""

    ranges: tuple[Range, ...]

    def __post_init__(self) -> None:
        end = 0
        for r in self.ranges:
            if r.offset < end or r.length < 0:
                raise ConfigError(f"dtype map ranges overlap or are unsorted at offset {r.offset} (length {r.length})")
            end = r.offset + r.length

    @classmethod
    def from_ranges(cls, ranges: Iterable[Range]) -> DtypeMap:
        """Sort, drop empty and ungrouped ranges; overlapping ranges are a caller bug."""
        rs = sorted((r for r in ranges if r.length > 0 and r.kind != PLAIN), key=lambda r: r.offset)
        return cls(tuple(rs))

    @property
    def grouped_bytes(self) -> int:
        return sum(r.length for r in self.ranges)

    def to_json(self) -> list:
        return [[r.offset, r.length, r.dtype] for r in self.ranges]

    @classmethod
    def from_json(cls, data: list) -> DtypeMap:
        return cls.from_ranges(Range(int(o), int(n), str(d)) for o, n, d in data)


def dtype_maps_for_checkpoint(ckpt_dir: str) -> dict[str, DtypeMap]:
    """Shard file name (relative to ``ckpt_dir``) -> its :class:`DtypeMap`.

    Files with no groupable tensor (ints only, non-tensor items) are left out; so
    is everything when the directory has no ``.metadata`` and no safetensors file.
    Local paths and fsspec URLs both work.
    """
    from ckptflow.trainer.format.dcpmeta import read_dcp_metadata

    maps: dict[str, DtypeMap] = {}
    if _exists(layout.join(ckpt_dir, layout.DCP_METADATA)):
        md = read_dcp_metadata(ckpt_dir)
        for name, records in _tensor_records(md).items():
            # a name from .metadata: the checkpoint's own file or nothing (no "..", no absolute path)
            with _open(layout.join(ckpt_dir, layout.check_member_name(name))) as f:
                ranges = [r for off, n, dt in records for r in _torch_save_data(f, off, n, dt)]
            m = DtypeMap.from_ranges(_drop_overlaps(ranges))
            if m.ranges:
                maps[name] = m
    for name in _list(ckpt_dir):
        if name.endswith(".safetensors") and name not in maps:
            with _open(layout.join(ckpt_dir, name)) as f:
                m = safetensors_dtype_map(f)
            if m.ranges:
                maps[name] = m
    return maps


def _tensor_records(md) -> dict[str, list[tuple[int, int, str]]]:
    """(offset, length, dtype) of every stored tensor chunk, per file, from DCP metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in (md.storage_data or {}).items():
        tmd = md.state_dict_metadata.get(getattr(index, "fqn", None))
        if not isinstance(tmd, TensorStorageMetadata):
            continue
        if getattr(info, "transform_descriptors", None):  # DCP extension (e.g. its own zstd)
            continue
        path, off, n = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        if not isinstance(path, str) or not isinstance(off, int) or not isinstance(n, int):
            continue
        dtype = str(tmd.properties.dtype).removeprefix("torch.")
        if kind_for_dtype(dtype) == PLAIN:
            continue
        out.setdefault(layout.check_member_name(path), []).append((off, n, dtype))
    return out


def _torch_save_data(f: BinaryIO, off: int, n: int, dtype: str) -> list[Range]:
    """Raw-data ranges inside one torch.save zip record at [off, off+n); [] if not one."""
    try:
        tail_len = min(n, _TAIL_READ)
        f.seek(off + n - tail_len)
        tail = f.read(tail_len)
        at = tail.rfind(_EOCD)
        if at < 0 or len(tail) - at < 22:
            return []
        _, _, _, count, cd_size, cd_off, _ = struct.unpack_from("<HHHHIIH", tail, at + 4)
        if (
            (count == 0xFFFF or cd_size == 0xFFFFFFFF or cd_off == 0xFFFFFFFF)
            and at >= 20
            and tail[at - 20 : at - 16] == _EOCD64_LOCATOR
        ):
            (eocd64_off,) = struct.unpack_from("<Q", tail, at - 20 + 8)
            f.seek(off + eocd64_off)
            z = f.read(56)
            if z[:4] != _EOCD64:
                return []
            count, cd_size, cd_off = struct.unpack_from("<QQQ", z, 32)
        if cd_off + cd_size > n:
            return []
        f.seek(off + cd_off)
        cd = f.read(cd_size)
        out = []
        p = 0
        for _ in range(count):
            if cd[p : p + 4] != _CDIR:
                return []
            method, csize, usize, nlen, elen, clen = (
                struct.unpack_from("<H", cd, p + 10)[0],
                *struct.unpack_from("<IIHHH", cd, p + 20),
            )
            (local,) = struct.unpack_from("<I", cd, p + 42)
            name = cd[p + 46 : p + 46 + nlen].decode("utf-8", "replace")
            extra = cd[p + 46 + nlen : p + 46 + nlen + elen]
            p += 46 + nlen + elen + clen
            if not _DATA_MEMBER.search(name):
                continue
            csize, local = _zip64_sizes(extra, usize, csize, local)
            if method != 0:  # deflated: its bytes are not the tensor's
                continue
            f.seek(off + local)
            lh = f.read(30)
            if lh[:4] != _LOCAL:
                return []
            lnlen, lelen = struct.unpack_from("<HH", lh, 26)
            start = local + 30 + lnlen + lelen
            if start + csize > n:
                return []
            out.append(Range(off + start, csize, dtype))
        return out
    except (struct.error, OSError, ValueError):
        return []  # not the layout we know: the record stays plain bytes


def _zip64_sizes(extra: bytes, usize: int, csize: int, local: int) -> tuple[int, int]:
    """Compressed size and local header offset, from the zip64 extra field where needed."""
    p = 0
    while p + 4 <= len(extra):
        hid, hlen = struct.unpack_from("<HH", extra, p)
        if hid == 0x0001:
            vals = list(struct.unpack_from(f"<{hlen // 8}Q", extra, p + 4))
            if usize == 0xFFFFFFFF and vals:
                vals.pop(0)
            if csize == 0xFFFFFFFF and vals:
                csize = vals.pop(0)
            if local == 0xFFFFFFFF and vals:
                local = vals.pop(0)
            break
        p += 4 + hlen
    return csize, local


def _drop_overlaps(ranges: list[Range]) -> list[Range]:
    """Keep the first of any overlapping ranges (a malformed metadata must not crash us)."""
    out: list[Range] = []
    end = -1
    for r in sorted(ranges, key=lambda r: r.offset):
        if r.offset >= end:
            out.append(r)
            end = r.offset + r.length
    return out


def safetensors_dtype_map(f: BinaryIO) -> DtypeMap:
    """Tensor ranges of a safetensors file, from its own JSON header ([] if not one)."""
    _ST = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
    try:
        f.seek(0)
        (hlen,) = struct.unpack("<Q", f.read(8))
        if hlen > MAX_SAFETENSORS_HEADER:
            return DtypeMap(())
        header = json.loads(f.read(hlen))
        base = 8 + hlen
        ranges = []
        for key, v in header.items():
            if key == "__metadata__" or not isinstance(v, dict) or v.get("dtype") not in _ST:
                continue
            a, b = v["data_offsets"]
            ranges.append(Range(base + int(a), int(b) - int(a), _ST[v["dtype"]]))
        return DtypeMap.from_ranges(_drop_overlaps(ranges))
    except (struct.error, OSError, ValueError, TypeError, KeyError, AttributeError):
        return DtypeMap(())


def _exists(path: str) -> bool:
    if "://" in path:
        import fsspec

        fs, p = fsspec.core.url_to_fs(path)
        return fs.exists(p)
    return os.path.exists(path)


def _list(path: str) -> list[str]:
    if "://" in path:
        import fsspec

        fs, p = fsspec.core.url_to_fs(path)
        return sorted(x.rstrip("/").rsplit("/", 1)[-1] for x in fs.ls(p, detail=False))
    return sorted(os.listdir(path))


def _open(path: str) -> BinaryIO:
    if "://" in path:
        import fsspec

        return fsspec.open(path, "rb").open()
    return open_regular(path)  # a FIFO or device here is refused, never opened
