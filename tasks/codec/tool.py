"""Compress and decompress whole checkpoint directories (any DCP checkpoint).

``compress_dir`` picks a codec per file: ``bytegroup`` for shards that the
checkpoint's ``.metadata`` maps to float tensors, plain ``zstd`` for other files
(``.metadata`` itself, integer-only shards), and a verbatim copy for small files
that are not DCP's (``manifest.json`` stays readable with ``cat``). It records what
it did in ``ckptflow-codec.json``, written last: a destination without that index
is an unfinished one.

``decompress_dir`` needs nothing but that index. Every file is written under a
temporary name and renamed only after both digests (stored and raw) match the
index, so a damaged archive never leaves a plausible-looking file behind.

Both write into a hidden sibling of the destination (``.<name>.part-*``) renamed to it
at the end: the destination appears whole or not at all, so a run that failed half-way
(a full disk, a damaged source) leaves nothing that refuses the next run. Sources are
read through ``trainer.safeopen`` (regular files only), and a stored name resolves
inside the source (a symlinked member is refused, never followed out of it).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from dataclasses import asdict, dataclass, field

import ckptflow.trainer.format.dcpmeta  # noqa: F401  (imports torch now, not inside the timed work)
from ckptflow.tasks.codec import DtypeMap, dtype_maps_for_checkpoint, get_codec
from ckptflow.trainer import fsutil
from ckptflow.trainer.errors import CheckpointNotFoundError, ConfigError, IntegrityError
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.manifest import FORMAT as MANIFEST_FORMAT
from ckptflow.trainer.format.manifest import MAX_MANIFEST_BYTES, Manifest, read_manifest
from ckptflow.trainer.safeopen import file_kind, open_regular, read_small
from ckptflow.trainer.verify import resolve_member

INDEX = "ckptflow-codec.json"
INDEX_FORMAT = "ckptflow.codec-index"
INDEX_VERSION = 1
VERBATIM_MAX = 64 << 10  # smaller non-DCP files are copied as they are
MAX_INDEX_BYTES = 64 << 20
_PART = ".part"


@dataclass(slots=True)
class FileReport:
    name: str
    codec: str
    stored_name: str
    raw_bytes: int
    stored_bytes: int
    raw_checksum: str
    stored_checksum: str
    seconds: float = 0.0
    grouped_bytes: int = 0
    """Bytes the dtype map marked as float tensor data (0 without a map)."""


@dataclass(slots=True)
class DirReport:
    src: str
    dst: str
    files: list[FileReport] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def raw_bytes(self) -> int:
        return sum(f.raw_bytes for f in self.files)

    @property
    def stored_bytes(self) -> int:
        return sum(f.stored_bytes for f in self.files)

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def mb_per_s(self) -> float:
        return self.raw_bytes / max(self.seconds, 1e-9) / 1e6

    def to_json(self) -> dict:
        return {
            "src": self.src,
            "dst": self.dst,
            "raw_bytes": self.raw_bytes,
            "stored_bytes": self.stored_bytes,
            "ratio": round(self.ratio, 4),
            "seconds": round(self.seconds, 4),
            "mb_per_s": round(self.mb_per_s(), 1),
            "files": [asdict(f) for f in self.files],
        }


def compress_dir(
    src_dir: str, dst_dir: str, codec: str = "bytegroup", level: int | None = None, threads: int | None = None
) -> DirReport:
    """Compress every file of ``src_dir`` into the new directory ``dst_dir``. A ckptflow checkpoint (it has a
    manifest) is held to it: every listed file present with its size before any work, ``.metadata``'s digest
    checked before it is parsed, every listed file's raw digest compared as it is compressed."""
    t0 = time.perf_counter()
    get_codec(codec)  # unknown names fail before any work
    names = _list_files(src_dir)
    _check_dst(src_dir, dst_dir)
    manifest = _source_manifest(src_dir)
    if manifest is not None:
        _check_against(src_dir, manifest, codec)
    maps: dict[str, DtypeMap] = dtype_maps_for_checkpoint(src_dir) if codec == "bytegroup" else {}
    report = DirReport(src_dir, dst_dir)
    with _Destination(dst_dir) as part:
        _compress_files(src_dir, part, names, codec, level, threads, maps, report, manifest)
    report.seconds = time.perf_counter() - t0
    return report


def _compress_files(
    src_dir: str,
    dst_dir: str,
    names: list[str],
    codec: str,
    level: int | None,
    threads: int | None,
    maps: dict[str, DtypeMap],
    report: DirReport,
    manifest: Manifest | None,
) -> None:
    for name in names:
        src_path = os.path.join(src_dir, name)
        chosen = _choose(name, os.path.getsize(src_path), codec, name in maps)
        c = get_codec(chosen)
        stored_name = name + c.suffix
        dmap = maps.get(name)
        with open_regular(src_path, what="a checkpoint to compress") as src, _Output(dst_dir, stored_name) as dst:
            st = c.compress(
                src, dst.f, level=level if chosen == codec else None, threads=threads, dtype_map=dmap, name=src_path
            )
            if manifest is not None and name in manifest.files:
                want = manifest.files[name]
                if (st.raw_bytes, st.raw_checksum) != (want.size, want.checksum):
                    raise IntegrityError(
                        f"{src_path}: {st.raw_bytes} B, xxh3 {st.raw_checksum}, but the manifest says {want.size} B, "
                        f"{want.checksum}: the checkpoint is damaged; nothing was written (restore it from another "
                        "tier, then compress that)",
                        path=src_path,
                    )
        report.files.append(
            FileReport(
                name,
                chosen,
                stored_name,
                st.raw_bytes,
                st.stored_bytes,
                st.raw_checksum,
                st.stored_checksum,
                st.seconds,
                dmap.grouped_bytes if dmap else 0,
            )
        )
    index = {"format": INDEX_FORMAT, "format_version": INDEX_VERSION, "files": [asdict(f) for f in report.files]}
    fsutil.replace_atomic(os.path.join(dst_dir, INDEX), (json.dumps(index, indent=1) + "\n").encode())


def _source_manifest(src_dir: str) -> Manifest | None:
    """The manifest of a ckptflow checkpoint in ``src_dir``; None for any other DCP directory (no
    ``manifest.json``, or one of another tool's format). A ckptflow manifest that does not read (damaged,
    unsigned where a key is set, not a regular file, far too large) refuses the directory."""
    path = os.path.join(src_dir, layout.MANIFEST)
    if not os.path.lexists(path):
        return None
    try:
        head = json.loads(read_small(path, MAX_MANIFEST_BYTES))
        if isinstance(head, dict) and head.get("format") != MANIFEST_FORMAT:
            return None  # another tool's manifest: not a ckptflow checkpoint, the restricted unpickler guards
    except (OSError, ValueError):  # unreadable as JSON (or not a regular file, too large): read_manifest says why
        pass
    try:
        return read_manifest(src_dir)
    except IntegrityError as e:
        raise IntegrityError(
            f"{src_dir}: holds a ckptflow manifest that does not read ({e}); the checkpoint is damaged, refusing to "
            "compress it",
            path=path,
        ) from None


def _check_against(src_dir: str, manifest: Manifest, codec: str) -> None:
    """Before any work: every listed file present, regular, with its size (a truncated, swapped or sparse
    file refuses the directory instead of costing a full read); for ``bytegroup``, which parses
    ``.metadata``, its digest too (nothing is parsed before its checksum matches)."""
    from ckptflow.trainer.verify import check_file, check_present

    for name, e in sorted(manifest.files.items()):
        problem = check_present(src_dir, name, e.size)
        if problem is None and codec == "bytegroup" and name == layout.DCP_METADATA:
            problem = check_file(src_dir, name, e.size, e.checksum)
        if problem is not None:
            raise IntegrityError(
                f"{problem}; refusing to parse or compress a damaged checkpoint (restore this step from another tier)",
                path=problem.path,
            )
    if codec == "bytegroup" and layout.DCP_METADATA not in manifest.files:
        raise IntegrityError(
            f"{src_dir}/{layout.MANIFEST}: does not list {layout.DCP_METADATA}; not a complete ckptflow checkpoint",
            path=src_dir,
        )


def decompress_dir(src_dir: str, dst_dir: str, threads: int | None = None) -> DirReport:
    """Restore every file listed in ``src_dir``'s codec index into ``dst_dir``, byte for byte."""
    t0 = time.perf_counter()
    entries = _read_index(src_dir)
    _check_dst(src_dir, dst_dir)
    report = DirReport(src_dir, dst_dir)
    with _Destination(dst_dir) as part:
        for e in entries:
            report.files.append(_decompress_file(src_dir, part, e, threads))
    report.seconds = time.perf_counter() - t0
    return report


def _decompress_file(src_dir: str, dst_dir: str, e: FileReport, threads: int | None) -> FileReport:
    src_path = resolve_member(src_dir, e.stored_name)  # a symlink out of the source is refused, not followed
    if not os.path.lexists(src_path):
        raise CheckpointNotFoundError(
            f"{src_path}: listed in {INDEX} but missing; the compressed checkpoint is incomplete"
        )
    with open_regular(src_path, what="a compressed checkpoint") as src, _Output(dst_dir, e.name) as dst:
        st = get_codec(e.codec).decompress(src, dst.f, threads=threads, name=src_path)
        if st.stored_checksum != e.stored_checksum or st.raw_checksum != e.raw_checksum or st.raw_bytes != e.raw_bytes:
            raise IntegrityError(
                f"{src_path}: digests do not match {INDEX} (stored {st.stored_checksum} vs "
                f"{e.stored_checksum}, raw {st.raw_checksum} vs {e.raw_checksum}); the "
                "file is damaged or was replaced, restore it from another copy",
                path=src_path,
            )
    return FileReport(
        e.name, e.codec, e.stored_name, st.raw_bytes, st.stored_bytes, st.raw_checksum, st.stored_checksum, st.seconds
    )


def _choose(name: str, size: int, codec: str, has_map: bool) -> str:
    is_dcp = name == layout.DCP_METADATA or name.endswith(".distcp")
    if codec == "none" or (not is_dcp and size <= VERBATIM_MAX):
        return "none"
    if codec == "bytegroup" and not has_map:
        return "zstd"
    return codec


class _Output:
    """A destination file written as ``<name>.part`` and renamed only on success."""

    def __init__(self, dst_dir: str, name: str) -> None:
        self.path = os.path.join(dst_dir, name)
        self.tmp = self.path + _PART
        os.makedirs(os.path.dirname(self.path), exist_ok=True)

    def __enter__(self) -> _Output:
        self.f = open(self.tmp, "wb")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.f.flush()
                os.fsync(self.f.fileno())
        finally:
            self.f.close()
        if exc_type is None:
            os.replace(self.tmp, self.path)
        else:
            try:
                os.unlink(self.tmp)
            except OSError:
                pass


def _list_files(src_dir: str) -> list[str]:
    if not os.path.isdir(src_dir):
        raise CheckpointNotFoundError(f"{src_dir}: no such checkpoint directory")
    out = []
    for root, dirs, files in os.walk(src_dir):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(root, f)
            st = os.lstat(p)
            if not stat.S_ISREG(st.st_mode):  # never follow a link out of it, never open a FIFO or device
                raise ConfigError(f"{p}: is {file_kind(st.st_mode)}; checkpoints hold regular files only")
            out.append(os.path.relpath(p, src_dir).replace(os.sep, "/"))
    return out


def _check_dst(src_dir: str, dst_dir: str) -> None:
    s, d = os.path.realpath(src_dir), os.path.realpath(dst_dir)
    if d == s or d.startswith(s + os.sep):
        raise ConfigError(f"destination {dst_dir} is inside the source {src_dir}; choose a directory outside it")
    if os.path.lexists(dst_dir) and (os.path.islink(dst_dir) or not os.path.isdir(dst_dir) or os.listdir(dst_dir)):
        raise ConfigError(
            f"destination {dst_dir} exists and is not empty (or not a directory); choose a new or empty one"
        )


class _Destination:
    """The destination written as a hidden sibling and renamed into place on success; removed on failure."""

    def __init__(self, dst_dir: str) -> None:
        self.dst = os.path.abspath(dst_dir)
        self.part = fsutil.make_sibling_dir(self.dst)

    def __enter__(self) -> str:
        return self.part

    def __exit__(self, exc_type, exc, tb) -> None:  # noqa: ANN001 - the context-manager protocol
        if exc_type is not None:
            shutil.rmtree(self.part, ignore_errors=True)
            return
        try:
            if os.path.isdir(self.dst) and not os.path.islink(self.dst):
                os.rmdir(self.dst)  # empty (checked before the work); rename needs the name free
            fsutil.rename_durable(self.part, self.dst)
        except BaseException:
            shutil.rmtree(self.part, ignore_errors=True)
            raise


def _read_index(src_dir: str) -> list[FileReport]:
    path = os.path.join(src_dir, INDEX)
    if not os.path.lexists(path):
        raise CheckpointNotFoundError(
            f"{path}: no codec index; {src_dir} is not a directory made by `ckptflow "
            "compress`, or its compression did not finish"
        )
    data = read_small(path, MAX_INDEX_BYTES + 1, what="a compressed checkpoint")
    try:
        if len(data) > MAX_INDEX_BYTES:
            raise ValueError(f"larger than {MAX_INDEX_BYTES} bytes")
        d = json.loads(data)
        if d.get("format") != INDEX_FORMAT or d.get("format_version") != INDEX_VERSION:
            raise ValueError(f"format {d.get('format')!r} version {d.get('format_version')!r}")
        entries = []
        for e in d["files"]:
            fr = FileReport(**e)
            layout.check_member_name(fr.name)
            layout.check_member_name(fr.stored_name)
            get_codec(fr.codec)
            entries.append(fr)
    except IntegrityError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise IntegrityError(
            f"{path}: codec index is malformed ({e}); the compressed checkpoint is damaged", path=path
        ) from None
    return entries
