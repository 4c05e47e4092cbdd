"""Generated hostile trees: every command that reads a checkpoint or a tier, on trees a seeded generator
damaged the way an attacker or a clumsy operator would.

A golden setup (the tiny run's steps 2, 4, 6 on hot; 4 and 6 promoted to warm as zstd; a DCP folder and a
Hugging Face folder another tool wrote; a codec-compressed copy of a step) is copied per tree, and two to
four mutations are drawn from :data:`MUTATIONS` by the tree's seed: FIFOs, devices, symlinks in and out of a
checkpoint, dangling links, sparse and truncated files, folders where files belong, odd names, a code-running
or a bomb ``.metadata`` with the unsigned manifest rewritten to vouch for it, a 65 MB manifest, malformed
safetensors headers, a ``latest`` that is a FIFO, a folder, a device or garbage, a phantom empty step, a warm
tier configured as the hot folder under another name.

Then each command runs as the console script runs it (a forked child with a time limit; the trainer's resume
and the lifecycle's verify and promote as their functions), and must:
finish within its bound; exit with a documented code (0 or 1 with no traceback, or 2, 3, 4 with exactly one
``ckptflow: error:`` line); write nothing outside what it was asked to write (every other path of the tree
keeps its kind, size, mode and modification time); never run a pickle (no marker appears); restore only a
checkpoint that verifies; and adopt only with every file of the source, content included.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from ckptflow.trainer.format import layout
from ckptflow.trainer.format.checksum import hash_file
from tests.helpers import Ran, forked, forked_cli, pickle_bomb

ROOT = os.geteuid() == 0
RUN = "tiny"
SEEDS = range(16)
BOUND_S = 45.0
"""Every command on these 2 MB checkpoints finishes in well under a second or two; a minute means a hang."""


class _Mkdir:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


@dataclass
class Tree:
    base: str
    rng: random.Random
    done: list[str] = field(default_factory=list)
    config_text: str = ""

    @property
    def hot(self) -> str:
        return os.path.join(self.base, "hot")

    @property
    def run(self) -> str:
        return os.path.join(self.hot, RUN)

    def step(self, s: int) -> str:
        return os.path.join(self.run, layout.step_name(s))

    @property
    def warm_step(self) -> str:
        return os.path.join(self.base, "warm", RUN, layout.step_name(6))

    @property
    def marker(self) -> str:
        return os.path.join(self.base, "pwned")

    def target(self) -> str:
        """A file to damage: a member of hot step 6, of warm step 6, or of a source another tool wrote."""
        folder = self.rng.choice([self.step(6), self.step(6), self.warm_step, os.path.join(self.base, "src-dcp")])
        names = sorted(n for n in os.listdir(folder) if not os.path.islink(os.path.join(folder, n)))
        return os.path.join(folder, self.rng.choice(names))


def _replace(path: str, make: Callable[[str], None]) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)
    make(path)


def _rewrite_manifest(step: str, name: str) -> None:
    """The unsigned manifest made to vouch for ``name`` as it is now (unless an earlier mutation broke it)."""
    from ckptflow.trainer.safeopen import read_small

    mpath = os.path.join(step, layout.MANIFEST)
    try:
        d = json.loads(read_small(mpath, 1 << 20))
        digest, size = hash_file(os.path.join(step, name))
    except (OSError, ValueError):
        return
    d["files"][name] = {"size": size, "checksum": digest}
    with open(mpath, "w") as f:
        json.dump(d, f)


def m_fifo(t: Tree) -> str:
    p = t.target()
    _replace(p, os.mkfifo)
    return f"fifo {p}"


def m_device(t: Tree) -> str:
    p = t.target()
    if ROOT and t.rng.random() < 0.5:
        _replace(p, lambda q: os.mknod(q, 0o644 | stat.S_IFCHR, os.makedev(1, 5)))  # /dev/zero's numbers
        return f"chardev {p}"
    _replace(p, lambda q: os.symlink("/dev/zero", q))
    return f"link to /dev/zero {p}"


def m_symlink_out(t: Tree) -> str:
    p = t.target()
    outside = os.path.join(t.base, "outside-" + os.path.basename(p))
    if os.path.isfile(p):
        shutil.copy(p, outside)
    _replace(p, lambda q: os.symlink(outside, q))
    return f"symlink out {p}"


def m_symlink_in(t: Tree) -> str:
    p = t.target()
    sibling = sorted(n for n in os.listdir(os.path.dirname(p)) if n != os.path.basename(p))[0]
    _replace(p, lambda q: os.symlink(sibling, q))
    return f"symlink in {p} -> {sibling}"


def m_dangling(t: Tree) -> str:
    p = t.target()
    _replace(p, lambda q: os.symlink(os.path.join(t.base, "nowhere"), q))
    return f"dangling {p}"


def m_truncate(t: Tree) -> str:
    p = t.target()
    if os.path.isfile(p):
        with open(p, "r+b") as f:
            f.truncate(os.path.getsize(p) // 2)
    return f"truncate {p}"


def m_sparse(t: Tree) -> str:
    p = t.target()
    if os.path.isfile(p) and not os.path.islink(p):
        with open(p, "r+b") as f:
            f.truncate(1 << 40)  # a terabyte of holes: reading it would take for ever
    return f"sparse 1 TiB {p}"


def m_folder(t: Tree) -> str:
    p = t.target()
    _replace(p, os.mkdir)
    return f"folder {p}"


def m_odd_names(t: Tree) -> str:
    folder = t.rng.choice([t.step(6), os.path.join(t.base, "src-dcp"), os.path.join(t.base, "src-hf")])
    for name in ("a\nb", "ü-\u202e", "x" * 250, "-rf", "...", " lead"):
        _write(os.path.join(folder, name), b"odd")
    return f"odd names in {folder}"


def _write(path: str, data: bytes) -> None:
    """``data`` as a new regular file at ``path``, whatever an earlier mutation left there (a FIFO: never
    opened for writing, which would wait for a reader)."""

    def make(q: str) -> None:
        with open(q, "wb") as f:
            f.write(data)

    _replace(path, make)


def m_evil_metadata(t: Tree) -> str:
    step = t.rng.choice([t.step(6), t.step(4)])
    _write(os.path.join(step, layout.DCP_METADATA), pickle.dumps(_Mkdir(t.marker)))
    _rewrite_manifest(step, layout.DCP_METADATA)
    _write(os.path.join(t.base, "src-dcp", layout.DCP_METADATA), pickle.dumps(_Mkdir(t.marker)))
    return f"code-running .metadata in {step} (manifest rewritten) and in the DCP source"


def m_bomb_metadata(t: Tree) -> str:
    step = t.step(6)
    _write(os.path.join(step, layout.DCP_METADATA), pickle_bomb())
    _rewrite_manifest(step, layout.DCP_METADATA)
    _write(os.path.join(t.base, "src-dcp", layout.DCP_METADATA), pickle_bomb())
    return f"pickle bomb .metadata in {step} (manifest rewritten) and in the DCP source"


def m_huge_manifest(t: Tree) -> str:
    p = os.path.join(t.step(6), layout.MANIFEST)

    def make(q: str) -> None:
        with open(q, "wb") as f:
            f.truncate(65 << 20)

    _replace(p, make)
    return f"65 MB manifest {p}"


def m_latest(t: Tree) -> str:
    p = os.path.join(t.run, layout.LATEST)
    kind = t.rng.choice(["fifo", "folder", "devzero", "garbage"])
    if kind == "fifo":
        _replace(p, os.mkfifo)
    elif kind == "folder":
        _replace(p, os.mkdir)
    elif kind == "devzero":
        _replace(p, lambda q: os.symlink("/dev/zero", q))
    else:
        _write(p, os.urandom(4096))
    return f"latest is {kind}"


def m_safetensors(t: Tree) -> str:
    p = os.path.join(t.base, "src-hf", "model.safetensors")
    header = t.rng.choice(
        [b'"s"', b"[1]", b'{"w": 3}', b'{"w": {"dtype": "F32", "shape": [1000000000], "data_offsets": [0, 8]}}']
    )
    _write(p, len(header).to_bytes(8, "little") + header + b"\0" * 8)
    return f"malformed safetensors header {header!r}"


def m_phantom_step(t: Tree) -> str:
    os.mkdir(t.step(99))
    return "empty step_000000099 (committed by name, no manifest)"


def m_step_link(t: Tree) -> str:
    """Hot step 6's folder replaced by a symlink to a copy elsewhere: never a checkpoint this tier committed."""
    outside = os.path.join(t.base, "outside-step6")
    shutil.move(t.step(6), outside)
    os.symlink(outside, t.step(6))
    return "hot step 6 is a symlink to a copy outside the tier"


def m_overlap(t: Tree) -> str:
    os.symlink(t.hot, os.path.join(t.base, "alias"))
    t.config_text = t.config_text.replace(os.path.join(t.base, "warm"), os.path.join(t.base, "alias"))
    return "warm configured as the hot folder through a symlink"


MUTATIONS = [
    m_fifo,
    m_device,
    m_symlink_out,
    m_symlink_in,
    m_dangling,
    m_truncate,
    m_sparse,
    m_folder,
    m_odd_names,
    m_evil_metadata,
    m_bomb_metadata,
    m_huge_manifest,
    m_latest,
    m_safetensors,
    m_phantom_step,
    m_step_link,
    m_overlap,
]


@pytest.fixture(scope="module")
def golden(tiny_run, tmp_path_factory):
    """The setup every tree starts from (read-only: each tree copies it)."""
    import torch
    from safetensors.torch import save_file

    from ckptflow.tasks.codec.tool import compress_dir
    from ckptflow.tasks.config import load_config
    from ckptflow.tasks.storage import Tier
    from ckptflow.tasks.transfer import promote

    base = str(tmp_path_factory.mktemp("golden"))
    shutil.copytree(tiny_run, os.path.join(base, "hot", RUN))
    text = _config_text(base)
    with open(os.path.join(base, "ckptflow.toml"), "w") as f:
        f.write(text)
    cfg = load_config(os.path.join(base, "ckptflow.toml"))
    for s in (4, 6):
        promote(Tier(cfg.hot), Tier(cfg.warm), RUN, s)
    src = os.path.join(base, "src-dcp")
    shutil.copytree(os.path.join(tiny_run, layout.step_name(6)), src)
    os.unlink(os.path.join(src, layout.MANIFEST))
    hf = os.path.join(base, "src-hf")
    os.makedirs(hf)
    save_file({"w": torch.arange(4, dtype=torch.float32)}, os.path.join(hf, "model.safetensors"))
    with open(os.path.join(hf, "trainer_state.json"), "w") as f:
        json.dump({"global_step": 7}, f)
    compress_dir(os.path.join(base, "hot", RUN, layout.step_name(4)), os.path.join(base, "zipped"), codec="zstd")
    # The bomb, refused once here: the commands forked from this process find the verdict in the parse's
    # cache instead of each spending its second of CPU (tests/unit/test_dcpmeta.py times the refusal itself)
    from ckptflow.trainer.errors import IntegrityError
    from ckptflow.trainer.format.dcpmeta import loads_dcp_metadata

    with pytest.raises(IntegrityError, match="pickle bomb"):
        loads_dcp_metadata(pickle_bomb(), source="warm-up")
    return base


def _config_text(base: str) -> str:
    return (
        f'[hot]\nurl = "{base}/hot"\n[hot.retention]\nkeep_last = 2\n'
        f'[warm]\nurl = "{base}/warm"\ncodec = "zstd"\n[warm.retention]\nkeep_last = 1\n'
    )


def _snapshot(base: str) -> dict[str, tuple]:
    """Every path under ``base`` with what a write would change: kind, size, mode, modification time (of a
    folder only its kind and mode: an entry added or removed in it shows as that entry)."""
    out = {}
    for d, dirs, files in os.walk(base):
        for n in dirs + files:
            p = os.path.join(d, n)
            st = os.lstat(p)
            kind = stat.S_IFMT(st.st_mode)
            out[p] = (kind, stat.S_IMODE(st.st_mode)) + (() if stat.S_ISDIR(kind) else (st.st_size, st.st_mtime_ns))
    return out


def _changed(before: dict, after: dict) -> set[str]:
    return {p for p in before.keys() | after.keys() if before.get(p) != after.get(p)}


def _check_exit(name: str, r: Ran, codes: set[int]) -> None:
    assert not r.hung, f"{name} hung (killed after {BOUND_S} s)"
    assert r.code in codes, f"{name}: exit {r.code}, expected one of {sorted(codes)}\n{r.out[-1500:]}\n{r.err[-1500:]}"
    assert "Traceback" not in r.err and "forked:" not in r.err, f"{name} raised:\n{r.err[-3000:]}"
    if r.code not in (0, 1):
        r.one_line_error()


def _resume(run: str) -> int:
    from ckptflow.trainer.resume import find_resume_point

    rep = find_resume_point(run, deep=True)
    print(json.dumps({"step": rep.chosen.step if rep.chosen else None}))
    return 0


def _promote(cfg_path: str, out: str) -> int:
    """The lifecycle's promote of hot step 6 onto a tier of its own (bytegroup: the dtype maps read the data
    files too); a refusal is a ckptflow error, anything else escapes and fails the tree."""
    from ckptflow.tasks.config import TierConfig, load_config
    from ckptflow.tasks.storage import Tier
    from ckptflow.tasks.transfer import promote
    from ckptflow.trainer.errors import CkptflowError

    dst = Tier(TierConfig(name="scratch", url=out, codec="bytegroup"))
    try:
        promote(Tier(load_config(cfg_path).hot), dst, RUN, 6)
    except CkptflowError as e:
        print(e)
        return 1
    return 0


def _lifecycle_verify(cfg_path: str, step: int) -> int:
    from ckptflow.tasks.checkpoint import CheckpointRef
    from ckptflow.tasks.config import load_config
    from ckptflow.tasks.verify import verify

    out = verify(CheckpointRef(load_config(cfg_path), RUN, step), sanity_step=False, expectations=False)
    print(json.dumps({"ok": out.ok, "reasons": out.reasons}))
    return 0


@pytest.mark.parametrize("seed", SEEDS)
def test_every_command_on_a_hostile_tree_ends_cleanly_and_writes_only_its_destination(golden, tmp_path, seed):
    from ckptflow.trainer.format.dcpmeta import read_dcp_metadata
    from ckptflow.trainer.format.manifest import read_manifest
    from ckptflow.trainer.verify import verify_checkpoint

    base = str(tmp_path / "t")
    shutil.copytree(golden, base, symlinks=True)
    t = Tree(base, random.Random(seed), config_text=_config_text(base))
    for m in t.rng.sample(MUTATIONS, t.rng.randint(2, 4)):
        t.done.append(m(t))
    cfg = os.path.join(base, "ckptflow.toml")
    with open(cfg, "w") as f:
        f.write(t.config_text)
    env = {"CKPTFLOW_CONFIG": cfg}
    what = f"seed {seed}: " + "; ".join(t.done)
    out = os.path.join(str(tmp_path), "out")  # every destination lives outside the tree
    os.makedirs(out)
    bad_config = any(d.startswith("warm configured") for d in t.done)
    cfg_codes = {4} if bad_config else set()

    read_only: list[tuple[str, list[str], set[int]]] = [
        ("verify hot 6", ["verify", t.step(6)], {0, 1, 3}),
        ("verify hot 4", ["verify", t.step(4)], {0, 1, 3}),
        ("ls", ["ls", "--json"], {0, 4} | cfg_codes),
        ("ls root", ["ls", t.hot], {0, 3, 4} | cfg_codes),
        ("prune dry run", ["prune", RUN, "--dry-run"], {0, 4} | cfg_codes),
    ]
    for name, argv, codes in read_only:
        before = _snapshot(base)
        r = forked_cli(argv, env=env, timeout=BOUND_S)
        _check_exit(f"{what} | {name}", r, codes)
        assert not _changed(before, _snapshot(base)), f"{what} | {name} wrote into the tree"

    for name, fn, codes in (
        ("trainer resume", lambda: _resume(t.run), {0}),
        ("lifecycle verify", lambda: _lifecycle_verify(cfg, 6), {0}),
        ("lifecycle promote", lambda: _promote(cfg, os.path.join(out, "promoted")), {0, 1}),
    ):
        before = _snapshot(base)
        r = forked(fn, env=env, timeout=BOUND_S)
        if name.startswith("lifecycle") and bad_config:  # the config refused as it is read
            assert r.code in (1, 99) and "same place" in r.out + r.err, f"{what} | {name}: {r.err[-1500:]}"
        else:
            _check_exit(f"{what} | {name}", r, codes)
        assert not _changed(before, _snapshot(base)), f"{what} | {name} wrote into the tree"

    writers: list[tuple[str, list[str], set[int], str, set[str]]] = [
        ("restore", ["restore", RUN, "--to", f"{out}/restored"], {0, 1, 3, 4} | cfg_codes, f"{out}/restored", set()),
        ("export", ["export", t.step(6), f"{out}/export"], {0, 1, 4} | cfg_codes, f"{out}/export", set()),
        ("compress", ["compress", t.step(6), f"{out}/z", "--codec", "zstd"], {0, 1, 2, 3, 4}, f"{out}/z", set()),
        ("decompress", ["decompress", f"{base}/zipped", f"{out}/unz"], {0, 1, 2, 3, 4}, f"{out}/unz", set()),
        ("adopt dcp", ["adopt", f"{base}/src-dcp", "--run-id", "adopted", "--step", "5"], {0, 2, 4}, "", set()),
        ("adopt hf", ["adopt", f"{base}/src-hf", "--run-id", "adopted", "--step", "7"], {0, 2, 4}, "", set()),
        ("prune", ["prune", RUN], {0, 4} | cfg_codes, "", set()),
    ]
    for name, argv, codes, dest, _ in writers:
        before = _snapshot(base)
        r = forked_cli(argv, env=env, timeout=BOUND_S)
        _check_exit(f"{what} | {name}", r, codes)
        changed = _changed(before, _snapshot(base))
        allowed = {
            "restore": [os.path.join(t.run, layout.LEASES_DIR), os.path.join(base, "warm", RUN, layout.LEASES_DIR)],
            "adopt dcp": [os.path.join(t.hot, "adopted")],
            "adopt hf": [os.path.join(t.hot, "adopted")],
            "prune": [t.run, os.path.join(base, "warm", RUN)],
        }.get(name, [])
        stray = {p for p in changed if not any(p == a or p.startswith(a + os.sep) for a in allowed)}
        assert not stray, f"{what} | {name} wrote outside its destination: {sorted(stray)[:5]}"
        if dest and r.code != 0:
            assert not os.path.lexists(dest), f"{what} | {name} failed but left {dest}"
            assert not [n for n in os.listdir(out) if ".part-" in n], f"{what} | {name} left a partial folder"
        if name == "restore" and r.code == 0:
            v = verify_checkpoint(dest)
            assert v.ok, f"{what} | restore produced a checkpoint that does not verify: {v.problems}"
            read_dcp_metadata(dest)
        if name.startswith("adopt") and r.code == 0:
            src = f"{base}/src-{name.split()[1]}"
            step = 5 if name == "adopt dcp" else 7
            m = read_manifest(os.path.join(t.hot, "adopted", layout.step_name(step)))
            want = {}
            for d, _, names in os.walk(src):
                for n in names:
                    p = os.path.join(d, n)
                    want[os.path.relpath(p, src)] = hash_file(p)[0]
            got = {n: e.checksum for n, e in m.files.items()}
            assert got == want, f"{what} | {name} committed without every source file's content"
    assert not os.path.exists(t.marker), f"{what}: a pickle ran"
