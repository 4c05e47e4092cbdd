"""The restricted unpickler reads real DCP metadata and refuses everything else."""

from __future__ import annotations

import os
import pickle
import warnings

import pytest
import torch

from ckptflow.trainer.errors import IntegrityError
from ckptflow.trainer.format.dcpmeta import loads_dcp_metadata, read_dcp_metadata


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory):
    import torch.distributed.checkpoint as dcp

    d = tmp_path_factory.mktemp("dcp")
    sd = {
        "w": torch.randn(4, 3),
        "h": torch.ones(2, dtype=torch.bfloat16),
        "step": torch.tensor(7),
        "extra": {"lr": 0.1, "name": "x"},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(d), no_dist=True)
    return d


def test_reads_real_metadata_by_dir_or_file(dcp_dir):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    for p in (dcp_dir, dcp_dir / ".metadata"):
        md = read_dcp_metadata(p)
        assert md.state_dict_metadata["w"].properties.dtype == torch.float32
        assert isinstance(md.state_dict_metadata["h"], TensorStorageMetadata)
        assert isinstance(md.state_dict_metadata["extra.lr"], BytesStorageMetadata)
        assert len(md.storage_data) == 5


class _System:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_os_system_reduce_is_refused_and_not_run(tmp_path):
    marker = tmp_path / "pwned"
    p = tmp_path / ".metadata"
    p.write_bytes(pickle.dumps(_System(str(marker))))
    with pytest.raises(IntegrityError) as ei:
        read_dcp_metadata(p)
    assert "system" in str(ei.value) and str(p) in str(ei.value)
    assert ei.value.path == str(p)
    assert not marker.exists()


@pytest.mark.parametrize(
    "payload",
    [
        pickle.dumps(eval),  # builtins.eval by reference
        b"cbuiltins\ngetattr\n(cos\nS'system'\ntR.",  # getattr(os, "system")
        b"ctorch\nload\n(S'x'\ntR.",  # a torch function, not a dtype
        pickle.dumps({"a": 1}),  # harmless but not Metadata
        b"\x80\x04garbage",
        b"",
    ],
)
def test_refuses_non_metadata(payload):
    with pytest.raises(IntegrityError, match="src.metadata"):
        loads_dcp_metadata(payload, source="src.metadata")


def test_persistent_ids_are_refused():
    class P(pickle.Pickler):
        def persistent_id(self, obj):
            return "storage" if isinstance(obj, list) else None

    import io

    buf = io.BytesIO()
    P(buf, protocol=2).dump({"x": [1]})
    with pytest.raises(IntegrityError, match="persistent"):
        loads_dcp_metadata(buf.getvalue(), source="m")


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_dcp_metadata(tmp_path)


def test_the_chaos_audit_counts_the_restricted_reader_apart_from_a_plain_unpickle(dcp_dir):
    # The corrupt trials assert "nothing was unpickled": the allow-listed reader every
    # ckptflow path uses must not count, a plain pickle.load of the same bytes must.
    from ckptflow.chaos.checks import NoUnpickle

    with open(os.path.join(dcp_dir, ".metadata"), "rb") as f:
        data = f.read()
    with NoUnpickle() as audit:
        read_dcp_metadata(dcp_dir)
    assert audit.events == [] and audit.restricted > 0
    with NoUnpickle() as audit:
        pickle.loads(data)
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in audit.events


def _large_metadata(tensors: int, ranks: int) -> bytes:
    """DCP's own classes as a model of ``tensors`` parameters sharded over ``ranks`` ranks writes them."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    sdm, sd = {}, {}
    for t in range(tensors):
        fqn = f"model.layers.{t // 9}.w{t % 9}"
        chunks = []
        for r in range(ranks):
            off, size = torch.Size([r * 64, 0]), torch.Size([64, 4096])
            chunks.append(ChunkStorageMetadata(offsets=off, sizes=size))
            sd[MetadataIndex(fqn, off)] = _StorageInfo(f"__{r}_0.distcp", t * 4096, 4096)
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([64 * ranks, 4096]), chunks)
    return pickle.dumps(Metadata(state_dict_metadata=sdm, storage_data=sd))


def test_a_pickle_bomb_is_refused_within_the_parse_bounds_and_a_large_model_parses():
    """The allow-list lets ``str`` through; asked to print a list nested in itself 60 times (a 565-byte
    pickle), it would run for ever. The bounded parse stops it at its CPU cap and names it. A model with
    64,000 sharded chunks (a 9 MB ``.metadata``) parses within the same bounds."""
    import time

    from tests.helpers import pickle_bomb

    bomb = pickle_bomb()
    t0 = time.perf_counter()
    with pytest.raises(IntegrityError, match="pickle bomb"):
        loads_dcp_metadata(bomb, source="bomb/.metadata")
    assert time.perf_counter() - t0 < 15  # the cap is 1 s of CPU; wall time allows a busy machine

    data = _large_metadata(1000, 64)
    md = loads_dcp_metadata(data, source="large/.metadata")
    assert len(md.storage_data) == 64_000 and len(md.state_dict_metadata) == 1000
