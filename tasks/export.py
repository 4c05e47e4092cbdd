"""A checkpoint's model weights as Hugging Face-style sharded safetensors.

    ckptflow export STEP_DIR OUT [--dtype bf16] [--shard-mb N] [--prefix model.]

What OUT holds once it exists (it is staged in ``OUT.tmp`` and renamed: never half there):

    model-00001-of-00003.safetensors ...   the tensors named ``prefix...``, the prefix stripped
    model.safetensors.index.json           ``weight_map`` and ``total_size``, as transformers reads them
    export.json                            source run/step, dtype, every file's size and digest

How, and why so:

* **Any world size.** Tensors are read with DCP's own load into whole (unsharded) tensors, so
  DCP reassembles the chunks every rank saved (FSDP, TP or replicated alike). It reads through
  the verifying reader: every byte used is checked against the checkpoint's manifest first.
* **Memory bounded by the shard, not the model.** Tensors are grouped into shard files of at
  most ``shard_mb`` (a tensor bigger than that is a shard of its own, as transformers does).
  A file is streamed: its header first (names, dtypes and shapes are known from DCP's
  metadata), then the tensors, loaded at most ``shard_mb`` of them *as saved* at a time, each
  cast, digested and written, then dropped. The library's own writer would need the whole
  shard in memory, and copy every tensor to ``bytes`` on top.
* **Checked as written.** Each file is read back through safetensors' own parser, one tensor at
  a time, and every name, dtype, shape and digest compared with what was written (after the
  cast, for a dtype change): a writer bug or a bad disk fails the export, naming the tensor,
  before anything is committed.
* A floating-point tensor that becomes ``inf`` in ``fp16`` where it was finite is refused (the
  export would load and give wrong logits).

Nothing here imports Prefect: the lifecycle's ``export`` stage (``tasks/stages.py``) and the CLI
both call :func:`export_dir`.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import struct
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ckptflow.trainer.errors import CkptflowError, ConfigError, IntegrityError
from ckptflow.trainer.format import layout
from ckptflow.trainer.fsutil import fsync_dir, rename_durable, write_durable
from ckptflow.trainer.safeopen import read_small

__all__ = ["EXPORT_RECORD", "INDEX", "ExportError", "ExportResult", "export_dir", "export_url", "upload_export"]

INDEX = "model.safetensors.index.json"
EXPORT_RECORD = "export.json"
EXPORTS_DIR = "_exports"
"""Beside the run's steps on warm and cold: ``<run>/_exports/step_N/``."""


class ExportError(CkptflowError, ValueError):
    """The checkpoint cannot be exported as asked (nothing was written to OUT)."""


@dataclass(slots=True)
class ExportResult:
    location: str
    """The committed export folder (or URL, once uploaded)."""
    step: int | None
    dtype: str
    tensors: int
    shards: list[str]
    bytes: int
    """Bytes of tensor data written (after the cast)."""
    bytes_read: int
    """Bytes of tensor data read from the checkpoint."""
    seconds: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# safetensors' dtype names (the format's spec)
_ST = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


def _out_dtype(src: Any, dtype: str) -> Any:
    import torch

    if dtype == "as_saved" or not src.is_floating_point:
        return src
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]


def _load_key_map(spec: str | None) -> Callable[[str], str | None]:
    if spec is None:
        return lambda name: name
    mod, _, fn = spec.partition(":")
    try:
        return getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"export.key_map = {spec!r}: cannot import it ({e}); give 'module:function'") from None


@dataclass(frozen=True, slots=True)
class _Entry:
    fqn: str
    """The name in the checkpoint."""
    name: str
    """The name in the export."""
    shape: tuple[int, ...]
    src: Any
    out: Any

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.out.itemsize


def plan(metadata: Any, *, prefix: str, dtype: str, shard_bytes: int, key_map: str | None = None) -> list[list[_Entry]]:
    """The shards, in the checkpoint's order: tensors named ``prefix...``, mapped and grouped."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    mapper = _load_key_map(key_map)
    entries: list[_Entry] = []
    names: dict[str, str] = {}
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    for fqn, item in tensors.items():
        if not fqn.startswith(prefix):
            continue
        name = mapper(fqn[len(prefix) :])
        if name is None:
            continue
        if name in names:
            raise ExportError(f"{names[name]} and {fqn} both map to {name!r}; fix export.key_map")
        names[name] = fqn
        src = item.properties.dtype
        out = _out_dtype(src, dtype)
        if str(out).removeprefix("torch.") not in _ST:
            raise ExportError(f"{fqn}: dtype {out} has no safetensors name; leave it out with export.key_map")
        entries.append(_Entry(fqn, name, tuple(item.size), src, out))
    if not entries:
        tops = sorted({k.split(".", 1)[0] + "." for k in tensors})
        raise ExportError(
            f"no tensor in the checkpoint is named {prefix!r}...; its tensors start with {', '.join(tops[:8])} — "
            "give the model's prefix (--prefix, or [export] prefix; '' for all)"
        )
    shards: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def _header(shard: list[_Entry]) -> bytes:
    """safetensors' header for the shard's tensors in file order, padded to 8 bytes."""
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for e in shard:
        meta[e.name] = {
            "dtype": _ST[str(e.out).removeprefix("torch.")],
            "shape": list(e.shape),
            "data_offsets": [off, off + e.nbytes],
        }
        off += e.nbytes
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _bytes_of(t: Any) -> memoryview:
    import torch

    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _batches(shard: list[_Entry], limit: int) -> list[list[_Entry]]:
    """The shard's tensors in loads of at most ``limit`` bytes *as saved* (one tensor at least):
    what is in memory at once, whatever the cast does to the size on disk."""
    out: list[list[_Entry]] = [[]]
    size = 0
    for e in shard:
        n = e.nbytes // e.out.itemsize * e.src.itemsize
        if out[-1] and size + n > limit:
            out.append([])
            size = 0
        out[-1].append(e)
        size += n
    return out


def _write_shard(path: str, shard: list[_Entry], load: Callable[[list[_Entry]], dict[str, Any]], limit: int) -> dict:
    """Stream one shard file: the header (known from the metadata), then each tensor loaded,
    cast and written in turn, a load of at most ``limit`` bytes at a time. Returns each
    tensor's digest as written, for the read-back check."""
    import torch

    from ckptflow.trainer.format.checksum import hash_bytes

    digests: dict[str, str] = {}
    with open(path, "wb") as f:
        f.write(_header(shard))
        for batch in _batches(shard, limit):
            state = load(batch)
            for e in batch:
                t = state.pop(e.fqn)
                c = t.to(e.out) if e.out != e.src else t
                if e.out == torch.float16 and not bool(torch.isfinite(c).eq(torch.isfinite(t)).all()):
                    raise ExportError(f"{e.fqn}: values beyond fp16's range become inf; export as bf16 or as saved")
                del t
                if c.numel():
                    data = _bytes_of(c)
                    digests[e.name] = hash_bytes(data)
                    f.write(data)
                else:
                    digests[e.name] = hash_bytes(b"")
                del c
        f.flush()
        os.fsync(f.fileno())
    return digests


def _check_shard(path: str, shard: list[_Entry], digests: dict[str, str]) -> None:
    """Read the file back with safetensors' own parser, one tensor at a time: every name, dtype,
    shape and byte as written."""
    from safetensors import safe_open

    from ckptflow.trainer.format.checksum import hash_bytes

    with safe_open(path, framework="pt") as f:
        got, want = set(f.keys()), {e.name for e in shard}
        if got != want:
            raise ExportError(f"{path}: safetensors reads {sorted(got ^ want)[:4]} differently from what was written")
        for e in shard:
            back = f.get_tensor(e.name)
            if (
                back.dtype != e.out
                or tuple(back.shape) != e.shape
                or hash_bytes(_bytes_of(back) if back.numel() else b"") != digests[e.name]
            ):
                raise ExportError(f"{path}: tensor {e.name} reads back unlike what was written; nothing committed")
            del back


class _Arena:
    """One buffer the loads go into, kept from load to load: fresh tensors for every load cost a
    page fault per 4 KiB (a third of the load's time, measured with ``bench_export``)."""

    def __init__(self) -> None:
        self.buf: Any = None

    def tensors(self, batch: list[_Entry]) -> dict[str, Any]:
        import torch

        sizes = [e.nbytes // e.out.itemsize * e.src.itemsize for e in batch]
        need = sum(-(-n // 64) * 64 for n in sizes)  # 64-byte aligned views
        if self.buf is None or self.buf.numel() < need:
            self.buf = None
            self.buf = torch.empty(need, dtype=torch.uint8)
        out, off = {}, 0
        for e, n in zip(batch, sizes, strict=True):
            out[e.fqn] = self.buf[off : off + n].view(e.src).view(e.shape)
            off += -(-n // 64) * 64
        return out


def _load_shard(ckpt_dir: str, manifest: Any, shard: list[_Entry], arena: _Arena) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ckptflow.trainer.dcp.planner import SafeLoadPlanner
    from ckptflow.trainer.dcp.reader import open_reader

    state = arena.tensors(shard)
    reader = open_reader(ckpt_dir, manifest)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            # One process reads every chunk; the stage and the CLI never have a process group.
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=not dist.is_initialized())
    except dcp.CheckpointException as e:  # a BaseException: its first rank's error says what failed
        causes = [exc for exc, _trace in e.failures.values()]  # (exception, traceback) per rank
        if causes and isinstance(causes[0], CkptflowError):  # a digest mismatch names its file
            raise causes[0] from None
        first = f"{type(causes[0]).__name__}: {causes[0]}" if causes else str(e).splitlines()[0]
        raise ExportError(f"{ckpt_dir}: DCP could not load {len(shard)} tensor(s): {first[:500]}") from None
    finally:
        reader.close()
    return state


def _check_out(ckpt_dir: str, out: str) -> None:
    """OUT must not change a checkpoint: never inside the one it exports (a committed folder is never
    modified), never named as a step or its staging folder (beside a run's steps it would be a phantom
    checkpoint counted by retention, and its ``.tmp`` someone else's) except as the lifecycle's own
    ``_exports/step_N``."""
    src, dst = os.path.realpath(ckpt_dir), os.path.realpath(out)
    if dst == src or dst.startswith(src + os.sep):
        raise ExportError(
            f"{out} is inside the checkpoint {ckpt_dir} it exports; a committed checkpoint is never "
            "modified: give a folder outside it"
        )
    base, parent = os.path.basename(dst), os.path.basename(os.path.dirname(dst))
    stepish = layout.parse_step(base) is not None or layout.parse_tmp_step(base) is not None
    if stepish and parent != EXPORTS_DIR:
        raise ExportError(
            f"{out} is named like a checkpoint ({base}); beside a run's steps it would count as one: "
            "give the export another name"
        )


def export_dir(
    ckpt_dir: str,
    out: str,
    *,
    dtype: str = "as_saved",
    shard_mb: float = 5000,
    prefix: str = "model.",
    key_map: str | None = None,
    manifest_key: bytes | None = None,
) -> ExportResult:
    """Export the local checkpoint folder ``ckpt_dir`` (its ``manifest.json`` and DCP files) to
    the new folder ``out`` (module docstring). Raises :class:`ExportError`, ``IntegrityError``
    (naming the file) or ``ConfigError``; ``out`` then does not exist."""

    from ckptflow.trainer.format.dcpmeta import read_dcp_metadata
    from ckptflow.trainer.format.manifest import read_manifest, signing_key

    t0 = time.perf_counter()
    if os.path.lexists(out):
        raise ExportError(f"{out} already exists; an export is never replaced — give a new folder or remove it")
    _check_out(ckpt_dir, out)
    if os.path.exists(os.path.join(ckpt_dir, layout.TIER_MANIFEST)):
        raise ExportError(
            f"{ckpt_dir} is a tier's stored copy (it has {layout.TIER_MANIFEST}; its files may be encoded): "
            "export the hot copy, or fetch it first (ckptflow restore)"
        )
    manifest = read_manifest(ckpt_dir, key=manifest_key if manifest_key is not None else signing_key())
    if layout.DCP_METADATA not in manifest.files:
        raise ExportError(
            f"{ckpt_dir}: not a DCP checkpoint (no {layout.DCP_METADATA} in its manifest); nothing to export"
        )
    try:
        md = read_dcp_metadata(ckpt_dir)
    except FileNotFoundError:  # listed by the manifest (checked above), gone: damage, not a path given wrong
        path = os.path.join(ckpt_dir, layout.DCP_METADATA)
        raise IntegrityError(
            f"{path}: missing although the manifest lists it; the checkpoint is damaged", path=path
        ) from None
    shard_bytes = max(1, int(shard_mb * 2**20))
    shards = plan(md, prefix=prefix, dtype=dtype, shard_bytes=shard_bytes, key_map=key_map)
    tmp = out.rstrip("/") + layout.TMP_SUFFIX
    shutil.rmtree(tmp, ignore_errors=True)  # an earlier export that crashed: start again
    os.makedirs(tmp)
    n = len(shards)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map: dict[str, str] = {}
    arena = _Arena()
    total = read = 0
    t_write = t_check = 0.0
    try:
        for fname, shard in zip(names, shards, strict=True):
            ta = time.perf_counter()
            path = os.path.join(tmp, fname)
            digests = _write_shard(path, shard, lambda b: _load_shard(ckpt_dir, manifest, b, arena), shard_bytes)
            tc = time.perf_counter()
            _check_shard(path, shard, digests)
            for e in shard:
                weight_map[e.name] = fname
                total += e.nbytes
                read += e.nbytes // e.out.itemsize * e.src.itemsize
            t_write += tc - ta
            t_check += time.perf_counter() - tc
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_durable(os.path.join(tmp, INDEX), json.dumps(index, indent=1).encode())
        from ckptflow.trainer.format.checksum import hash_file

        files = {}
        for name in [*names, INDEX]:
            digest, size = hash_file(os.path.join(tmp, name))
            files[name] = {"size": size, "checksum": digest}
        record = {
            "format": "safetensors",
            "source": {
                "dir": os.path.abspath(ckpt_dir),
                "run_id": manifest.run_id,
                "step": manifest.step,
                "world_size": manifest.world_size,
            },
            "dtype": dtype,
            "prefix": prefix,
            "key_map": key_map,
            "tensors": len(weight_map),
            "bytes": total,
            "files": files,
        }
        write_durable(os.path.join(tmp, EXPORT_RECORD), json.dumps(record, indent=1).encode())
        fsync_dir(tmp)  # every file above was fsynced as it was written
        rename_durable(tmp, out)  # the commit point
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(
        location=os.path.abspath(out),
        step=manifest.step,
        dtype=dtype,
        tensors=len(weight_map),
        shards=names,
        bytes=total,
        bytes_read=read,
        seconds={
            "load_and_write": t_write,
            "check": t_check,
            "total": time.perf_counter() - t0,
        },
    )


def export_url(tier: Any, run_id: str, step: int) -> str:
    """Where a step's export lives on a tier: ``<run>/_exports/step_N``."""
    return layout.join(layout.run_dir(tier.url, run_id), EXPORTS_DIR, layout.step_name(step))


def is_exported(tier: Any, run_id: str, step: int) -> bool:
    return bool(tier.rule.is_committed(layout.join(layout.run_dir(tier.url, run_id), EXPORTS_DIR), step))


def upload_export(local: str, tier: Any, run_id: str, step: int) -> str:
    """Copy a committed export folder to an object-store tier: every file, then ``export.json``,
    then the tier's commit marker (a reader trusts only a marked export)."""
    exports = layout.join(layout.run_dir(tier.url, run_id), EXPORTS_DIR)
    url = tier.rule.staging_url(exports, step)
    if tier.rule.is_committed(exports, step):
        return url
    names = sorted(os.listdir(local))
    for name in [n for n in names if n != EXPORT_RECORD] + [EXPORT_RECORD]:
        tier.fs.put_file(os.path.join(local, name), layout.join(url, name))
    with open(os.path.join(local, EXPORT_RECORD), "rb") as f:
        tier.rule.commit(exports, step, marker=f.read())
    return url


def selected(cfg: Any, step: int) -> str | None:
    """Why ``[export]`` does not export ``step`` (None: it does)."""
    ex = cfg.export
    if ex.when == "off":
        return "[export] when = 'off'"
    if ex.when == "every_k" and step % ex.every_k:
        return f"step {step} is not a multiple of [export] every_k = {ex.every_k}"
    if ex.when == "kept":
        k = next(t.retention.keep_every for t in (cfg.cold, cfg.warm) if t and t.retention.keep_every)
        if step % k:
            return f"retention keeps multiples of {k} for good; step {step} is not one"
    return None


def export_stage(ref: Any) -> dict[str, Any]:
    """The lifecycle's ``export`` stage for one verified checkpoint: read from hot when hot still
    holds it, else fetched from warm into scratch; written to ``<run>/_exports/step_N`` on warm
    (and uploaded to cold with ``[export] cold``). Idempotent: a committed export is reused."""
    import tempfile

    ex = ref.cfg.export
    warm = ref.tier("warm")
    out = export_url(warm, ref.run_id, ref.step)
    t0 = time.perf_counter()
    scratch = None
    body: dict[str, Any]
    try:
        if is_exported(warm, ref.run_id, ref.step):
            rec = json.loads(read_small(os.path.join(out, EXPORT_RECORD), 64 << 20))  # on warm: a tier's file
            body = {"location": out, "dtype": rec["dtype"], "tensors": rec["tensors"], "bytes": rec["bytes"]}
            body["shards"] = sorted(n for n in rec["files"] if n.endswith(".safetensors"))
        else:
            hot = ref.tier("hot")
            if hot.is_committed(ref.run_id, ref.step):
                src = hot.url_for(ref.run_id, ref.step)
            else:  # node-local roots, or hot already pruned: the verified warm copy
                from ckptflow.tasks.transfer import fetch

                scratch = tempfile.mkdtemp(prefix="ckptflow-export-")
                src = os.path.join(scratch, layout.step_name(ref.step))
                fetch(warm, ref.run_id, ref.step, src)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            try:
                res = export_dir(src, out, dtype=ex.dtype, shard_mb=ex.shard_mb, prefix=ex.prefix, key_map=ex.key_map)
            except ExportError as e:
                # The checkpoint is fine and moves on; this export cannot be made as configured
                # (a prefix that names nothing, fp16 overflow): said in the record, no event.
                return {"exported": False, "error": str(e), "seconds": time.perf_counter() - t0}
            body = res.to_dict()
        body.update(exported=True, index=layout.join(out, INDEX))
        if ex.cold and ref.has("cold"):
            body["cold"] = upload_export(out, ref.tier("cold"), ref.run_id, ref.step)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    body["seconds"] = time.perf_counter() - t0
    return body
