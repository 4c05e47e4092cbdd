"""Read DCP's ``.metadata`` without running whatever code a pickle asks for.

``.metadata`` is a pickle of ``torch.distributed.checkpoint.metadata.Metadata``; ``pickle.load`` would call any
function it names (``os.system`` is one ``REDUCE`` away), and it comes from partly trusted storage. So every
reader in ckptflow (resume checks, the codec's dtype maps, verify, restore) goes through
:func:`read_dcp_metadata`, whose unpickler resolves only the classes DCP writes there and refuses anything
else, naming the class and the file. The allow-list is exact, not "anything under torch": ``torch`` also
exports functions (``torch.load``, ``torch.hub``…) a crafted pickle could call.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ckptflow.trainer.errors import IntegrityError
from ckptflow.trainer.format import layout

__all__ = ["MAX_METADATA_BYTES", "MetadataUnpickler", "loads_dcp_metadata", "read_dcp_metadata"]


# A .metadata larger than this is not DCP's (a 100k-tensor model writes tens of MB).
MAX_METADATA_BYTES = 1 << 30

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, frozenset[str]] = {
    _METADATA_MODULE: frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    # storage_data values: FileSystemWriter's and the Hugging Face writer's records.
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.distributed.checkpoint._hf_utils": frozenset({"_HFStorageInfo"}),
    # torch.strided is pickled as _get_layout("torch.strided"): a table lookup, no side effects.
    "torch.serialization": frozenset({"_get_layout"}),
    # StorageMeta.checkpoint_id keeps the path the checkpoint was saved to.
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset(
        {
            "set",
            "frozenset",
            "list",
            "tuple",
            "dict",
            "bytes",
            "bytearray",
            "complex",
            "int",
            "float",
            "str",
            "bool",
            "slice",
            "range",
        }
    ),
}
# torch.Size plus every dtype (torch.float32, …), which pickle by name as attributes of torch.
_TORCH_DTYPES = frozenset(n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype))
_ALLOWED["torch"] = frozenset({"Size"}) | _TORCH_DTYPES


class MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f: io.BufferedIOBase, source: str) -> None:
        super().__init__(f)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise IntegrityError(
            f"{self._source}: DCP metadata asks for {module}.{name}, which DCP never writes "
            "there; refusing to unpickle it (a tampered or foreign file could run code this "
            "way). Do not load this checkpoint; restore an older one or regenerate it",
            path=self._source,
        )

    def persistent_load(self, pid: Any) -> Any:
        # DCP metadata holds no tensors; torch.save's persistent ids have no place here.
        raise IntegrityError(
            f"{self._source}: DCP metadata contains a persistent reference ({pid!r:.60}); "
            "it is not a DCP .metadata file, refusing to load it",
            path=self._source,
        )


def loads_dcp_metadata(data: bytes, *, source: str) -> Metadata:
    """Parse ``.metadata`` bytes with the restricted unpickler; ``source`` names them in errors."""
    try:
        md = MetadataUnpickler(io.BytesIO(data), source).load()
    except IntegrityError:
        raise
    except Exception as e:  # truncated, garbage, or a class whose constructor refused its args
        raise IntegrityError(
            f"{source}: DCP metadata is unreadable ({type(e).__name__}: {e}); the checkpoint "
            "is damaged or incomplete, restore an older one",
            path=source,
        ) from None
    if not isinstance(md, Metadata):
        raise IntegrityError(
            f"{source}: file unpickles to {type(md).__name__}, not DCP Metadata; it is not a DCP .metadata file",
            path=source,
        )
    return md


def read_dcp_metadata(path: str | os.PathLike) -> Metadata:
    """The ``Metadata`` of a DCP checkpoint; ``path``: its directory or its ``.metadata``, local or an fsspec
    URL. Raises ``IntegrityError`` naming the file for anything but a well-formed DCP metadata pickle, and
    ``FileNotFoundError`` when there is none."""
    path = os.fspath(path)
    if not path.rstrip("/").endswith(layout.DCP_METADATA):
        path = layout.join(path, layout.DCP_METADATA)
    if "://" in path:
        import fsspec

        with fsspec.open(path, "rb") as f:
            data = f.read(MAX_METADATA_BYTES + 1)
    else:
        with open(path, "rb") as f:
            data = f.read(MAX_METADATA_BYTES + 1)
    if len(data) > MAX_METADATA_BYTES:
        raise IntegrityError(
            f"{path}: larger than {MAX_METADATA_BYTES} bytes, which no DCP .metadata is; refusing to parse it",
            path=path,
        )
    return loads_dcp_metadata(data, source=path)
