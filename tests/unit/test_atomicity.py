"""One commit rule per kind of tier, one definition of "committed" (``trainer.atomicity``).

The same table of moves runs against both rules: stage, commit, list, withdraw. What
differs is only where staging happens and what proves a commit.
"""

from __future__ import annotations

import os

import fsspec
import pytest

from ckptflow.trainer.errors import StorageError
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.atomicity import DELETING_SUFFIX, RENAME, MarkerCommit, RenameCommit


def _stage(rule, fs, run: str, step: int) -> str:
    url = rule.staging_url(run, step)
    fs.makedirs(url, exist_ok=True)
    fs.pipe_file(layout.join(url, "__0_0.distcp"), b"shard")
    return url


@pytest.fixture(params=["rename", "marker"])
def setup(request, tmp_path):
    if request.param == "rename":
        return RENAME, fsspec.filesystem("file"), str(tmp_path / "run")
    fs = fsspec.filesystem("memory")
    return MarkerCommit(fs), fs, f"memory://ckpt-{os.getpid()}-{tmp_path.name}/run"


def test_staged_is_not_committed_until_the_commit_point(setup):
    rule, fs, run = setup
    assert rule.committed_steps(run) == []  # no run yet: nothing, not an error
    _stage(rule, fs, run, 4)
    assert rule.committed_steps(run) == [] and not rule.is_committed(run, 4)
    final = rule.commit(run, 4, marker=b"digest")
    assert final.endswith(layout.step_name(4)) and rule.is_committed(run, 4)
    _stage(rule, fs, run, 8)
    rule.commit(run, 8)
    assert rule.committed_steps(run) == [8, 4]


def test_withdraw_uncommits_before_any_byte_goes(setup):
    rule, fs, run = setup
    _stage(rule, fs, run, 4)
    rule.commit(run, 4)
    left = rule.withdraw(run, 4)
    assert not rule.is_committed(run, 4) and rule.committed_steps(run) == []
    assert fs.exists(layout.join(left, "__0_0.distcp"))  # the bytes are still there to remove
    if rule.kind == "rename":
        assert left.endswith(DELETING_SUFFIX) and RenameCommit.is_leftover(os.path.basename(left))
        assert rule.withdraw(run, 4) is None  # nothing committed left


def test_a_rename_commit_never_replaces_a_committed_step(tmp_path):
    run = str(tmp_path / "run")
    os.makedirs(os.path.join(run, layout.step_name(4)))  # empty: rename(2) would replace it silently
    _stage(RENAME, fsspec.filesystem("file"), run, 4)
    with pytest.raises(StorageError, match="never replaced"):
        RENAME.commit(run, 4)
    assert os.path.isdir(RENAME.staging_url(run, 4))


def test_leftover_names():
    assert RenameCommit.is_leftover(layout.tmp_name(3))
    assert RenameCommit.is_leftover(layout.step_name(3) + DELETING_SUFFIX)
    assert not RenameCommit.is_leftover(layout.step_name(3)) and not RenameCommit.is_leftover("x.deleting")
