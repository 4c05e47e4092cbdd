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

import importlib
import io
import os
import pickle
import resource
import select
import signal
import struct
import time
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ckptflow.trainer.errors import IntegrityError, ResourceError
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
for _module in _ALLOWED:  # imported here, once: the bounded parse's forked child must never import
    try:
        importlib.import_module(_module)
    except ImportError:  # a module this torch does not have: its classes cannot be asked for either
        pass


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
_REFUSED: dict[str, str] = {}
"""Digests of bytes the bounded parse refused (a bomb, garbage), with why: refused again at once, not after
another second of CPU (reconcile and retries meet the same damaged checkpoint again)."""
_CACHE_MAX = 4096


def loads_dcp_metadata(data: bytes, *, source: str, signed: bool = False) -> Metadata:
    """Parse ``.metadata`` bytes with the restricted unpickler; ``source`` names them in errors.

    The allow-list stops a pickle from calling anything DCP does not, but not from asking the allowed
    calls for unbounded work: ``str`` of a list nested in itself a hundred times, or a dict keyed by such a
    tuple, is a few hundred bytes that take longer than the universe to hash or print. So the bytes are
    parsed first in a forked child under CPU and memory limits (:func:`_parse_bounded`), and only bytes that
    parsed there within them are parsed here.

    ``signed``: the caller checked these bytes against a manifest authenticated with this process's signing
    key (``Manifest.authenticated``): a holder of the key wrote them, and they are parsed here at once. The
    child costs a ``fork`` of the caller, whose page tables grow with its memory (about 15 ms at 1 GB
    resident here, plus a page fault on each page the caller writes after it)."""
    if len(data) > MAX_METADATA_BYTES:
        raise IntegrityError(
            f"{source}: larger than {MAX_METADATA_BYTES} bytes, which no DCP .metadata is; refusing to parse it",
            path=source,
        )
    if signed:
        return _loads(data, source)
    key = hash_bytes(data)
    if key in _REFUSED:
        raise IntegrityError(f"{source}: {_REFUSED[key]}", path=source)
    if key not in _VALIDATED:
        try:
            _parse_bounded(data, source)
        except IntegrityError as e:  # the bytes' fault (never a ResourceError): the same bytes fail the same way
            if len(_REFUSED) >= _CACHE_MAX:
                _REFUSED.clear()
            _REFUSED[key] = str(e).removeprefix(f"{source}: ")
            raise
        if len(_VALIDATED) >= _CACHE_MAX:
            _VALIDATED.clear()
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


_SETUP_FAILED = 3
"""The child's exit code when its caps could not be set (a hard limit below them): the machine's problem."""


def _parse_bounded(data: bytes, source: str) -> None:
    """Parse ``data`` in a forked child whose address space and CPU time are capped (``setrlimit``), waiting
    for it at most a wall-clock bound. Raises ``IntegrityError`` when the bytes are at fault: refused by the
    allow-list, garbage, or asking for more memory, CPU time or nesting than the caps allow (a bomb).
    Raises :class:`~ckptflow.trainer.errors.ResourceError` when the check could not run: no process to fork,
    hard limits below the caps, or a machine so busy the child never got its CPU time within the wall bound.

    The child starts from this process's imports (the allow-listed modules are imported here first: a fork
    of a threaded process must not import), keeps only its end of the pipe (no other thread's pipe, no
    socket of the trainer's), blocks the signals a job's process group receives, dumps no core, writes one
    framed message and ends with ``os._exit`` (no finalization, no atexit handlers, no buffers flushed)."""
    mem, cpu = _limits(len(data))
    wall = 3 * cpu + 10
    r, w = os.pipe()
    try:
        pid = os.fork()
    except BaseException:
        os.close(r)
        os.close(w)
        raise
    if pid == 0:
        _child(data, source, r, w, mem, cpu)  # never returns
    os.close(w)
    try:
        msg, status, used = _read_result(r, pid, wall_s=wall)
    finally:
        os.close(r)
    if msg == b"ok":
        return
    if msg is not None and msg.startswith(b"bad "):
        raise IntegrityError(msg[4:].decode("utf-8", "replace"), path=source)
    if msg is None and status is None and used < cpu:
        raise ResourceError(
            f"{source}: could not check this DCP .metadata: its bounded parse got {used:.1f} s of CPU in {wall} s "
            "(the machine is overloaded); nothing is wrong with the checkpoint as far as is known: run again"
        )
    if msg is None and status is not None and os.WIFEXITED(status):
        code = os.WEXITSTATUS(status)
        raise ResourceError(
            f"{source}: could not check this DCP .metadata: "
            + (
                f"this process's hard limits are below the check's caps ({mem >> 20} MiB of address space beyond "
                f"its own, {cpu} s of CPU); raise them (ulimit -v / -t)"
                if code == _SETUP_FAILED
                else f"its checking process ended without an answer (exit {code})"
            )
        )
    why = {
        b"memory": f"asks for more than {mem >> 20} MiB",
        b"recursion": "nests deeper than Python allows",
    }.get(msg or b"", "")
    if not why:
        sig = os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else None
        why = (
            f"took more than {cpu} s of CPU"
            if sig in (signal.SIGXCPU, signal.SIGKILL, None)
            else f"crashed the parser (signal {sig})"
        )
    raise IntegrityError(
        f"{source}: refusing this DCP .metadata: parsing its {len(data)} bytes {why}; a real one of that size "
        "never does (a pickle bomb, or damage). Do not load this checkpoint: restore an older one",
        path=source,
    )


def _child(data: bytes, source: str, r: int, w: int, mem: int, cpu: int) -> None:
    """The forked child of :func:`_parse_bounded`: caps, parse, one framed message, ``os._exit``."""
    code = 0
    try:
        os.close(r)
        top = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        os.closerange(3, w)
        os.closerange(w + 1, top if top != resource.RLIM_INFINITY else 1 << 20)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1})
        try:
            _cap(resource.RLIMIT_CORE, 0)
            _cap(resource.RLIMIT_AS, _address_space() + mem)
            _cap(resource.RLIMIT_CPU, cpu)
        except (OSError, ValueError):
            os._exit(_SETUP_FAILED)
        try:
            _loads(data, source)
            msg = b"ok"
        except MemoryError:
            msg = b"memory"
        except IntegrityError as e:
            msg = b"bad " + str(e).encode("utf-8", "replace")[:4000]
        except RecursionError:
            msg = b"recursion"
        os.write(w, struct.pack("<I", len(msg)) + msg)
    except BaseException:  # noqa: BLE001 - nothing may escape a forked child
        code = 1
    finally:
        os._exit(code)


def _cap(which: int, value: int) -> None:
    """Lower the limit ``which`` to ``value`` (soft and hard); a hard limit already below it is an error."""
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY and hard < value:
        raise ValueError(f"hard limit {hard} < {value}")
    resource.setrlimit(which, (value, value))


def _read_result(r: int, pid: int, *, wall_s: float) -> tuple[bytes | None, int | None, float]:
    """The child's message (None: none came), its wait status (None: killed after ``wall_s``) and the CPU
    seconds it used; the child is reaped on every path, also when this raises."""
    deadline = time.monotonic() + wall_s
    poller = select.poll()  # not select(): a trainer's descriptors run past 1024
    poller.register(r, select.POLLIN | select.POLLHUP)
    buf = b""
    killed = False
    try:
        while not _framed(buf):
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                killed = True
                break
            if poller.poll(max(1, int(min(left, 1.0) * 1000))):
                chunk = os.read(r, 1 << 16)
                if not chunk:
                    break
                buf += chunk
    except BaseException:  # interrupted: the child goes too, now, not at its CPU cap
        os.kill(pid, signal.SIGKILL)
        os.wait4(pid, 0)
        raise
    _, status, usage = os.wait4(pid, 0)
    used = usage.ru_utime + usage.ru_stime
    if killed:
        return None, None, used
    n = _framed(buf)
    return (buf[4 : 4 + n] if n else None), status, used


def _framed(buf: bytes) -> int:
    """The length of the message in ``buf`` once all of it is there (a 4-byte length, then the bytes), else 0
    (a message is never empty)."""
    if len(buf) < 4:
        return 0
    n = struct.unpack("<I", buf[:4])[0]
    return n if len(buf) >= 4 + n else 0


def _address_space() -> int:
    """This process's current virtual size: the child may grow ``mem`` beyond what it inherited."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def read_dcp_metadata(path: str | os.PathLike, *, source: str | None = None, signed: bool = False) -> Metadata:
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
    return loads_dcp_metadata(data, source=source or path, signed=signed)
