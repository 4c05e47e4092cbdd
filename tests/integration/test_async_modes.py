"""Every async mode commits a manifest that covers every file DCP wrote (real torchrun).

PROCESS mode runs DCP's writer in another process; an earlier version took the file
list from the writer object and committed manifests without the shards.
"""

from __future__ import annotations

import os

import pytest

from ckptflow.trainer.manifest import read_manifest
from ckptflow.trainer.verify import verify_checkpoint
from tests.helpers import flip_byte, run_torchrun, step_dir


@pytest.mark.parametrize("mode", ["process", "thread", "sync"])
def test_manifest_covers_every_shard(tmp_path, mode):
    r = run_torchrun(
        [
            "--ckpt-root",
            str(tmp_path),
            "--run-id",
            "r",
            "--model",
            "tiny",
            "--max-steps",
            "2",
            "--save-every",
            "2",
            "--async-mode",
            mode,
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    d = step_dir(os.path.join(tmp_path, "r"), 2)
    on_disk = sorted(n for n in os.listdir(d) if n != "manifest.json")
    assert sorted(read_manifest(d).files) == on_disk
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(on_disk)
    assert verify_checkpoint(d).ok
    flip_byte(os.path.join(d, "__1_0.distcp"))
    assert not verify_checkpoint(d).ok
