"""Adopting a checkpoint another tool wrote: its files become a committed ckptflow checkpoint.

``ckptflow adopt PATH --run-id RUN [--step N]`` copies what another tool finished writing into the
hot root as ``<run>/step_<N>.tmp``, records every file's size and digest in a manifest, and commits
by the same rule as the trainer's own saves (the rename; ``latest`` after it), then appends the
``ckptflow.checkpoint.committed`` record to the run's outbox and posts the event: the deployed
lifecycle takes it from there (verify, promote, archive, prune). A crash at any point leaves a
``.tmp`` folder no reader trusts, removed by the next adoption of that step.

What is adopted, and when it counts as finished (never while it is still being written):

* **a DCP folder** (``dcp.save``; torchtitan's ``step-N``; Lightning's sharded FSDP folders):
  finished when its ``.metadata`` exists — DCP's coordinator writes it last — parses through the
  allow-list of ``trainer/format/dcpmeta.py``, and every file it references exists and is long
  enough for the items recorded in it;
* **one ``torch.save`` file** (a Lightning ``.ckpt``, a ``.pt``/``.pth``): finished when it is a
  zip whose central directory parses — ``torch.save`` writes that directory last, so a file
  still being written has none;
* **a Hugging Face ``Trainer`` folder** (``checkpoint-N/``: safetensors, optimizer, scheduler, RNG
  and trainer state): finished when its ``trainer_state.json`` exists and parses — the ``Trainer``
  writes it last.

A source that changes while it is copied (size or modification time) is refused as still being
written. What adoption after the fact cannot guarantee: bytes damaged before adoption are adopted
as they are (the digests prove only that nothing changed since); the checkpoint holds whatever
state its tool saved, so exact resume is that tool's promise, not ckptflow's; there is no recorded
probe loss, so the lifecycle's check beyond the digests is a pickle-free parse of each file
(:func:`parse_check`), not a restore.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ckptflow.trainer import events, faults
from ckptflow.trainer.errors import ConfigError, IntegrityError
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.atomicity import RENAME
from ckptflow.trainer.format.checksum import digest_file, hash_stream
from ckptflow.trainer.format.commit import commit_checkpoint
from ckptflow.trainer.format.manifest import ADOPTED, FileEntry, Manifest
from ckptflow.trainer.fsutil import fsync_dir, remove_tree
from ckptflow.trainer.safeopen import NotRegularFileError, copy_fd, file_kind, open_no_links, open_regular

DCP = "dcp"
TORCH_SAVE = "torch_save"
HF_TRAINER = "hf_trainer"
HF_STATE = "trainer_state.json"
"""What the Hugging Face ``Trainer`` writes last into ``checkpoint-N/`` (after the model, optimizer,
scheduler, scaler and RNG states)."""
HF_ARGS = "training_args.bin"
"""The ``Trainer``'s arguments, pickled whole: never parsed (no restricted loader builds them) and
never read when it resumes."""

_SLACK = 64 << 20
"""How much longer than its last item a DCP data file may be before adopt refuses it (with twice its length)."""
_MAX_HF_STATE = 256 << 20  # trainer_state.json: the log history of a long run, never near this

_STEP_IN_NAME = re.compile(r"(?:step|checkpoint|global_step|iter)[-_=]?(\d+)", re.IGNORECASE)


class NotFinished(ConfigError):
    """The source is not a finished checkpoint yet (or is still changing): try again later."""


@dataclass(frozen=True, slots=True)
class SourceFile:
    """One file of a source, as inspection found it: the real path it resolved to (once; symlinks in the
    source included) and the identity of the regular file opened there."""

    path: str
    shown: str
    """The name in the source, as a person would look for it."""
    dev: int
    ino: int
    size: int
    mtime_ns: int
    mode: int
    uid: int
    gid: int

    def open(self) -> int:
        """A descriptor of this very file: opened without following any link (:func:`open_no_links`), and the
        same file (device, inode, size, modification time) inspection looked at, or ``NotFinished``."""
        try:
            fd = open_no_links(self.path)
        except (FileNotFoundError, NotRegularFileError) as e:
            raise NotFinished(f"{self.shown} changed since it was checked ({e}); adopt it when it stays put") from None
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != (self.dev, self.ino, self.size, self.mtime_ns):
            os.close(fd)
            raise NotFinished(
                f"{self.shown} changed since it was checked (replaced, or still being written); adopt it when done"
            )
        return fd


@dataclass(frozen=True, slots=True)
class Source:
    path: str
    format: str
    files: dict[str, SourceFile]
    """Name in the checkpoint -> the file to copy."""
    world_size: int


def step_from_name(path: str) -> int | None:
    """The step a tool put in the name (``step-200``, ``checkpoint-200``, ``epoch=1-step=200.ckpt``,
    ``step_000200``): the last such number, or None."""
    found = _STEP_IN_NAME.findall(os.path.basename(os.path.normpath(path)))
    return int(found[-1]) if found else None


def inspect(path: str) -> Source:
    """What ``path`` is and which files it consists of, once it is finished; raises
    :class:`ConfigError` naming the path and what is missing otherwise (also for a source that is not ours to
    trust: a FIFO or device in it, a symlink to a file of another owner, an unsafe name)."""
    path = os.path.abspath(path)
    try:
        if os.path.isdir(path) and not os.path.exists(os.path.join(path, layout.DCP_METADATA)):
            if os.path.exists(os.path.join(path, HF_STATE)) or _looks_hf(path):
                return _hf_folder(path)
        if os.path.isdir(path):
            return _dcp_folder(path)
        if os.path.lexists(path) and not os.path.isdir(path):
            return _torch_save_file(path)
    except NotFinished:
        raise
    except IntegrityError as e:  # what the source holds is refused: a usage error (exit 2), not a bad checkpoint
        raise ConfigError(f"{path}: not adopting it: {e}") from None
    raise ConfigError(f"{path} does not exist; give the folder or file the other tool wrote")


def _dcp_folder(path: str) -> Source:
    # Every file of the folder, not only those the metadata names: a tool's own beside DCP's
    # (Lightning's sharded folders keep their non-tensor state in meta.pt) belongs to the checkpoint.
    files = _source_files(path)
    return Source(path, DCP, files, _check_dcp(path, files))


def _check_dcp(path: str, files: dict[str, SourceFile] | None = None) -> int:
    """A finished DCP checkpoint in ``path``: its ``.metadata`` parses through the allow-list and
    every file it references is long enough for its items. Returns the saving world size. ``files``: a
    source's files as inspected (what is parsed and measured is what will be copied); else ``path``'s own."""
    from ckptflow.trainer.format.dcpmeta import MAX_METADATA_BYTES, loads_dcp_metadata, read_dcp_metadata

    md_path = os.path.join(path, layout.DCP_METADATA)
    if files is not None and layout.DCP_METADATA not in files or files is None and not os.path.lexists(md_path):
        raise NotFinished(
            f"{path} has no {layout.DCP_METADATA}: not a DCP checkpoint, or one still being written "
            "(DCP writes it last); adopt it once its save has finished"
        )
    try:
        if files is None:
            md = read_dcp_metadata(path)
        else:
            with os.fdopen(files[layout.DCP_METADATA].open(), "rb") as f:
                md = loads_dcp_metadata(f.read(MAX_METADATA_BYTES + 1), source=md_path)
    except IntegrityError as e:
        raise ConfigError(f"{path}: its {layout.DCP_METADATA} is not one DCP wrote ({e}); not adopting it") from None
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel, end in sorted(need.items()):
        try:
            layout.check_member_name(rel)
        except IntegrityError as e:
            raise ConfigError(f"{md_path}: names a data file {rel!r} that is not a plain relative name ({e})") from None
        p = os.path.join(path, *rel.split("/"))
        if files is not None:
            size = files[rel].size if rel in files else -1
        else:
            size = os.path.getsize(p) if os.path.isfile(p) else -1
        if size < end:
            what = "missing" if size < 0 else f"{size} bytes, its items end at {end}"
            raise NotFinished(
                f"{p} is {what}: the checkpoint in {path} is incomplete or still being written; "
                "adopt it once its save has finished"
            )
        if size > 2 * end + _SLACK:
            # DCP's writers end a file with its last item; one many times longer (a terabyte of holes, data
            # appended) is not what DCP wrote, and copying it would take hours for nothing.
            raise ConfigError(
                f"{p} is {size} bytes, but its items end at {end}: not a file DCP wrote (swollen or appended to); "
                "not adopting it"
            )
    ranks = {int(m.group(1)) for rel in need if (m := re.match(r"__(\d+)_", rel))}
    return max(1, len(ranks))


def _source_files(path: str) -> dict[str, SourceFile]:
    """Every file under ``path``, by its "/"-separated name inside it. A symlinked file counts as the file it
    leads to (the Hugging Face cache and deduplicating tools link into a blob store), resolved once here; a
    FIFO, socket or device, a dangling link, a symlinked folder, or a link to a file of another owner that
    others may not read is refused, naming it: a checkpoint is never adopted without one of its files. The
    folder named may itself be a link: then the folder it leads to must be its owner's, or open to anyone."""
    owner = os.lstat(path).st_uid  # whoever controls what was named: the folder, or the link to it
    root = os.path.realpath(path)
    st = os.stat(root)
    if root != path and st.st_uid != owner and (st.st_mode & 0o005) != 0o005:
        raise ConfigError(
            f"{path}: leads to {root}, owned by uid {st.st_uid} and closed to others, while what was named belongs "
            f"to uid {owner}; refusing to copy it into a checkpoint"
        )
    files: dict[str, SourceFile] = {}
    for d, dirs, names in os.walk(root):
        dirs.sort()  # one order, every time: the copy goes file by file in it
        for n in dirs:
            full = os.path.join(d, n)
            if os.path.islink(full):
                raise ConfigError(
                    f"{full}: is a symlinked folder; adopt copies the files of the checkpoint's own folders only "
                    "(link the files, or copy the folder in)"
                )
        for n in sorted(names):
            full = os.path.join(d, n)
            name = os.path.relpath(full, root).replace(os.sep, "/")
            try:
                layout.check_member_name(name)
            except IntegrityError as e:
                raise ConfigError(f"{full}: its name cannot be kept in a checkpoint ({e})") from None
            files[name] = source_file(full, owner)
    if layout.MANIFEST in files:
        raise ConfigError(
            f"{path} holds a {layout.MANIFEST}: it is a ckptflow checkpoint already, not one to adopt; "
            "a committed checkpoint moves between roots with `ckptflow restore`"
        )
    return files


def source_file(full: str, owner: int) -> SourceFile:
    """One file of a source, resolved and looked at (see :func:`_source_files` for what is refused). ``owner``:
    the uid of whoever controls the source (the owner of the folder or link that was named): a file reached
    through a link must be theirs too, or readable by anyone, else copying it would hand it over."""
    try:
        link = os.lstat(full)
        real = os.path.realpath(full)
        looked = os.stat(real)
    except FileNotFoundError:
        if os.path.islink(full):
            raise ConfigError(
                f"{full}: is a dangling symlink (to {os.readlink(full)}); the file it names is gone"
            ) from None
        raise NotFinished(f"{full} vanished while the source was looked at: still being written") from None
    if not stat.S_ISREG(looked.st_mode):  # never opened: a device's open alone can act (a tape rewinds)
        raise ConfigError(f"{full}: is {file_kind(looked.st_mode)}; a checkpoint holds regular files only")
    try:
        fd = open_no_links(real)
    except FileNotFoundError:
        raise NotFinished(f"{full} vanished while the source was looked at: still being written") from None
    except NotRegularFileError as e:
        raise ConfigError(f"{full}: {e}") from None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    through_link = stat.S_ISLNK(link.st_mode) or real != full
    if through_link and st.st_uid != owner and not st.st_mode & stat.S_IROTH:
        # Whoever controls the source could not read the file it names: copying it would hand it over.
        raise ConfigError(
            f"{full}: leads to {real}, owned by uid {st.st_uid} and not readable by others, while the source "
            f"belongs to uid {owner}; refusing to copy it into a checkpoint"
        )
    return SourceFile(
        real, full, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid
    )


def _looks_hf(path: str) -> bool:
    """A Hugging Face checkpoint whose ``trainer_state.json`` has not landed yet."""
    names = set(os.listdir(path))
    return any(n.endswith(".safetensors") or n in ("pytorch_model.bin", "optimizer.pt") for n in names)


def _hf_folder(path: str) -> Source:
    import json

    files = _source_files(path)
    state = files.get(HF_STATE)
    try:
        if state is None:
            raise OSError(HF_STATE)
        with os.fdopen(state.open(), "rb") as f:
            data = f.read(_MAX_HF_STATE + 1)
        if len(data) > _MAX_HF_STATE:
            raise ValueError(f"larger than {_MAX_HF_STATE} bytes")
        json.loads(data)
    except (OSError, ValueError):
        raise NotFinished(
            f"{path} has no readable {HF_STATE}: the Hugging Face Trainer writes it last, so the "
            "checkpoint is still being written (or is not one); adopt it once it is"
        ) from None
    ranks = sum(1 for n in files if re.fullmatch(r"rng_state_\d+\.pth", n))
    return Source(path, HF_TRAINER, files, max(1, ranks))


def _torch_save_file(path: str) -> Source:
    name = os.path.basename(path)
    try:
        layout.check_member_name(name)
    except IntegrityError as e:
        raise ConfigError(f"{path}: its name cannot be kept in a checkpoint ({e})") from None
    sf = source_file(path, os.lstat(path).st_uid)
    try:
        with os.fdopen(sf.open(), "rb") as f, zipfile.ZipFile(f) as z:
            z.infolist()
    except (zipfile.BadZipFile, OSError) as e:
        raise NotFinished(
            f"{path} is not a finished torch.save file ({e}): torch.save writes the zip's directory "
            "last, so it is still being written or not a checkpoint; adopt it once it is complete"
        ) from None
    return Source(path, TORCH_SAVE, {name: sf}, 1)


def adopt(
    path: str,
    *,
    run_id: str,
    root: str,
    step: int | None = None,
    api_url: str | None = None,
) -> dict[str, Any]:
    """Adopt ``path`` as ``run_id`` step ``step`` (from the name when None) under the hot root
    ``root``. Returns the committed record (the outbox line). Adopting the same files again is a
    no-op; other files for a committed step are refused: a committed checkpoint never changes."""
    layout.check_run_id(run_id)
    if step is None:
        step = step_from_name(path)
        if step is None:
            raise ConfigError(f"no step in the name {os.path.basename(path)!r}; give it with --step N")
    if step < 0:
        raise ConfigError(f"step {step} must be >= 0")
    src = inspect(path)

    def copy(tmp: str) -> None:
        for name, sf in src.files.items():
            dest = os.path.join(tmp, *name.split("/"))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with os.fdopen(sf.open(), "rb") as fi:  # the file inspected, not whatever the name leads to now
                # Never wider than the source's mode: a file others could not read stays that way. Owned as the
                # source is when root adopts (root's copy of a user's 0600 file would lock that user out).
                with os.fdopen(os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, sf.mode & 0o666), "wb") as fo:
                    if os.geteuid() == 0:
                        os.fchown(fo.fileno(), sf.uid, sf.gid)
                    n = copy_fd(fi.fileno(), fo)
                after = os.fstat(fi.fileno())
            if n != sf.size or (after.st_size, after.st_mtime_ns) != (sf.size, sf.mtime_ns):
                raise NotFinished(f"{sf.shown} changed while it was copied: still being written; adopt it when done")
            faults.maybe_crash("adopt.copy", step)

    return commit_written(
        run_id=run_id,
        root=root,
        step=step,
        write=copy,
        adopted={"source": src.path, "format": src.format},
        world_size=src.world_size,
        api_url=api_url,
        already=lambda final, run_path: _already(src, run_path, run_id, step, final, api_url),
    )


def commit_written(
    *,
    run_id: str,
    root: str,
    step: int,
    write: Callable[[str], None],
    adopted: dict[str, Any],
    world_size: int,
    api_url: str | None = None,
    already: Callable[[str, str], dict[str, Any]],
) -> dict[str, Any]:
    """Commit the files ``write(folder)`` puts into a fresh staging folder as ``run_id`` step
    ``step`` under ``root``: each made durable and digested, the manifest (``adopted`` records who
    wrote them, with ``format`` for the parse check), the commit, then the outbox line and event.
    When the step is committed already, nothing is written and ``already(final, run_path)`` answers.
    A failure or crash before the commit leaves a staging folder no reader trusts, cleared by the
    next commit of that step. Returns the committed record."""
    layout.check_run_id(run_id)
    run_path = os.path.join(os.path.abspath(root), run_id)
    final = os.path.join(run_path, layout.step_name(step))
    os.makedirs(run_path, exist_ok=True)
    with _run_lock(run_path):  # one commit at a time per run: two writers never share a .tmp
        if RENAME.is_committed(run_path, step):
            return already(final, run_path)
        tmp = RENAME.staging_url(run_path, step)
        remove_tree(tmp)  # an earlier one that crashed: never trusted, started over
        os.makedirs(tmp)
        try:
            write(tmp)
        except BaseException:
            remove_tree(tmp)
            raise
        entries: dict[str, FileEntry] = {}
        folders = set()
        for name, dest in sorted(_staged_files(tmp).items()):
            fd = os.open(dest, os.O_RDONLY)  # read-only: a copy of a read-only file is one too
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            d = digest_file(dest)
            entries[name] = FileEntry(d.size, d.hexdigest(), d.block, d.blocks())
            folders.add(os.path.dirname(dest))
        for folder in folders:
            fsync_dir(folder)
        manifest = Manifest(
            run_id=run_id,
            step=step,
            world_size=world_size,
            files=entries,
            extra={ADOPTED: {**adopted, "adopted_at": time.time()}},
        )
        commit_checkpoint(run_path, manifest)
        return _announce(manifest, run_path, final, api_url)


def _staged_files(tmp: str) -> dict[str, str]:
    """Every file a writer put into the staging folder ``tmp``, by its "/"-separated name (regular files
    only: a writer that left anything else there is refused before a manifest vouches for it)."""
    files: dict[str, str] = {}
    for d, _, names in os.walk(tmp):
        for n in names:
            full = os.path.join(d, n)
            st = os.lstat(full)
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"{full}: is {file_kind(st.st_mode)}; a checkpoint holds regular files only")
            files[layout.check_member_name(os.path.relpath(full, tmp).replace(os.sep, "/"))] = full
    return files


@contextlib.contextmanager
def _run_lock(run_path: str) -> Iterator[None]:
    """An exclusive lock on ``<run>/.adopt.lock`` (``flock``: released by the kernel when the holder
    dies, so a killed adoption never blocks the next)."""
    fd = os.open(os.path.join(run_path, ".adopt.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _already(src: Source, run_path: str, run_id: str, step: int, final: str, api_url: str | None) -> dict[str, Any]:
    from ckptflow.trainer.format.manifest import read_manifest

    m = read_manifest(final)

    def unchanged(name: str, sf: SourceFile) -> bool:
        if m.files[name].size != sf.size:
            return False
        with os.fdopen(sf.open(), "rb") as f:
            return hash_stream(f)[0] == m.files[name].checksum

    same = set(m.files) == set(src.files) and all(unchanged(n, sf) for n, sf in src.files.items())
    if not same:
        raise ConfigError(
            f"{run_id} step {step} is already committed in {final} with other files; a committed "
            "checkpoint never changes — adopt this one under another --step or --run-id"
        )
    for rec in events.read_outbox(run_path):
        if rec.get("step") == step and rec.get("event") == events.COMMITTED:
            return dict(rec, already=True)
    # Committed, but the adoption that did it died before its outbox line: announce it now.
    return dict(_announce(m, run_path, final, api_url), already=True)


def _announce(manifest: Manifest, run_path: str, final: str, api_url: str | None) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "run_id": manifest.run_id,
        "step": manifest.step,
        "uri": final,
        "bytes": manifest.total_bytes,
        "world_size": manifest.world_size,
        "root": os.path.dirname(run_path),
        "scope": "shared",
        "nodes": [],
        "adopted": manifest.extra[ADOPTED]["format"],
    }
    sender = events.EventSender(api_url)
    record = events.announce_commit(run_path, payload, sender)
    sender.close()  # at most its exit budget: the outbox line is the durable record
    return record


def is_adopted(manifest: Manifest) -> bool:
    return ADOPTED in manifest.extra


def parse_check(ckpt_dir: str, manifest: Manifest) -> dict[str, Any]:
    """An adopted checkpoint's check beyond its digests: every file parses without running a
    pickle — DCP's ``.metadata`` through the allow-list (and every item inside its file), a
    ``torch.save`` file through ``torch.load(weights_only=True)``. The verify stage's result for
    the sanity step of a checkpoint that records no probe."""
    fmt = manifest.extra[ADOPTED].get("format")
    problems: list[str] = []
    not_parsed: list[str] = []
    t0 = time.perf_counter()
    if fmt == DCP:
        try:
            _check_dcp(ckpt_dir)  # .metadata through the allow-list; every item inside its file
        except ConfigError as e:
            problems.append(str(e))
    if fmt in (DCP, TORCH_SAVE, HF_TRAINER):
        for name in sorted(manifest.files):
            if fmt == DCP and (name == layout.DCP_METADATA or name.endswith(".distcp")):
                continue  # checked above: DCP's own files
            why = _parse_problem(os.path.join(ckpt_dir, *name.split("/")), name, fmt)
            if why == _NOT_PARSED:
                not_parsed.append(name)
            elif why:
                problems.append(why)
    if fmt not in (DCP, TORCH_SAVE, HF_TRAINER):
        problems.append(f"unknown adopted format {fmt!r}")
    return {
        "ok": not problems,
        "check": "parse",
        "format": fmt,
        "problems": problems,
        "not_parsed": not_parsed,
        "seconds": time.perf_counter() - t0,
    }


_NOT_PARSED = "-"
_TORCH_FILES = (".pt", ".pth", ".bin", ".ckpt")


def _parse_problem(path: str, name: str, fmt: str) -> str | None:
    """What is wrong with one adopted file, parsed without running a pickle: None when it parses,
    ``_NOT_PARSED`` for a file of no format checked here (bytes only: the digests cover it)."""
    import json

    base = name.rsplit("/", 1)[-1]
    try:
        if fmt == HF_TRAINER and base == HF_ARGS:
            return _NOT_PARSED
        if fmt == TORCH_SAVE or base.endswith(_TORCH_FILES):
            from ckptflow.trainer.dcp.planner import restricted_load

            try:
                restricted_load(path, map_location="cpu", mmap=True)
            except Exception as e:  # what the restricted loader refuses is not ours to run
                return f"{name}: the restricted loader refuses it ({type(e).__name__}: {str(e)[:200]})"
            return None
        if base.endswith(".safetensors"):
            return _safetensors_problem(path, name)
        if base.endswith(".json"):
            with open_regular(path) as f:
                json.loads(f.read())
            return None
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        return f"{name}: does not parse ({type(e).__name__}: {str(e)[:200]})"
    return _NOT_PARSED


_ST_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E5M2FNUZ": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E8M0": 8,
    "E8M0": 8,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "F4": 4,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
}
"""Bits per element of each safetensors dtype; a dtype not listed (a newer one) is checked for its form and
its span's place, not its element count."""
_ST_MAX_HEADER = 100 << 20


def _safetensors_problem(path: str, name: str) -> str | None:
    """A safetensors file's header (8-byte length, then a JSON object) checked the way a reader that maps the
    file relies on it: every tensor a ``dtype`` it knows, a ``shape`` of non-negative integers and
    ``data_offsets`` whose span holds exactly that many elements, the spans tiling the data section. Any
    other header (a list, a string where an object belongs, a shape claiming 10^9 elements in 8 bytes) is a
    problem, named, never an exception."""
    import json
    import struct

    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            return f"{name}: shorter than a safetensors header"
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _ST_MAX_HEADER):
            return f"{name}: header length {n} does not fit the file ({size} bytes)"
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        return f"{name}: header is a JSON {type(header).__name__}, not an object: not safetensors"
    spans = []
    for key, v in header.items():
        if key == "__metadata__":
            if not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values()):
                return f"{name}: __metadata__ is not an object of strings"
            continue
        why = _tensor_entry_problem(v)
        if why:
            return f"{name}: tensor {key[:80]!r}: {why}"
        spans.append(tuple(v["data_offsets"]))
    end = 0
    for a, b in sorted(spans):
        if a != end:
            return f"{name}: tensor bytes {a}-{b} do not follow {end}: damaged or not safetensors"
        end = b
    if 8 + n + end != size:
        return f"{name}: {size} bytes, its header accounts for {8 + n + end}"
    return None


def _tensor_entry_problem(v: Any) -> str | None:
    """What is wrong with one tensor's header entry (None: a dtype, shape and span that agree)."""
    if not isinstance(v, dict):
        return f"entry is a JSON {type(v).__name__}, not an object"
    dtype, shape, offs = v.get("dtype"), v.get("shape"), v.get("data_offsets")
    if not isinstance(dtype, str) or not re.fullmatch(r"[A-Z][A-Z0-9_]{0,31}", dtype):
        return f"dtype {str(dtype)[:20]!r} is not a dtype name"
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        return f"shape {str(shape)[:60]} is not a list of non-negative integers"
    if (
        not isinstance(offs, list)
        or len(offs) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
        or not 0 <= offs[0] <= offs[1]
    ):
        return f"data_offsets {str(offs)[:60]} is not [begin, end] with 0 <= begin <= end"
    if dtype not in _ST_BITS:
        return None
    bits = _ST_BITS[dtype]
    for d in shape:
        bits *= d
    if (bits + 7) // 8 != offs[1] - offs[0]:
        return f"shape {shape} of {dtype} needs {(bits + 7) // 8} bytes, its data_offsets span {offs[1] - offs[0]}"
    return None


def watch(
    folder: str,
    *,
    run_id: str,
    root: str,
    poll_s: float = 10.0,
    api_url: str | None = None,
    stop: threading.Event | None = None,
    report: Callable[[str, dict[str, Any] | None, str | None], None] = lambda path, rec, err: None,
) -> None:
    """Adopt every finished checkpoint that appears in ``folder`` (each entry whose name carries a
    step: ``step-200/``, ``epoch=1-step=200.ckpt``), polling every ``poll_s`` seconds until
    ``stop`` is set. One not finished yet (no ``.metadata``, an incomplete zip) is looked at
    again at the next poll; one refused for another reason (other files for a committed step) is
    reported once and left alone. ``report(path, record, error)`` is called for each outcome."""
    stop = stop or threading.Event()
    done: set[str] = set()
    run_path = os.path.join(os.path.abspath(root), run_id)
    while True:
        committed = set(RENAME.committed_steps(run_path))
        try:
            names = sorted(os.listdir(folder))
        except FileNotFoundError:
            names = []
        for name in names:
            path = os.path.join(folder, name)
            step = step_from_name(name)
            if path in done or step is None or name.endswith((".tmp", ".partial")):
                continue
            if step in committed:
                done.add(path)  # adopted earlier (or by another watcher): nothing to do
                continue
            try:
                report(path, adopt(path, run_id=run_id, root=root, step=step, api_url=api_url), None)
            except NotFinished:
                continue  # looked at again at the next poll
            except (ConfigError, OSError) as e:  # refused for good, or gone: said once, left alone
                report(path, None, str(e))
            done.add(path)
        if stop.wait(poll_s):
            return
