"""Loading a DCP checkpoint at disk speed, every byte verified in the same read, nothing unpickled.

DCP's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle`` (an edited file runs
code) and ``torch.load``s every item (about 1 ms each, plus a copy), after ckptflow has read
every byte once already to verify it. :class:`VerifiedReader` reads the same files — they
stay standard DCP, vanilla PyTorch still reads them — differently:

* ``.metadata``: read, its size and xxh3 checked against the manifest, then parsed by the
  restricted reader of ``trainer/dcpmeta.py`` (an allow-list of DCP's own classes);
* data files: each file this rank's load plan needs is read once, in parallel threads,
  hashed as its bytes stream in, and compared with the manifest *before* any of its bytes is
  handed on: a file that does not match fails the load (DCP raises on every rank; resume
  falls back to an older checkpoint, as for a bad checksum);
* tensor items (each a ``torch.save`` zip): located in the zip without unpickling — the tiny
  ``data.pkl`` that says dtype, offset, size and stride is read by a restricted reader
  that only knows ``_rebuild_tensor_v2``, storage types and ``OrderedDict`` — and copied
  straight from the read buffer into the destination tensor (a view, no intermediate
  tensor); where the saved and wanted chunks differ (resharding) the view is narrowed first;
* byte items (plain Python values DCP keeps as ``torch.save`` pickles, such as an optimizer's
  learning rates): ``torch.load(weights_only=True)``, PyTorch's own restricted loader, with
  numpy's array rebuilders allowed for checkpoints written before state layout 2.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import struct
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ckptflow.trainer import layout, zipfmt
from ckptflow.trainer.checksum import new_hasher
from ckptflow.trainer.dcpmeta import MAX_METADATA_BYTES, loads_dcp_metadata
from ckptflow.trainer.errors import IntegrityError
from ckptflow.trainer.manifest import Manifest
from ckptflow.trainer.verify import resolve_member

CHUNK = 8 << 20


class VerifiedReader(FileSystemReader):
    """A ``StorageReader`` for one local checkpoint directory and its (authenticated) manifest."""

    def __init__(self, path: str, manifest: Manifest, *, threads: int = 4) -> None:
        super().__init__(path)
        self.ckpt_dir = os.fspath(path)
        self.manifest = manifest
        self.threads = max(1, threads)
        self._md: Metadata | None = None
        self.bytes_read = 0
        self.read_seconds = 0.0

    # -- StorageReader ------------------------------------------------------------------
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._md is None:
            data = bytes(self._read_whole(layout.DCP_METADATA, limit=MAX_METADATA_BYTES))
            self._md = loads_dcp_metadata(data, source=os.path.join(self.ckpt_dir, layout.DCP_METADATA))
        return self._md

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        t0 = time.perf_counter()
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        names = sorted(per_file)
        # Read and verify every file this rank needs before a single byte reaches a target.
        with ThreadPoolExecutor(max_workers=min(self.threads, max(1, len(names)))) as ex:
            bufs = dict(zip(names, ex.map(self._read_whole, names), strict=True))
        self.bytes_read += sum(len(b) for b in bufs.values())
        self.read_seconds += time.perf_counter() - t0
        copies: list[tuple[ReadItem, torch.Tensor, torch.Tensor]] = []
        for name in names:
            buf = memoryview(bufs[name])
            for req in per_file[name]:
                info = self.storage_data[req.storage_index]
                if info.transform_descriptors:
                    raise IntegrityError(
                        f"{name}: item {req.storage_index.fqn} uses storage transforms "
                        f"{info.transform_descriptors}, which ckptflow's reader does not read"
                    )
                item = buf[info.offset : info.offset + info.length]
                source = f"{os.path.join(self.ckpt_dir, name)}@{info.offset}"
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, io.BytesIO(item.tobytes()))
                    continue
                tensor = narrow_tensor_by_index(tensor_view(item, source), req.storage_offsets, req.lengths)
                target = planner.resolve_tensor(req).detach()
                if target.size() != tensor.size():
                    raise IntegrityError(
                        f"{source}: {req.storage_index.fqn} has size {tuple(tensor.size())} here, "
                        f"the model wants {tuple(target.size())}",
                        path=source,
                    )
                copies.append((req, tensor, target))
        # The copies release the GIL: spread them over the threads (largest first).
        copies.sort(key=lambda c: -c[1].numel() * c[1].element_size())
        with ThreadPoolExecutor(max_workers=self.threads) as ex:
            list(ex.map(lambda c: c[2].copy_(c[1]), copies))
        for req, _, target in copies:
            planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    # -- reading ------------------------------------------------------------------------
    def _read_whole(self, name: str, limit: int | None = None) -> Any:
        """The file's bytes — mapped, not copied: hashing and the tensor copies read the page cache
        directly, and no fresh buffer is allocated and faulted in — refused unless they match."""
        entry = self.manifest.files.get(name)
        if entry is None:
            raise IntegrityError(
                f"{self.ckpt_dir}: the load reads {name}, which the manifest does not list",
                path=os.path.join(self.ckpt_dir, name),
            )
        path = resolve_member(self.ckpt_dir, name)
        if limit is not None and entry.size > limit:
            raise IntegrityError(f"{path}: {entry.size} bytes, more than any such file holds", path=path)
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                if size != entry.size:
                    raise IntegrityError(
                        f"{path}: size {size} differs from the {entry.size} bytes in the manifest "
                        "(truncated or replaced); not loading it",
                        path=path,
                    )
                if size == 0:
                    data: Any = bytearray()
                else:
                    # ACCESS_COPY: private and writable (torch.frombuffer wants that), copied only if written
                    data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                    if hasattr(mmap, "MADV_SEQUENTIAL"):
                        data.madvise(mmap.MADV_SEQUENTIAL)
        except FileNotFoundError:
            raise IntegrityError(f"{path}: missing", path=path) from None
        h = new_hasher()
        view = memoryview(data)
        for i in range(0, size, CHUNK):
            h.update(view[i : i + CHUNK])
        view.release()
        if h.hexdigest() != entry.checksum:
            raise IntegrityError(
                f"{path}: checksum {h.hexdigest()} != {entry.checksum} in the manifest (bytes "
                "corrupted); not loading it",
                path=path,
            )
        return data


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, but byte items come back through PyTorch's restricted loader."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        import numpy as np

        allowed: list[Any] = [np.dtype, np.ndarray]
        for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):  # layout-1 RNG states are arrays
            try:
                allowed.append(__import__(mod, fromlist=["_reconstruct"])._reconstruct)
            except (ImportError, AttributeError):
                pass
        allowed += [type(np.dtype(d)) for d in ("uint32", "float64", "int64")]
        with torch.serialization.safe_globals(allowed):
            try:
                obj = torch.load(value, weights_only=True)
            except Exception as e:  # anything the restricted loader refuses is not ours to run
                raise IntegrityError(
                    f"{read_item.dest_index.fqn}: a non-tensor item the restricted loader refuses "
                    f"({type(e).__name__}: {str(e)[:200]}); not loading it"
                ) from None
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:  # as DCP's own: back where the unflattened state dict has it
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


# ---- tensor items: a torch.save zip, read without unpickling ------------------------------


def _zip_entries(buf: memoryview) -> dict[str, tuple[int, int]]:
    """Name -> (data offset, size) of every stored entry of a zip in ``buf``."""
    return {name: (e.data, e.size) for name, e in zipfmt.entries(buf).items()}


class _StorageType:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


_STORAGE_TYPES = {
    f"{n}Storage": d
    for n, d in (
        ("Float", torch.float32),
        ("Double", torch.float64),
        ("Half", torch.float16),
        ("BFloat16", torch.bfloat16),
        ("Long", torch.int64),
        ("Int", torch.int32),
        ("Short", torch.int16),
        ("Char", torch.int8),
        ("Byte", torch.uint8),
        ("Bool", torch.bool),
        ("ComplexFloat", torch.complex64),
        ("ComplexDouble", torch.complex128),
    )
}


def _rebuild(storage: tuple, offset: int, size: tuple, stride: tuple, *_rest: Any) -> tuple:
    return ("tensor", storage, offset, tuple(size), tuple(stride))


class _TensorPickle(pickle.Unpickler):
    """Reads a tensor's ``data.pkl`` into a description; can construct nothing but that."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in _STORAGE_TYPES:
            return _StorageType(_STORAGE_TYPES[name])
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a plain tensor")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise pickle.UnpicklingError(f"unexpected storage reference {pid!r:.80}")
        return ("storage", pid[1].dtype, str(pid[2]), int(pid[4]))


def tensor_view(item: memoryview, source: str) -> torch.Tensor:
    """The tensor a ``torch.save`` zip in ``item`` holds, as a view of ``item``'s bytes."""
    try:
        entries = _zip_entries(item)
        pkl = next(n for n in entries if n.endswith("/data.pkl"))
        prefix = pkl[: -len("data.pkl")]
        off, n = entries[pkl]
        desc = _TensorPickle(io.BytesIO(item[off : off + n].tobytes())).load()
        kind, (_, dtype, key, numel), storage_offset, size, stride = desc
        if kind != "tensor":
            raise ValueError("not a tensor")
        doff, dsize = entries[f"{prefix}data/{key}"]
        itemsize = torch.empty((), dtype=dtype).element_size()
        if dsize != numel * itemsize:
            raise ValueError(f"storage holds {dsize} bytes, {numel} x {itemsize} expected")
        flat = (
            torch.frombuffer(item, dtype=torch.uint8, count=dsize, offset=doff)
            if dsize
            else torch.empty(0, dtype=torch.uint8)
        )
        storage = flat.view(dtype) if dsize else torch.empty(0, dtype=dtype)
        return storage.as_strided(size, stride, storage_offset)
    except (
        ValueError,
        KeyError,
        StopIteration,
        struct.error,
        pickle.UnpicklingError,
        RuntimeError,
        UnicodeDecodeError,
        IndexError,
    ) as e:
        raise IntegrityError(
            f"{source}: not a plain tensor item ({type(e).__name__}: {e}); the checkpoint is "
            "damaged or was not written by DCP",
            path=source,
        ) from None
