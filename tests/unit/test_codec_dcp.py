"""Whole DCP checkpoints: dtype maps from .metadata, directory round trips, the CLI."""

from __future__ import annotations

import io
import json
import struct
import warnings

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from ckptflow.tasks.codec import dtype_maps_for_checkpoint
from ckptflow.tasks.codec.dtypemap import safetensors_dtype_map
from ckptflow.tasks.codec.tool import INDEX, compress_dir, decompress_dir
from ckptflow.trainer.errors import CodecError, ConfigError, IntegrityError, UnsafePathError


def _state_dict():
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(300, 257, generator=g) * 0.02,
            "b": torch.randn(7, generator=g).to(torch.bfloat16),
            "h": torch.randn(33, generator=g).to(torch.float16),
            "d": torch.randn(5, generator=g).double(),
            "empty": torch.empty(0, 4),
            "ids": torch.arange(1000),
        },
        "special": torch.tensor([float("nan"), float("inf"), -0.0, 1e-45]),
        "step": 12,
        "meta": {"name": "run", "lr": 3e-4},
    }


def _save(sd, path):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(path), no_dist=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    _save(_state_dict(), d)
    (d / "manifest.json").write_text('{"note": "copied verbatim"}\n')
    return d


def test_dtype_map_points_at_exactly_the_tensor_bytes(ckpt):
    maps = dtype_maps_for_checkpoint(str(ckpt))
    assert list(maps) == ["__0_0.distcp"]
    shard = (ckpt / "__0_0.distcp").read_bytes()
    found = {shard[r.offset : r.offset + r.length]: r.dtype for r in maps["__0_0.distcp"].ranges}
    sd = _state_dict()
    expected = {
        t.contiguous().view(torch.uint8).numpy().tobytes(): str(t.dtype)[6:]
        for t in (*sd["model"].values(), sd["special"])
        if t.is_floating_point() and t.numel()
    }
    assert found == expected


def test_directory_round_trip_byte_for_byte(ckpt, tmp_path):
    rep = compress_dir(str(ckpt), str(tmp_path / "z"), threads=2)
    codecs = {f.name: f.codec for f in rep.files}
    assert codecs == {".metadata": "zstd", "__0_0.distcp": "bytegroup", "manifest.json": "none"}
    assert (tmp_path / "z" / "manifest.json").read_bytes() == (ckpt / "manifest.json").read_bytes()
    assert rep.ratio > 1.0 and (tmp_path / "z" / INDEX).exists()
    back = decompress_dir(str(tmp_path / "z"), str(tmp_path / "out"))
    assert back.raw_bytes == rep.raw_bytes
    for f in ("__0_0.distcp", ".metadata", "manifest.json"):
        assert (tmp_path / "out" / f).read_bytes() == (ckpt / f).read_bytes()
    # the restored checkpoint loads with DCP itself
    import torch.distributed.checkpoint as dcp

    sd = _state_dict()
    target = {
        "model": {k: torch.zeros_like(v) for k, v in sd["model"].items()},
        "special": torch.zeros(4),
        "step": 0,
        "meta": {"name": "", "lr": 0.0},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(tmp_path / "out"), no_dist=True)
    assert torch.equal(target["model"]["w"], sd["model"]["w"])
    assert target["special"].view(torch.int32).tolist() == sd["special"].view(torch.int32).tolist()


@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_other_codecs_per_tier(ckpt, tmp_path, codec):
    rep = compress_dir(str(ckpt), str(tmp_path / "z"), codec=codec, level=1)
    assert {f.codec for f in rep.files} <= {codec, "none"}
    decompress_dir(str(tmp_path / "z"), str(tmp_path / "out"))
    assert (tmp_path / "out" / "__0_0.distcp").read_bytes() == (ckpt / "__0_0.distcp").read_bytes()


def test_damaged_archive_leaves_no_file_behind(ckpt, tmp_path):
    compress_dir(str(ckpt), str(tmp_path / "z"))
    p = tmp_path / "z" / "__0_0.distcp.ckz"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))
    with pytest.raises(CodecError, match="chunk 0"):
        decompress_dir(str(tmp_path / "z"), str(tmp_path / "out"))
    assert not (tmp_path / "out" / "__0_0.distcp").exists()
    assert not list((tmp_path / "out").glob("*.part"))


def test_index_names_cannot_escape(ckpt, tmp_path):
    compress_dir(str(ckpt), str(tmp_path / "z"))
    idx = json.loads((tmp_path / "z" / INDEX).read_text())
    idx["files"][0]["name"] = "../../evil"
    (tmp_path / "z" / INDEX).write_text(json.dumps(idx))
    with pytest.raises(UnsafePathError):
        decompress_dir(str(tmp_path / "z"), str(tmp_path / "out"))
    idx["files"][0]["name"] = ".metadata"
    idx["files"][0]["codec"] = "rot13"
    (tmp_path / "z" / INDEX).write_text(json.dumps(idx))
    with pytest.raises(IntegrityError, match="malformed"):
        decompress_dir(str(tmp_path / "z"), str(tmp_path / "out2"))


def test_destination_must_be_new_and_outside(ckpt, tmp_path):
    with pytest.raises(ConfigError, match="inside"):
        compress_dir(str(ckpt), str(ckpt / "sub"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ConfigError, match="not empty"):
        compress_dir(str(ckpt), str(tmp_path / "full"))


def test_safetensors_header_map():
    a = (np.arange(10, dtype=np.float32) * 0.5).tobytes()
    b = np.arange(4, dtype=np.int64).tobytes()
    header = json.dumps(
        {
            "a": {"dtype": "F32", "shape": [10], "data_offsets": [0, 40]},
            "b": {"dtype": "I64", "shape": [4], "data_offsets": [40, 72]},
            "__metadata__": {"x": "y"},
        }
    ).encode()
    blob = struct.pack("<Q", len(header)) + header + a + b
    m = safetensors_dtype_map(io.BytesIO(blob))
    (r,) = m.ranges
    assert blob[r.offset : r.offset + r.length] == a and r.dtype == "float32"
    assert safetensors_dtype_map(io.BytesIO(b"not safetensors")).ranges == ()


def test_cli_compress_decompress(ckpt, tmp_path):
    from ckptflow.cli.main import app

    runner = CliRunner()
    r = runner.invoke(app, ["compress", str(ckpt), str(tmp_path / "z"), "--threads", "2"])
    assert r.exit_code == 0, r.output
    assert "ratio" in r.output and "MB/s" in r.output
    r = runner.invoke(app, ["decompress", str(tmp_path / "z"), str(tmp_path / "out"), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["raw_bytes"] > 0
    assert (tmp_path / "out" / "__0_0.distcp").read_bytes() == (ckpt / "__0_0.distcp").read_bytes()


def test_cli_errors_are_one_line_with_exit_codes(ckpt, tmp_path, capsys, monkeypatch):
    from ckptflow.cli.errors import run_cli
    from ckptflow.cli.main import app

    monkeypatch.setattr("sys.argv", ["ckptflow", "decompress", str(ckpt), str(tmp_path / "o")])
    assert run_cli(app) == 3  # no codec index: not found
    monkeypatch.setattr("sys.argv", ["ckptflow", "compress", str(ckpt), str(tmp_path / "o2"), "--codec", "lzma"])
    assert run_cli(app) == 4
    assert "unknown" in capsys.readouterr().err


def test_multi_file_checkpoint(tmp_path):
    """Several shard files (as several ranks or writer threads make): one map per file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    sd = {f"t{i}": torch.randn(64, 33) for i in range(6)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=FileSystemWriter(str(tmp_path / "c"), thread_count=3), no_dist=True)
    maps = dtype_maps_for_checkpoint(str(tmp_path / "c"))
    assert len(maps) == 3 and all(len(m.ranges) == 2 for m in maps.values())
    compress_dir(str(tmp_path / "c"), str(tmp_path / "z"))
    decompress_dir(str(tmp_path / "z"), str(tmp_path / "o"))
    for name in maps:
        assert (tmp_path / "o" / name).read_bytes() == (tmp_path / "c" / name).read_bytes()
