"""The data-file writer (trainer/dcp/writer.py): torch.save's own container, hashed as written."""

from __future__ import annotations

import io
import os
import textwrap
import warnings
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

from ckptflow.trainer.dcp import _zipfmt as zipfmt
from ckptflow.trainer.dcp import writer as fastwrite
from ckptflow.trainer.format.checksum import digest_file, hash_bytes, hash_file
from ckptflow.trainer.format.dcpmeta import read_dcp_metadata
from tests.helpers import run_script, script_result

TENSORS = {
    "float": torch.randn(1000),
    "transposed": torch.randn(3, 4).t(),
    "offset view": torch.arange(10)[2:5],
    "scalar": torch.tensor(3.5),
    "empty": torch.empty(0, 4),
    "bfloat16": torch.randn(5).bfloat16(),
    "bool": torch.ones(7, dtype=torch.bool),
    "complex": torch.randn(2, 3, dtype=torch.complex64),
    "8 MB": torch.randn(2_000_000),
}


def _torch_save(t: torch.Tensor) -> bytes:
    b = io.BytesIO()
    torch.save(t, b)
    return b.getvalue()


def _fast(t: torch.Tensor) -> tuple[bytes, bool, str]:
    b = io.BytesIO()
    out = fastwrite.HashingStream(b)
    templated = fastwrite.write_tensor(out, t)
    return b.getvalue(), templated, out.hasher.hexdigest()


def _id_bytes(container: bytes) -> set[int]:
    """Offsets that may differ: the serialization id record and the CRC-32 fields that cover it."""
    e = zipfmt.entries(container)["archive/.data/serialization_id"]
    end = e.data + e.size
    return set(range(e.data, end)) | set(range(end + 4, end + 8)) | set(range(e.central + 16, e.central + 20))


@pytest.mark.parametrize("name", list(TENSORS))
def test_a_tensor_s_container_is_torch_save_s_own(name):
    t = TENSORS[name]
    if t.untyped_storage().nbytes() != t.nbytes:  # DCP's writer saves a view as its own clone
        t = t.clone()
    ref = _torch_save(t)
    first, _, _ = _fast(t)  # the first of a layout makes its template
    got, templated, digest = _fast(t + 1 if t.dtype not in (torch.bool,) else ~t)  # new data, same layout
    assert templated
    new_ref = _torch_save(t + 1 if t.dtype not in (torch.bool,) else ~t)
    assert len(got) == len(new_ref) == len(ref)
    differ = {i for i, (a, b) in enumerate(zip(got, new_ref, strict=True)) if a != b}
    assert differ <= _id_bytes(new_ref), f"{name}: differs from torch.save outside the serialization id"
    assert zipfile.ZipFile(io.BytesIO(got)).testzip() is None  # every CRC-32 right: a valid zip
    back = torch.load(io.BytesIO(got), weights_only=True)
    assert torch.equal(back, t + 1 if t.dtype not in (torch.bool,) else ~t) and back.stride() == t.stride()
    assert digest == hash_bytes(got)  # hashed as written, every byte


class Sub(torch.Tensor):
    pass


def test_what_templates_do_not_cover_goes_through_torch_save_unchanged():
    tagged = torch.randn(4)
    tagged.note = "kept"  # a Python attribute: pickled with the tensor
    for t in (torch.randn(4).requires_grad_(), torch.randn(4).as_subclass(Sub), tagged):
        got, templated, _ = _fast(t)
        assert not templated
        assert got == _torch_save(t)


def _sd():
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.LayerNorm(17))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 33, generator=g)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 7, "extra": {"name": "run"}}


@pytest.mark.parametrize("threads", [1, 2])
def test_a_dcp_checkpoint_written_by_it_is_standard_dcp(tmp_path, threads):
    sd = _sd()
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    writer = fastwrite.HashingWriter(str(ours), thread_count=threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=writer, no_dist=True)
        dcp.save(sd, storage_writer=FileSystemWriter(str(theirs), thread_count=threads), no_dist=True)
    names = sorted(n for n in os.listdir(ours) if n.endswith(".distcp"))
    assert names == sorted(n for n in os.listdir(theirs) if n.endswith(".distcp")) and len(names) == threads
    # The same files, item for item at the same offsets (the templates were made during this save).
    md_ours, md_theirs = read_dcp_metadata(ours / ".metadata"), read_dcp_metadata(theirs / ".metadata")
    assert {k: (v.relative_path, v.offset, v.length) for k, v in md_ours.storage_data.items()} == {
        k: (v.relative_path, v.offset, v.length) for k, v in md_theirs.storage_data.items()
    }
    # Each file's digest was taken as it was written, and is the file's.
    got = {n: (d.hexdigest(), d.size, d.blocks()) for n, d in writer.digests.items()}
    assert got == {n: (*hash_file(ours / n), digest_file(ours / n).blocks()) for n in names}
    assert writer.items_templated > 0
    # Vanilla DCP reads it back.
    back = _sd()
    for v in back["model"].values():
        v.zero_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(back, storage_reader=FileSystemReader(str(ours)), no_dist=True)
    for k, v in sd["model"].items():
        assert torch.equal(back["model"][k], v), k
    assert back["step"] == 7

    # A second save: every tensor from a template, and still the files vanilla DCP wrote.
    again = tmp_path / "again"
    writer2 = fastwrite.HashingWriter(str(again), thread_count=threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=writer2, no_dist=True)
    assert writer2.items_saved == 0 and writer2.items_templated == writer.items_templated + writer.items_saved
    files = {n: ((again / n).read_bytes(), (theirs / n).read_bytes()) for n in names}
    assert all(len(a) == len(b) for a, b in files.values())
    for key, where in md_theirs.storage_data.items():
        a, b = (f[where.offset : where.offset + where.length] for f in files[where.relative_path])
        if a != b:  # a tensor's container: only its serialization id may differ
            differ = {i for i in range(len(a)) if a[i] != b[i]}
            assert differ <= _id_bytes(b), key


def test_dcp_to_torch_save_reads_it(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    sd = _sd()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=fastwrite.HashingWriter(str(tmp_path / "c")), no_dist=True)
        dcp_to_torch_save(str(tmp_path / "c"), str(tmp_path / "c.pt"))
    full = torch.load(tmp_path / "c.pt", weights_only=False)
    for k, v in sd["model"].items():
        assert torch.equal(full["model"][k], v), k


def test_a_templated_tensor_carries_its_crc32_and_the_digest_covers_it():
    t = torch.randn(3000)
    fastwrite.template(t)
    b = io.BytesIO()
    out = fastwrite.HashingStream(b)
    assert fastwrite.write_tensor(out, t)
    got = b.getvalue()
    assert torch.equal(torch.load(io.BytesIO(got), weights_only=True), t)
    assert out.hasher.hexdigest() == hash_bytes(got)
    assert zipfile.ZipFile(io.BytesIO(got)).testzip() is None  # zip tools find every record whole


DTENSORS = textwrap.dedent("""
    import json, os, warnings
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from ckptflow.trainer.dcp import writer as fastwrite
    from ckptflow.trainer.format.dcpmeta import read_dcp_metadata
    from ckptflow.trainer.distenv import init_distributed

    env = init_distributed()
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    sd = {"s": distribute_tensor(torch.randn(64, 33), mesh, [Shard(0)]),
          "r": distribute_tensor(torch.randn(5), mesh, [Replicate()]), "p": torch.randn(7)}
    calls = []
    to_local = DTensor.to_local
    DTensor.to_local = lambda self, *a, **k: (calls.append(1), to_local(self, *a, **k))[1]

    class Looked(DefaultSavePlanner):  # its own look-up: the writer must ask it
        def lookup_object(self, index):
            calls.append("planner")
            return super().lookup_object(index)

    root = os.environ["ROOT"]
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, writer, planner in (
            ("ours", fastwrite.HashingWriter(os.path.join(root, "ours")), None),
            ("theirs", FileSystemWriter(os.path.join(root, "theirs")), None),
            ("looked", fastwrite.HashingWriter(os.path.join(root, "looked")), Looked()),
        ):
            calls.clear()
            dcp.save(sd, storage_writer=writer, planner=planner, process_group=env.ckpt_group)
            out[name] = {"to_local": calls.count(1), "planner": calls.count("planner")}
    md = {n: read_dcp_metadata(os.path.join(root, n)) for n in ("ours", "theirs")}
    out["same_layout"] = {k: (v.offset, v.length) for k, v in md["ours"].storage_data.items()} == {
        k: (v.offset, v.length) for k, v in md["theirs"].storage_data.items()}
    back = {"s": distribute_tensor(torch.zeros(64, 33), mesh, [Shard(0)]),
            "r": distribute_tensor(torch.zeros(5), mesh, [Replicate()]), "p": torch.zeros(7)}
    dcp.load(back, checkpoint_id=os.path.join(root, "ours"), process_group=env.ckpt_group)
    out["loads"] = all(torch.equal(back[k].full_tensor() if isinstance(back[k], DTensor) else back[k],
                                   sd[k].full_tensor() if isinstance(sd[k], DTensor) else sd[k]) for k in sd)
    print("RESULT " + json.dumps(out))
""")


def test_dtensor_shards_are_written_without_to_local_and_stay_standard(tmp_path):
    r = run_script(DTENSORS, {"ROOT": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    res = script_result(r.stdout)
    # DCP's planning calls to_local() once per DTensor either way; its writer once more per DTensor
    # written, ckptflow's takes the local shard as it is.
    assert res["theirs"]["to_local"] == res["ours"]["to_local"] + 2
    assert res["looked"] == {"to_local": res["theirs"]["to_local"], "planner": 3}  # its own look-up is asked
    assert res["same_layout"] and res["loads"]
