"""Check a local checkpoint directory against its manifest, before anything is loaded.

DCP has no checksums (a flipped byte loads silently) and its ``.metadata`` is a pickle, so nothing goes to
DCP until every listed file's size and xxh3-128 digest are confirmed. Hashing runs in threads (reads and
xxhash release the GIL).
"""

from __future__ import annotations

import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ckptflow.trainer.errors import IntegrityError, UnsafePathError, UntrustedError
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.checksum import hash_file
from ckptflow.trainer.format.manifest import Manifest, read_manifest
from ckptflow.trainer.safeopen import file_kind, read_small

__all__ = [
    "Problem",
    "VerifyResult",
    "check_file",
    "check_present",
    "files_present",
    "is_node_part",
    "resolve_member",
    "share_of_files",
    "verify_checkpoint",
]


@dataclass(frozen=True, slots=True)
class Problem:
    path: str
    what: str
    damage: bool = True
    """The checkpoint is damaged (bytes, files, manifest). False: refused only because this process cannot
    trust it (no or another signing key, a newer format), which no copy of it would fix."""

    def __str__(self) -> str:
        return f"{self.path}: {self.what}"


@dataclass(slots=True)
class VerifyResult:
    ckpt_dir: str
    manifest: Manifest | None
    problems: list[Problem] = field(default_factory=list)
    bytes_checked: int = 0
    seconds: float = 0.0
    elsewhere: list[str] = field(default_factory=list)
    """A node's part (``part=True``): files this directory does not hold, left to the other nodes' parts."""

    @property
    def ok(self) -> bool:
        return not self.problems and self.manifest is not None

    def raise_if_bad(self) -> None:
        if not self.ok:
            p = self.problems[0]
            more = f" (+{len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
            raise IntegrityError(
                f"checkpoint {self.ckpt_dir} does not verify: {p}{more}; do not load it — "
                "resume falls back to an older checkpoint, or restore one from another tier",
                path=p.path,
            )


def resolve_member(ckpt_dir: str, name: str) -> str:
    """Local path of a manifest-listed file; refuses names or symlinks leaving the dir."""
    layout.check_member_name(name)
    path = os.path.join(ckpt_dir, *name.split("/"))
    root = os.path.realpath(ckpt_dir)
    real = os.path.realpath(path)
    if real != root and not real.startswith(root + os.sep):
        raise UnsafePathError(
            f"{path}: resolves outside the checkpoint ({real}); a symlink points out of it, refusing to read it",
            path=path,
        )
    return path


def check_present(ckpt_dir: str, name: str, size: int) -> Problem | None:
    """The cheap half of :func:`check_file`: the file is there, inside the checkpoint, with its size."""
    try:
        path = resolve_member(ckpt_dir, name)
    except UnsafePathError as e:
        return Problem(os.path.join(ckpt_dir, name), str(e))
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return Problem(path, "missing")
    if not stat.S_ISREG(st.st_mode):
        return Problem(path, f"is {file_kind(st.st_mode)}, not a regular file (never opened)")
    if st.st_size != size:
        return Problem(path, f"size {st.st_size} != {size} in the manifest (truncated or replaced)")
    return None


def files_present(ckpt_dir: str, manifest: Manifest, *, part: bool = False) -> list[Problem]:
    """:func:`check_present` for every file ``manifest`` lists (the cheap checks: no byte hashed). ``part``:
    ``ckpt_dir`` may hold one node's part of a node-local checkpoint, whose other files are elsewhere."""
    part = part and is_node_part(manifest)
    return [
        p
        for n, e in sorted(manifest.files.items())
        if not (part and not os.path.lexists(os.path.join(ckpt_dir, *n.split("/"))))
        and (p := check_present(ckpt_dir, n, e.size)) is not None
    ]


def check_file(ckpt_dir: str, name: str, size: int, checksum: str) -> Problem | None:
    """:func:`check_present`, then the file's xxh3-128 against the manifest's."""
    problem = check_present(ckpt_dir, name, size)
    if problem is not None:
        return problem
    path = os.path.join(ckpt_dir, *name.split("/"))  # what resolve_member returned, having checked it
    try:
        digest, n = hash_file(path)
    except IntegrityError as e:  # swapped for a FIFO or device after the look (trainer.safeopen)
        return Problem(path, str(e))
    except FileNotFoundError:
        return Problem(path, "missing")
    if n != size:
        return Problem(path, f"changed while being read ({n} bytes read, {size} expected)")
    if digest != checksum:
        return Problem(path, f"checksum {digest} != {checksum} in the manifest (bytes corrupted)")
    return None


def verify_checkpoint(
    ckpt_dir: str,
    *,
    only: list[str] | None = None,
    threads: int = 4,
    key: bytes | None = None,
    expect: tuple[str, int] | None = None,
    part: bool = False,
) -> VerifyResult:
    """Verify ``ckpt_dir``; ``only`` limits hashing to a subset (one rank's share). ``part=True``: it may be one
    node's part of a node-local checkpoint (files it lacks go to ``elsewhere``, not problems).
    ``expect=(run_id, step)``: the manifest must name that run and step (a copy under another is someone
    else's). Never raises for a bad checkpoint: it lists every problem; :meth:`VerifyResult.raise_if_bad` fails."""
    t0 = time.perf_counter()
    ckpt_dir = os.fspath(ckpt_dir)
    res = VerifyResult(ckpt_dir, None)
    if not os.path.isdir(ckpt_dir):
        res.problems.append(Problem(ckpt_dir, "checkpoint directory is missing"))
        return res
    try:
        res.manifest = read_manifest(ckpt_dir, key=key)
    except IntegrityError as e:
        res.problems.append(Problem(e.path or ckpt_dir, str(e), damage=not isinstance(e, UntrustedError)))
        return res
    got = (res.manifest.run_id, res.manifest.step)
    if expect is not None and got != tuple(expect):
        res.problems.append(
            Problem(
                os.path.join(ckpt_dir, layout.MANIFEST),
                f"manifest is for {got[0]} step {got[1]}, not {expect[0]} step "
                f"{expect[1]}; copied from another run or step",
            )
        )
        return res
    names = sorted(res.manifest.files) if only is None else sorted(only)
    if part and is_node_part(res.manifest):
        res.elsewhere = [
            n for n in names if n != layout.DCP_METADATA and not os.path.lexists(os.path.join(ckpt_dir, *n.split("/")))
        ]
        names = [n for n in names if n not in set(res.elsewhere)]
    todo = [(n, res.manifest.files[n]) for n in names]
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(todo)))) as ex:
        found = list(ex.map(lambda ne: check_file(ckpt_dir, ne[0], ne[1].size, ne[1].checksum), todo))
    res.problems.extend(p for p in found if p is not None)
    if layout.DCP_METADATA in names and not any(p.path.endswith(layout.DCP_METADATA) for p in res.problems):
        # An unsigned manifest can vouch for anything: .metadata must also parse as DCP's, or it is damage
        problem = _parse_metadata(ckpt_dir, res.manifest)
        if problem is not None:
            res.problems.append(problem)
    res.bytes_checked = sum(e.size for _, e in todo)
    res.seconds = time.perf_counter() - t0
    return res


def _parse_metadata(ckpt_dir: str, manifest: Manifest) -> Problem | None:
    """``.metadata`` parsed as DCP's: the very bytes read here, their digest checked first (a signed manifest's
    lets them be parsed in this process; ``dcpmeta``)."""
    from ckptflow.trainer.format.checksum import hash_bytes
    from ckptflow.trainer.format.dcpmeta import MAX_METADATA_BYTES, loads_dcp_metadata

    path = os.path.join(ckpt_dir, layout.DCP_METADATA)
    try:
        data = read_small(path, MAX_METADATA_BYTES)
        if hash_bytes(data) != manifest.files[layout.DCP_METADATA].checksum:
            return Problem(path, "changed since it was checked")
        loads_dcp_metadata(data, source=path, signed=manifest.authenticated)
    except IntegrityError as e:
        return Problem(path, str(e))
    return None


def is_node_part(manifest: Manifest) -> bool:
    """The checkpoint was saved on node-local roots: each node's directory holds a part."""
    return (manifest.extra.get("placement") or {}).get("scope") == "node"


def share_of_files(manifest: Manifest, rank: int, world_size: int) -> list[str]:
    """Files rank ``rank`` hashes when all ranks verify one checkpoint together (greedy by size: equal bytes)."""
    loads = [0] * world_size
    mine: list[str] = []
    for name, e in sorted(manifest.files.items(), key=lambda kv: (-kv[1].size, kv[0])):
        r = loads.index(min(loads))
        loads[r] += e.size
        if r == rank:
            mine.append(name)
    return mine
