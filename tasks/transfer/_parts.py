"""A node-local checkpoint onto warm: each node stages its part, the whole commits once complete.

With node-local hot roots a node's files are readable only on that node, so promote runs
there, per node, and one commit joins the parts::

    stage_part    on each node (its worker): the files this node wrote — plus any it is asked
                  to take over for a node that is gone and whose files it holds as replicas —
                  encoded in warm's stored form into warm's staging dir ``step_N.tmp/``, each
                  digest-checked against the manifest on the way, fsynced, renamed into place;
                  then the part's report ``_lifecycle/step_N/parts/<node>.json`` on warm, and a
                  copy of the manifest beside it (every node's is the same: checked)
    parts_status  anywhere that sees warm: the reports, and which files no part has staged
    commit_parts  once every file is staged: every stored file re-read and digested against
                  its report, ``tier.json`` from all parts, ``manifest.json``, then the rename
                  — the commit point. Until then nothing on warm is committed, so an
                  incomplete checkpoint never is.

Every step is idempotent: a re-run skips files staged and still intact, and a committed
step is left as it is.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass, field

from ckptflow.tasks.storage.index import StoredFile, TierIndex
from ckptflow.tasks.storage.tier import Tier
from ckptflow.tasks.transfer import _streams as streams
from ckptflow.tasks.transfer._promote import _locked_tmp, _require_rename_tier
from ckptflow.tasks.transfer.results import FaultHook, TransferResult, no_fault
from ckptflow.trainer.errors import CheckpointNotFoundError, CkptflowError, IntegrityError, ManifestError
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.checksum import hash_bytes
from ckptflow.trainer.format.manifest import MAX_MANIFEST_BYTES, PLACEMENT, Manifest
from ckptflow.trainer.fsutil import fsync_dir, replace_atomic, write_durable
from ckptflow.trainer.safeopen import read_small

log = logging.getLogger(__name__)

MANIFEST_COPY = "manifest.json"


class IncompleteError(CkptflowError, RuntimeError):
    """Not every file of a node-local checkpoint is staged; the message names what is missing."""


@dataclass(slots=True)
class PartResult:
    node: str
    run_id: str
    step: int
    status: str
    """``staged``, ``absent`` (this node holds no such step) or ``committed`` (warm has it already)."""
    files: dict[str, dict] = field(default_factory=dict)
    """Files this call staged (or found staged and intact): name -> stored entry."""
    held: list[str] = field(default_factory=list)
    """Every manifest file this node holds: what it could take over for a lost node."""
    bytes_raw: int = 0
    bytes_stored: int = 0
    seconds: float = 0.0


def parts_dir(warm: Tier, run_id: str, step: int) -> str:
    return layout.join(layout.lifecycle_dir(layout.run_dir(warm.url, run_id), step), layout.PARTS_DIR)


def owned_files(manifest: Manifest, node: str) -> list[str]:
    """The files node ``node`` wrote, by the placement recorded at save time."""
    pl = manifest.extra.get(PLACEMENT) or {}
    ids = [str(n.get("node")) for n in pl.get("nodes", [])]
    if node not in ids:
        return []
    me = ids.index(node)
    return sorted(n for n, owner in pl.get("owner", {}).items() if owner == me)


def stage_part(
    hot: Tier,
    warm: Tier,
    run_id: str,
    step: int,
    *,
    node: str,
    take: list[str] | tuple[str, ...] = (),
    threads: int | None = None,
    fault: FaultHook | None = None,
) -> PartResult:
    """This node's part of ``run_id``/``step`` into warm's staging dir (see the module docstring)."""
    t0 = time.perf_counter()
    fault = fault or no_fault
    _require_rename_tier(warm)
    out = PartResult(node, run_id, step, "staged")
    if warm.is_committed(run_id, step):
        out.status = "committed"
        return out
    try:
        ckpt = hot.open_checkpoint(run_id, step)
    except CheckpointNotFoundError:
        out.status = "absent"  # a replaced node, or pruned here: the other parts and replicas decide
        _write_report(warm, out)
        return out
    out.held = sorted(n for n in ckpt.manifest.files if os.path.exists(ckpt.object_url(n)))
    want = sorted((set(owned_files(ckpt.manifest, node)) | set(take)) & set(out.held))
    pdir = parts_dir(warm, run_id, step)
    os.makedirs(pdir, exist_ok=True)
    _same_manifest(os.path.join(pdir, MANIFEST_COPY), ckpt.manifest_bytes)
    tmp = warm.tmp_url(run_id, step)
    os.makedirs(tmp, exist_ok=True)
    already = {n: f for rep in read_reports(warm, run_id, step).values() for n, f in rep.get("files", {}).items()}
    maps = streams.dtype_maps(hot, ckpt, warm.codec)
    for name in want:
        entry = ckpt.manifest.files[name]
        prev = already.get(name)
        if prev is not None and _intact(tmp, prev):
            out.files[name] = prev  # staged before (by this node or one that took it over)
            continue
        stored = streams.stored_name(name, warm.codec)
        final = os.path.join(tmp, *stored.split("/"))
        os.makedirs(os.path.dirname(final), exist_ok=True)
        part = f"{final}.{uuid.uuid4().hex[:8]}.part"
        with open(part, "wb") as f:
            st = streams.encode_file(
                hot,
                ckpt,
                name,
                f,
                codec=warm.codec,
                level=warm.config.level,
                threads=warm.config.codec_threads,
                dtype_map=maps.get(name),
            )
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, final)
        out.files[name] = asdict(StoredFile(entry.size, entry.checksum, stored, st.stored_bytes, st.stored_checksum))
        fault(f"part:file:{name}")
    fsync_dir(tmp)
    out.bytes_raw = sum(ckpt.manifest.files[n].size for n in out.files)
    out.bytes_stored = sum(int(f["stored_size"]) for f in out.files.values())
    out.seconds = time.perf_counter() - t0
    _write_report(warm, out)
    log.info(
        "node %s: staged its part of %s step %d on warm (%d files, %.1f MB)",
        node,
        run_id,
        step,
        len(out.files),
        out.bytes_raw / 1e6,
    )
    return out


def _same_manifest(path: str, data: bytes) -> None:
    """Create ``path`` with ``data`` unless it exists (the first node's copy wins: a link cannot
    replace), then insist the copy there is the same manifest."""
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.part"
    write_durable(tmp, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    have = read_small(path, MAX_MANIFEST_BYTES)
    if hash_bytes(have) != hash_bytes(data):
        raise ManifestError(
            f"{path}: another node staged this step with a different manifest; the nodes disagree "
            "about what the checkpoint is — do not commit it",
            path=path,
        )


def _intact(tmp: str, f: dict) -> bool:
    path = os.path.join(tmp, *str(f["stored_name"]).split("/"))
    try:
        streams.verify_local(path, int(f["stored_size"]), str(f["stored_checksum"]), "staged part")
        return True
    except (IntegrityError, OSError):
        return False


def _write_report(warm: Tier, rep: PartResult) -> None:
    pdir = parts_dir(warm, rep.run_id, rep.step)
    os.makedirs(pdir, exist_ok=True)
    body = dict(asdict(rep), recorded_at=time.time())
    replace_atomic(
        os.path.join(pdir, f"{layout.check_member_name(rep.node)}.json"),
        (json.dumps(body, indent=1, sort_keys=True) + "\n").encode(),
    )


def read_reports(warm: Tier, run_id: str, step: int) -> dict[str, dict]:
    """Node -> its part's report (the manifest copy excluded)."""
    pdir = parts_dir(warm, run_id, step)
    out: dict[str, dict] = {}
    try:
        names = os.listdir(pdir)
    except FileNotFoundError:
        return out
    for n in sorted(names):
        if not n.endswith(".json") or n == MANIFEST_COPY:
            continue
        try:
            out[n[: -len(".json")]] = json.loads(read_small(os.path.join(pdir, n), MAX_MANIFEST_BYTES))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError, IntegrityError):
            continue  # being replaced: the next look sees it whole
    return out


@dataclass(slots=True)
class PartsStatus:
    manifest: Manifest | None
    manifest_bytes: bytes | None
    reports: dict[str, dict]
    missing: list[str]
    """Manifest files no part has staged."""
    holders: dict[str, list[str]]
    """For each missing file, the nodes whose report says they hold it (take-over candidates)."""


def parts_status(warm: Tier, run_id: str, step: int) -> PartsStatus:
    pdir = parts_dir(warm, run_id, step)
    try:
        mbytes = read_small(os.path.join(pdir, MANIFEST_COPY), MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return PartsStatus(None, None, read_reports(warm, run_id, step), [], {})
    manifest = Manifest.from_json(mbytes, source=os.path.join(pdir, MANIFEST_COPY))
    reports = read_reports(warm, run_id, step)
    staged = {n for r in reports.values() for n in r.get("files", {})}
    missing = sorted(set(manifest.files) - staged)
    holders = {n: sorted(node for node, r in reports.items() if n in r.get("held", [])) for n in missing}
    return PartsStatus(manifest, mbytes, reports, missing, holders)


def commit_parts(warm: Tier, run_id: str, step: int, *, fault: FaultHook | None = None) -> TransferResult:
    """Join the staged parts into one committed checkpoint on warm (module docstring)."""
    t0 = time.perf_counter()
    fault = fault or no_fault
    st = parts_status(warm, run_id, step)
    if warm.is_committed(run_id, step):
        there = warm.open_checkpoint(run_id, step)
        return TransferResult(
            uri=there.uri,
            run_id=run_id,
            step=step,
            codec=there.index.codec,
            skipped_files=len(there.index.files),
            bytes_raw=there.index.total_raw_bytes,
            bytes_stored=there.index.total_stored_bytes,
            already_committed=True,
            seconds=time.perf_counter() - t0,
        )
    if st.manifest is None or st.manifest_bytes is None:
        raise IncompleteError(f"{run_id} step {step}: no node has staged its part on {warm.url} yet")
    if st.missing:
        raise IncompleteError(
            f"{run_id} step {step}: no part staged {', '.join(st.missing)} "
            f"(nodes that reported: {', '.join(st.reports) or 'none'}); not committing it on warm"
        )
    files: dict[str, StoredFile] = {}
    for rep in st.reports.values():
        for n, f in rep.get("files", {}).items():
            files.setdefault(
                n,
                StoredFile(
                    int(f["size"]),
                    str(f["checksum"]),
                    str(f["stored_name"]),
                    int(f["stored_size"]),
                    str(f["stored_checksum"]),
                ),
            )
    with _locked_tmp(warm, run_id, step) as tmp:
        if warm.is_committed(run_id, step):
            return commit_parts(warm, run_id, step)
        tv = time.perf_counter()
        for n, f in sorted(files.items()):  # read back: what the index vouches for must be there, whole
            e = st.manifest.files[n]
            if (f.size, f.checksum) != (e.size, e.checksum):
                raise ManifestError(f"{tmp}: the part staged for {n} describes other bytes than the manifest")
            streams.verify_local(
                os.path.join(tmp, *f.stored_name.split("/")), f.stored_size, f.stored_checksum, f"staged {n}"
            )
        verify_s = time.perf_counter() - tv
        index = TierIndex(
            run_id=run_id,
            step=step,
            codec=warm.codec,
            level=warm.config.level,
            manifest_checksum=hash_bytes(st.manifest_bytes),
            files=files,
        )
        write_durable(os.path.join(tmp, layout.TIER_MANIFEST), index.to_json())
        write_durable(os.path.join(tmp, layout.MANIFEST), st.manifest_bytes)
        fault("promote:before_commit")
        uri = warm.commit(run_id, step)
    fault("promote:committed")
    return TransferResult(
        uri=uri,
        run_id=run_id,
        step=step,
        codec=warm.codec,
        files=len(files),
        bytes_raw=index.total_raw_bytes,
        bytes_stored=index.total_stored_bytes,
        seconds=time.perf_counter() - t0,
        verify_seconds=verify_s,
    )
