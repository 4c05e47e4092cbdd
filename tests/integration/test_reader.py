"""The verified load (``trainer/dcp/reader.py``): block digests, copies as blocks match, fallbacks.

One real process (world size 1, gloo) saves through ``CheckpointManager`` with small blocks
(4 KiB, so a tiny model spans dozens), then loads into freshly initialised objects and compares
every tensor bitwise: after a clean save, after a flipped byte in the middle of the newest
checkpoint (the load fails on that block *after* copying the blocks before it, falls back, and the
older checkpoint's load overwrites them all), with a manifest from before block digests, and with
a block digest edited while the file's own checksum still matches.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from ckptflow.trainer.errors import ManifestError
from ckptflow.trainer.format.checksum import MAX_BLOCKS, MIN_BLOCK, FileDigest, block_digest, block_size_for
from ckptflow.trainer.format.manifest import FileEntry, Manifest
from tests.helpers import run_script, script_result

SCRIPT = textwrap.dedent("""
    import json, os, shutil, sys
    import torch
    from ckptflow.trainer.format import checksum
    checksum.MIN_BLOCK = 4096  # dozens of blocks for a tiny model
    from ckptflow.trainer.config import CheckpointConfig, Provenance
    from ckptflow.trainer.checkpointer import CheckpointManager
    from ckptflow.trainer.distenv import init_distributed

    env = init_distributed()
    root = os.environ["ROOT"]

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(64, 96)                                     # spans several blocks
            self.t = torch.nn.Parameter(torch.randn(40, 24).t())                 # strided: saved as such
            self.h = torch.nn.Parameter(torch.randn(33, dtype=torch.float64))    # odd size, another dtype
            self.register_buffer("n", torch.arange(7, dtype=torch.int16))
            self.register_buffer("s", torch.tensor(3.5))                         # 0-dim

        def forward(self, x):
            return self.a(x).sum() + (self.t * 2).sum() + self.h.sum()

    def build(seed):
        torch.manual_seed(seed)
        m = M()
        return m, torch.optim.Adam(m.parameters(), lr=0.01)

    def snapshot(m, o):
        sd = {k: v.detach().clone() for k, v in m.state_dict().items()}
        for i, st in o.state_dict()["state"].items():
            sd |= {f"opt.{i}.{k}": v.clone() for k, v in st.items() if torch.is_tensor(v)}
        return sd

    def manager(m, o, run="r"):
        return CheckpointManager(
            CheckpointConfig(root=root, run_id=run, interval=1, emit_events=False),
            model=m, optimizer=o, provenance=Provenance(config={"a": 1}, data_fingerprint="d"), env=env)

    def load_into(run="r"):
        m, o = build(99)
        o.zero_grad(); m(torch.ones(64)).backward(); o.step()  # Adam state to fill (values differ)
        ck = manager(m, o, run)
        step = ck.load()
        ck.close()
        return step, snapshot(m, o), ck.last_load

    def same(a, b):
        assert a.keys() == b.keys(), (sorted(a), sorted(b))
        bad = [k for k in a if not (a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]))]
        assert not bad, f"differ: {bad}"

    m, o = build(0)
    ck = manager(m, o)
    snaps = {}
    for step in (1, 2):
        o.zero_grad(); m(torch.randn(64)).backward(); o.step()
        snaps[step] = snapshot(m, o)
        ck.save(step)
    ck.close()
    out = {}
    run = os.path.join(root, "r")
    d2 = os.path.join(run, "step_000000002")
    data = os.path.join(d2, sorted(n for n in os.listdir(d2) if n.endswith(".distcp"))[0])
    mf = json.load(open(os.path.join(d2, "manifest.json")))
    e = mf["files"][os.path.basename(data)]
    raw = open(data, "rb").read()
    out["blocks"] = len(e["blocks"]) // 16
    out["block_size"] = e["block_size"]
    out["blocks_match"] = e["blocks"] == "".join(
        checksum.block_digest(raw[i:i + 4096]) for i in range(0, len(raw), 4096))
    assert not m.t.is_contiguous()

    # 1. a clean load, into objects initialised otherwise
    step, got, _ = load_into()
    assert step == 2
    same(got, snaps[2])

    # 2. a flipped byte in the middle of the newest checkpoint: its load copies the blocks before
    #    the bad one, fails on it, falls back; step 1's load then overwrites every destination
    shutil.copytree(run, os.path.join(root, "flip"))
    f2 = os.path.join(root, "flip", "step_000000002", os.path.basename(data))
    from ckptflow.trainer.format.dcpmeta import read_dcp_metadata
    where = next(v for k, v in read_dcp_metadata(d2).storage_data.items() if k.fqn == "model.a.weight")
    assert where.relative_path == os.path.basename(data)
    out["flip_block"] = (where.offset + where.length // 2) // 4096
    with open(f2, "r+b") as f:
        f.seek(where.offset + where.length // 2)  # inside the weight's data, past several blocks
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    shutil.copytree(os.path.join(root, "flip"), os.path.join(root, "flip2"))  # for the Python loop, in 7
    step, got, last = load_into("flip")
    assert step == 1, step
    same(got, snaps[1])
    out["flip_reason"] = " ".join(w for _, w in last.skipped)
    # damaged means no longer committed: the resume that went on from step 1 set step 2 aside
    assert [n.split(".")[0] for n in os.listdir(os.path.join(root, "flip", "_damaged"))] == ["step_000000002"]

    # 3. a manifest written before block digests: the file is verified whole, then copied
    shutil.copytree(run, os.path.join(root, "old"))
    p = os.path.join(root, "old", "step_000000002", "manifest.json")
    old = json.load(open(p))
    for v in old["files"].values():
        v.pop("block_size"); v.pop("blocks")
    open(p, "w").write(json.dumps(old))
    step, got, _ = load_into("old")
    assert step == 2
    same(got, snaps[2])

    # 4. a block digest edited, the file's own checksum intact: the blocks are what the load trusts
    shutil.copytree(run, os.path.join(root, "edit"))
    p = os.path.join(root, "edit", "step_000000002", "manifest.json")
    ed = json.load(open(p))
    fe = ed["files"][os.path.basename(data)]
    k = 3 * 16
    fe["blocks"] = fe["blocks"][:k] + ("0" if fe["blocks"][k] != "0" else "1") + fe["blocks"][k + 1:]
    open(p, "w").write(json.dumps(ed))
    step, got, last = load_into("edit")
    assert step == 1, step
    same(got, snaps[1])
    out["edit_reason"] = " ".join(w for _, w in last.skipped)

    # 5. warm files (all of these are in the page cache now): their items are located in batches
    #    while the threads verify, each batch's copies scheduled before the next is located
    from ckptflow.fast import reader
    reader.LOCATE_BATCH = 2
    batches = []
    locate = reader.FastReader._locate
    def spy(self, per_file, *args):
        batches.append(sum(len(v) for v in per_file.values()))
        return locate(self, per_file, *args)
    reader.FastReader._locate = spy
    step, got, _ = load_into()
    assert step == 2
    same(got, snaps[2])
    out["warm_batches"] = batches[:]

    # 6. a zip record damaged in a warm file: reported as the block that does not match (not as the
    #    parse it broke), and the load falls back
    shutil.copytree(run, os.path.join(root, "rec"))
    f6 = os.path.join(root, "rec", "step_000000002", os.path.basename(data))
    with open(f6, "r+b") as f:
        f.seek(where.offset + 26)  # the local header's name length: the item no longer parses
        f.write(bytes([0xFF]))
    batches.clear()
    step, got, last = load_into("rec")
    assert step == 1, step
    same(got, snaps[1])
    out["record_reason"] = " ".join(w for _, w in last.skipped)
    out["record_block"] = (where.offset + 26) // 4096

    # 7. the C extension verified every run of blocks above, one call each; without it (an install
    #    with no C compiler) the Python loop verifies block after block, with the same results
    from ckptflow.fast import memcopy
    reader.FastReader._locate = locate
    runs = []
    native = reader.verify_run
    reader.verify_run = lambda run, sched: runs.append(len(run)) or native(run, sched)
    step, got, _ = load_into()
    assert step == 2
    same(got, snaps[2])
    out["native_runs"] = list(runs) if memcopy.VERIFY_COPY else None
    memcopy.VERIFY_COPY = False
    runs.clear()
    step, got, _ = load_into()
    assert step == 2 and not runs
    same(got, snaps[2])
    step, got, last = load_into("flip2")
    assert step == 1, step
    same(got, snaps[1])
    out["python_flip_reason"] = " ".join(w for _, w in last.skipped)
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = tmp_path_factory.mktemp("reader")
    r = run_script(SCRIPT, {"ROOT": str(root)})
    assert r.returncode == 0, r.stderr[-4000:]
    return script_result(r.stdout)


def test_block_digests_are_recorded_as_the_files_are_written(result):
    assert result["block_size"] == 4096 and result["blocks"] > 10
    assert result["blocks_match"]


def test_a_flipped_byte_fails_its_block_and_the_fallback_overwrites_what_was_copied(result):
    # The byte sits inside a weight's data: the blocks before it matched and were copied first.
    assert result["flip_block"] > 1
    assert f"(block {result['flip_block']})" in result["flip_reason"] and "checksum" in result["flip_reason"]
    assert "FrameSummary" not in result["flip_reason"]  # the rank's own error, not DCP's wrapping


def test_an_edited_block_digest_is_refused_though_the_file_checksum_matches(result):
    assert "block 3" in result["edit_reason"]


def test_warm_files_are_located_in_batches_while_their_blocks_are_verified(result):
    batches = result["warm_batches"]
    assert len(batches) > 3 and max(batches) <= 2, batches


def test_a_damaged_zip_record_in_a_warm_file_fails_its_block_not_the_parse(result):
    assert f"(block {result['record_block']})" in result["record_reason"], result["record_reason"]
    assert "checksum" in result["record_reason"]


def test_runs_of_blocks_are_verified_in_one_call_each_and_the_python_loop_matches_them(result):
    if result["native_runs"] is None:
        pytest.skip("the C extension is not built here")
    assert sum(result["native_runs"]) >= result["blocks"] and max(result["native_runs"]) > 1
    assert f"(block {result['flip_block']})" in result["python_flip_reason"]


def test_file_digest_splits_any_writes_at_block_boundaries():
    data = os.urandom(10_000)
    d = FileDigest(block=4096)
    for i in range(0, len(data), 777):
        d.update(data[i : i + 777])
    assert d.size == len(data)
    assert d.blocks() == "".join(block_digest(data[i : i + 4096]) for i in range(0, len(data), 4096))
    exact = FileDigest(block=4096)
    exact.update(data[:8192])
    assert len(exact.blocks()) == 2 * 16  # no empty block after a boundary


def test_block_size_bounds_the_manifest():
    assert block_size_for(0) == MIN_BLOCK
    assert block_size_for(MIN_BLOCK * MAX_BLOCKS) == MIN_BLOCK
    for n in (MIN_BLOCK * MAX_BLOCKS + 1, 3 << 30, 40 << 30):
        b = block_size_for(n)
        assert -(-n // b) <= MAX_BLOCKS and b & (b - 1) == 0


def _manifest(entry: dict) -> bytes:
    m = Manifest(
        run_id="r", step=1, world_size=1, files={".metadata": FileEntry(3, "aa"), "__0_0.distcp": FileEntry(1, "bb")}
    )
    d = json.loads(m.to_json(key=b""))
    d["files"]["__0_0.distcp"] = entry
    return json.dumps(d).encode()


def test_manifest_block_digests_round_trip_and_malformed_ones_are_refused():
    good = {"size": 5000, "checksum": "cc", "block_size": 4096, "blocks": "0123456789abcdef" * 2}
    m = Manifest.from_json(_manifest(good), source="m", key=b"")
    e = m.files["__0_0.distcp"]
    assert e.block_digests() == ["0123456789abcdef"] * 2
    assert json.loads(m.to_json(key=b""))["files"]["__0_0.distcp"] == good
    assert "block_size" not in json.loads(m.to_json(key=b""))["files"][".metadata"]  # none recorded: none written
    for bad in (
        good | {"blocks": "0123456789abcdef"},  # one digest short
        good | {"blocks": "0123456789abcdeg" * 2},  # not hex
        good | {"block_size": 1000},  # not a page multiple
        good | {"block_size": 0},
        {"size": 5000, "checksum": "cc", "blocks": "0123456789abcdef" * 2},  # no block size
    ):
        with pytest.raises(ManifestError, match="block digests"):
            Manifest.from_json(_manifest(bad), source="m", key=b"")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _file_with_blocks(tmp_path, nbytes: int, block: int):  # noqa: ANN001, ANN202
    """A real file, mapped, and its blocks with their digests (as ``blocks_of`` builds them)."""
    import mmap

    from ckptflow.trainer.dcp.reader import Block

    data = os.urandom(nbytes)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    blocks = [
        Block("f.bin", k, a, min(a + block, nbytes), block_digest(data[a : a + block]))
        for k, a in enumerate(range(0, nbytes, block))
    ]
    return data, path, mapped, blocks


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not _cuda(), reason="no CUDA device"))]
"""Host destinations, and CUDA ones (staged in pinned memory, copied asynchronously) where there is a GPU."""


@pytest.mark.parametrize("device", DEVICES)
def test_copies_added_before_or_after_their_blocks_matched_copy_only_matched_bytes(tmp_path, device):
    """``Schedule.add`` may come before a block's match or after it (a cold file's items are
    located behind its stream): a piece runs at whichever comes second, never before its block
    matched, and every copy ends whole — also a strided one spanning blocks."""
    import torch

    from ckptflow.fast.verifiedcopy import Schedule, run_pieces
    from ckptflow.trainer.dcp.reader import Copy

    data, _, mapped, blocks = _file_with_blocks(tmp_path, 4096 * 6, 4096)
    src = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    dst = torch.zeros(4096 * 5, dtype=torch.uint8, device=device)
    strided = torch.zeros(1024, dtype=torch.uint8, device=device)
    sched = Schedule(blocks, {"f.bin": mapped}, threads=2)

    def copy(lo: int, hi: int, out: torch.Tensor, view: torch.Tensor | None = None) -> Copy:
        return Copy(None, out, "f.bin", lo, hi, torch.uint8, view)  # type: ignore[arg-type]

    done: list = []
    for k in (0, 1):  # matched before any copy was added: nothing to copy yet
        pieces, tasks = sched.match(blocks[k])
        assert pieces == [] and tasks == []
    # one contiguous copy over blocks 0-4 (from byte 100), one strided view over blocks 3-5
    view = torch.frombuffer(mapped, dtype=torch.uint8)[4096 * 3 : 4096 * 3 + 12 * 1024 : 12]
    now = sched.add([copy(100, 100 + dst.numel(), dst), copy(4096 * 3, 4096 * 3 + 12 * 1023 + 1, strided, view)])
    for t in now:
        t()
    sched.device.settle()
    assert torch.equal(dst[: 2 * 4096 - 100], src[100 : 2 * 4096])  # the bytes of blocks 0 and 1
    assert not dst[2 * 4096 - 100 :].any() and not strided.any()  # nothing of a block not matched
    for k in (2, 3, 4):
        pieces, tasks = sched.match(blocks[k])
        run_pieces(pieces, sched.device)
        done += tasks
    assert done == [] and not strided.any()  # the strided copy still waits for block 5
    pieces, tasks = sched.match(blocks[5])
    run_pieces(pieces, sched.device)
    for t in tasks:
        t()
    sched.device.settle()
    assert torch.equal(dst, src[100 : 100 + dst.numel()])
    assert torch.equal(strided, src[4096 * 3 : 4096 * 3 + 12 * 1024 : 12])


@pytest.mark.parametrize("one_call", [True, False])
def test_a_stream_says_how_far_it_is_and_waits_past_an_offset(tmp_path, monkeypatch, one_call):
    """``Streamer.wait_past`` returns once the stream has passed the offset, and ``reached`` is the
    whole file once it is through — also for a file it could not read (the reader reads it then).
    Streamed by the C extension's ``stream_in`` and by ``sendfile`` from Python alike."""
    import threading

    from ckptflow.fast import memcopy, verifiedcopy
    from ckptflow.fast.verifiedcopy import Streamer
    from ckptflow.trainer.format.checksum import CHUNK

    if one_call and not memcopy.STREAM_IN:
        pytest.skip("no C extension")
    monkeypatch.setattr(memcopy, "STREAM_IN", one_call)
    monkeypatch.setattr(verifiedcopy, "STREAM_CHUNK", CHUNK)
    data, path, mapped, _ = _file_with_blocks(tmp_path, CHUNK * 3 + 5, CHUNK)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    seen: list[int] = []
    st = Streamer(str(path), len(data), mapped)
    t = threading.Thread(target=lambda: seen.extend([st.wait_past(CHUNK + 1, timeout=30), st.reached]))
    t.start()
    t.join(30)
    assert seen[0] is True and seen[1] > CHUNK
    assert st.wait_past(len(data), timeout=30) and st.streamed.wait(30) and st.reached == len(data)
    st.stop()
    gone = Streamer(str(tmp_path / "missing"), 100)
    assert gone.wait_past(100, timeout=30) and gone.reached == 100
    gone.stop()


@pytest.mark.skipif(not __import__("ckptflow.fast.memcopy").fast.memcopy.VERIFY_COPY, reason="no C extension")
@pytest.mark.parametrize("device", DEVICES)
def test_a_run_verified_in_one_call_copies_pieces_added_meanwhile_and_stops_at_a_bad_block(
    tmp_path, monkeypatch, device
):
    """``verify_run`` takes the pieces waiting for its blocks, verifies and copies in one call; a copy
    added while that call runs (the items are located meanwhile) is copied once its block matched,
    by the same thread. A block that does not match stops the run: its bytes and those after it
    stay uncopied, and the blocks before it count as matched."""
    import dataclasses

    import torch

    from ckptflow.fast import memcopy, verifiedcopy
    from ckptflow.fast.verifiedcopy import Schedule, verify_run
    from ckptflow.trainer.dcp.reader import Copy

    data, _, mapped, blocks = _file_with_blocks(tmp_path, 4096 * 6, 4096)
    src = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    early = torch.zeros(4096 * 2, dtype=torch.uint8, device=device)
    late = torch.zeros(4096 * 2 - 10, dtype=torch.uint8, device=device)
    sched = Schedule(blocks, {"f.bin": mapped}, threads=2)
    assert sched.add([Copy(None, early, "f.bin", 0, 4096 * 2, torch.uint8, None)]) == []  # type: ignore[arg-type]
    real = memcopy.verify_copy

    def while_running(*args):  # noqa: ANN002, ANN202
        assert sched.add([Copy(None, late, "f.bin", 4096 + 10, 4096 * 3, torch.uint8, None)]) == []  # type: ignore[arg-type]
        return real(*args)

    monkeypatch.setattr(verifiedcopy.memcopy, "verify_copy", while_running)
    n, tasks = verify_run(blocks[:3], sched)
    sched.device.settle()
    assert n == 3 and tasks == []
    assert torch.equal(early, src[: 4096 * 2]) and torch.equal(late, src[4096 + 10 : 4096 * 3])
    monkeypatch.setattr(verifiedcopy.memcopy, "verify_copy", real)

    rest = torch.zeros(4096 * 3, dtype=torch.uint8, device=device)
    assert sched.add([Copy(None, rest, "f.bin", 4096 * 3, 4096 * 6, torch.uint8, None)]) == []  # type: ignore[arg-type]
    bad = [blocks[3], dataclasses.replace(blocks[4], digest="0" * 16), blocks[5]]
    n, _ = verify_run(bad, sched)
    sched.device.settle()
    assert n == 1
    assert torch.equal(rest[:4096], src[4096 * 3 : 4096 * 4]) and not rest[4096:].any()
    assert ("f.bin", 3) in sched.matched and ("f.bin", 4) not in sched.matched


def test_the_core_reader_alone_loads_a_checkpoint_and_replays_its_probe_bitwise(tiny_run, tmp_path):
    """``CKPTFLOW_NO_ACCEL=1``: the core reader (``trainer/dcp/reader.py``; the acceleration layer is never
    imported) restores the checkpoint exactly: the sanity step replays the probe loss recorded at save time bit for
    bit."""
    import subprocess

    from tests.helpers import PY, REPO, step_dir, torchrun_env

    out = tmp_path / "result.json"
    code = (
        "import sys\n"
        "from ckptflow.tasks.sanity import main\n"
        f"rc = main([{step_dir(tiny_run, 6)!r}, '--out', {str(out)!r}])\n"
        "assert not any(m.startswith('ckptflow.fast') for m in sys.modules), 'the acceleration layer was loaded'\n"
        "raise SystemExit(rc)\n"
    )
    env = dict(torchrun_env(), CKPTFLOW_NO_ACCEL="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = subprocess.run([PY, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["ok"] and res["probe_match"] == "bitwise", res


@pytest.mark.parametrize("reader", ["core", "fast"])
def test_either_reader_refuses_a_flipped_byte_and_writes_no_destination(tiny_run, tmp_path, reader):
    """Both readers, in this process: the checkpoint loads bitwise as saved; with one byte flipped in a data
    file the load fails on that file's block, and no destination received a byte of the load."""
    import shutil
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from ckptflow.fast.reader import FastReader
    from ckptflow.trainer.dcp.planner import SafeLoadPlanner
    from ckptflow.trainer.dcp.reader import VerifiedReader
    from ckptflow.trainer.format.dcpmeta import read_dcp_metadata
    from ckptflow.trainer.format.manifest import read_manifest
    from tests.helpers import step_dir

    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(step_dir(tiny_run, 6), ckpt)
    manifest = read_manifest(ckpt)
    md = read_dcp_metadata(ckpt)
    kind = {"core": VerifiedReader, "fast": FastReader}[reader]

    def fresh() -> dict[str, torch.Tensor]:
        return {
            k: torch.full(m.size, 7, dtype=m.properties.dtype)
            for k, m in md.state_dict_metadata.items()
            if isinstance(m, dcp.metadata.TensorStorageMetadata)
        }

    def load(state: dict[str, torch.Tensor]) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=kind(ckpt, manifest), planner=SafeLoadPlanner(), no_dist=True)

    load(got := fresh())
    assert all(not bool((v == 7).all()) for v in got.values() if v.numel() > 8)
    biggest = max((n for n in manifest.files if n.endswith(".distcp")), key=lambda n: manifest.files[n].size)
    with open(os.path.join(ckpt, biggest), "r+b") as f:
        f.seek(manifest.files[biggest].size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(dcp.api.CheckpointException, match=rf"{biggest}: checksum .* in the manifest"):
        load(untouched := fresh())
    assert all(bool((v == 7).all()) for v in untouched.values()), "a destination received bytes of a failed load"


def test_a_checkpoint_in_state_layout_1_is_refused_with_how_to_read_it():
    """Layout 1 (before 0.1.0) is not read; the error says which layout and how to get the tensors out."""
    import torch

    from ckptflow.trainer.distenv import DistEnv
    from ckptflow.trainer.loader import load_target
    from ckptflow.trainer.state import TrainState

    old = Manifest(run_id="r", step=7, world_size=1, files={}, state={"layout": 1, "rng_ranks": 1})
    env = DistEnv(0, 1, 0, 1, 0, None)  # type: ignore[arg-type]  # refused before any collective
    with pytest.raises(ManifestError, match=r"step 7: .* layout 1 .* reads layout 2 only.*dcp\.load"):
        load_target(old, env=env, state=TrainState(torch.nn.Linear(2, 2)))
