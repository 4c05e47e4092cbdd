"""``sync`` saves (``dcp.save`` on the training thread) commit what the default mode commits:
a manifest that covers every file DCP wrote (real torchrun, 2 ranks)."""

from __future__ import annotations

import os

from ckptflow.trainer.format.manifest import read_manifest
from ckptflow.trainer.verify import verify_checkpoint
from tests.helpers import flip_byte, run_torchrun, step_dir


def test_a_sync_save_s_manifest_covers_every_shard(tmp_path):
    args = ["--ckpt-root", str(tmp_path), "--run-id", "r", "--model", "tiny", "--max-steps", "2", "--save-every", "2"]
    r = run_torchrun([*args, "--async-mode", "sync"])
    assert r.returncode == 0, r.stderr[-3000:]
    d = step_dir(os.path.join(tmp_path, "r"), 2)
    on_disk = sorted(n for n in os.listdir(d) if n != "manifest.json")
    assert sorted(read_manifest(d).files) == on_disk
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(on_disk)
    assert verify_checkpoint(d).ok
    flip_byte(os.path.join(d, "__1_0.distcp"))
    assert not verify_checkpoint(d).ok
