"""Read DCP's ``.metadata`` without running whatever code a pickle asks for.

``.metadata`` is a pickle of ``torch.distributed.checkpoint.metadata.Metadata``; ``pickle.load`` would call any
function it names (``os.system`` is one ``REDUCE`` away), and it comes from partly trusted storage. So every
reader in ckptflow (resume checks, the codec's dtype maps, verify, restore) goes through
:func:`read_dcp_metadata`, whose unpickler resolves only the classes DCP writes there and refuses anything
else, naming the class and the file. The allow-list is exact, not "anything under torch": ``torch`` also
exports functions (``torch.load``, ``torch.hub``…) a crafted pickle could call.

The allow-list bounds *what* a pickle may call, not how much work it asks of what it may: a few hundred
bytes can ask ``str`` to print a list nested in itself a hundred times, or a dict to hash such a tuple.
So bytes are parsed first in a forked child with its memory and CPU time capped (``setrlimit``) and a
wall-clock bound; only bytes that parsed there are parsed in the caller (:func:`loads_dcp_metadata`).
"""

from __future__ import annotations

import io
import os
import pickle
import resource
import select
import signal
import time
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ckptflow.trainer.errors import IntegrityError
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.checksum import hash_bytes
from ckptflow.trainer.safeopen import open_regular

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


PARSE_MEMORY_BYTES = 512 << 20
"""The least memory the bounded parse of a ``.metadata`` may use (more for a large one: :func:`_limits`)."""
PARSE_CPU_S = 1
"""The least CPU time it may use."""

_VALIDATED: set[str] = set()
"""Digests of ``.metadata`` bytes this process has parsed within bounds already (no second child for them)."""


def loads_dcp_metadata(data: bytes, *, source: str) -> Metadata:
    """Parse ``.metadata`` bytes with the restricted unpickler; ``source`` names them in errors.

    The allow-list stops a pickle from calling anything DCP does not, but not from asking the allowed
    calls for unbounded work: ``str`` of a list nested in itself a hundred times, or a dict keyed by such a
    tuple, is a few hundred bytes that take longer than the universe to hash or print. So the bytes are
    parsed first in a forked child under CPU and memory limits (:func:`_parse_bounded`), and only bytes that
    parsed there within them are parsed here."""
    if len(data) > MAX_METADATA_BYTES:
        raise IntegrityError(
            f"{source}: larger than {MAX_METADATA_BYTES} bytes, which no DCP .metadata is; refusing to parse it",
            path=source,
        )
    key = hash_bytes(data)
    if key not in _VALIDATED:
        _parse_bounded(data, source)
        _VALIDATED.add(key)
    return _loads(data, source)


def _loads(data: bytes, source: str) -> Metadata:
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


def _limits(n: int) -> tuple[int, int]:
    """Memory (bytes) and CPU (seconds) a parse of ``n`` bytes may take: a DCP ``.metadata`` unpickles to about
    ten times its size in objects, at tens of MB per second on one core; allowed with a wide margin."""
    return max(PARSE_MEMORY_BYTES, 40 * n), max(PARSE_CPU_S, PARSE_CPU_S + n // (4 << 20))


def _parse_bounded(data: bytes, source: str) -> None:
    """Parse ``data`` in a forked child whose address space and CPU time are capped (``setrlimit``), and wait
    for it at most a wall-clock bound; raise ``IntegrityError`` if it failed, ran out of either, or took too
    long. The child starts from this process's imports, touches nothing but ``data``, and ends with
    ``os._exit`` (no interpreter finalization, no atexit handlers, no buffers of the parent's flushed)."""
    mem, cpu = _limits(len(data))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        code = 0
        try:
            os.close(r)
            base = _address_space()
            resource.setrlimit(resource.RLIMIT_AS, (base + mem, base + mem))
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
            try:
                _loads(data, source)
                msg = b"ok"
            except MemoryError:
                msg = b"memory"
            except IntegrityError as e:
                msg = b"bad " + str(e).encode("utf-8", "replace")[:4000]
            except RecursionError:
                msg = b"recursion"
            os.write(w, msg)
        except BaseException:  # noqa: BLE001 - nothing may escape a forked child
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    try:
        msg = _read_result(r, pid, wall_s=3 * cpu + 10)
    finally:
        os.close(r)
    if msg == b"ok":
        return
    if msg.startswith(b"bad "):
        raise IntegrityError(msg[4:].decode("utf-8", "replace"), path=source)
    why = {
        b"memory": f"asks for more than {mem >> 20} MiB",
        b"recursion": "nests deeper than Python allows",
        b"cpu": f"took more than {cpu} s of CPU",
        b"wall": f"did not finish within {3 * cpu + 10} s",
    }.get(msg, f"its parse ended abnormally ({msg.decode('ascii', 'replace')})")
    raise IntegrityError(
        f"{source}: refusing this DCP .metadata: parsing its {len(data)} bytes {why}; a real one of that size "
        "never does (a pickle bomb, or damage). Do not load this checkpoint: restore an older one",
        path=source,
    )


def _read_result(r: int, pid: int, *, wall_s: float) -> bytes:
    """The child's one message, or why there is none (``cpu``, ``wall``, ``signal N``); reaps the child."""
    deadline = time.monotonic() + wall_s
    chunks: list[bytes] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return b"wall"
        ready, _, _ = select.select([r], [], [], min(left, 1.0))
        if ready:
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    msg = b"".join(chunks)
    if msg:
        return msg
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return b"cpu" if sig in (signal.SIGXCPU, signal.SIGKILL) else f"signal {sig}".encode()
    return f"exit {os.WEXITSTATUS(status)}".encode()


def _address_space() -> int:
    """This process's current virtual size: the child may grow ``mem`` beyond what it inherited."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def read_dcp_metadata(path: str | os.PathLike, *, source: str | None = None) -> Metadata:
    """The ``Metadata`` of a DCP checkpoint; ``path``: its directory or its ``.metadata``, local or an fsspec
    URL (``source``: how errors name it, the path by default). Raises ``IntegrityError`` naming the file for
    anything but a well-formed DCP metadata pickle (a FIFO or device there included), and
    ``FileNotFoundError`` when there is none."""
    path = os.fspath(path)
    if not path.rstrip("/").endswith(layout.DCP_METADATA):
        path = layout.join(path, layout.DCP_METADATA)
    if "://" in path:
        import fsspec

        with fsspec.open(path, "rb") as f:
            data = f.read(MAX_METADATA_BYTES + 1)
    else:
        with open_regular(path) as f:
            if os.fstat(f.fileno()).st_size > MAX_METADATA_BYTES:  # refused unread (a sparse terabyte reads slowly)
                raise IntegrityError(
                    f"{path}: larger than {MAX_METADATA_BYTES} bytes, which no DCP .metadata is; refusing to parse it",
                    path=path,
                )
            data = f.read(MAX_METADATA_BYTES + 1)
    return loads_dcp_metadata(data, source=source or path)
