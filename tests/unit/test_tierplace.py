"""Tier identity: two tiers are compared by what they resolve to, never by how their URLs are spelled.

The invariant, as a table: a config whose tiers are one place, or one inside another, is refused for every
spelling a user can write (``file://``, a trailing slash, ``..``, a symlinked folder, a bind-mount-like alias
through a symlinked parent, a path inside); tiers that only share a prefix of their names are not."""

from __future__ import annotations

import os

import pytest

from ckptflow.tasks.config import parse_config, where_in_tiers
from ckptflow.tasks.tierplace import below, overlap, place_of
from ckptflow.trainer.errors import ConfigError


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "hot").mkdir()
    (tmp_path / "data").mkdir()
    os.symlink(tmp_path / "hot", tmp_path / "alias")  # the hot folder under another name
    os.symlink(tmp_path, tmp_path / "data" / "up")  # a parent reached through a link
    return tmp_path


def _cfg(tree, warm: str, *, cold: str | None = None, endpoint: str | None = None) -> None:
    data = {"hot": {"url": str(tree / "hot")}, "warm": {"url": warm}}
    if cold:
        data["cold"] = {"url": cold, **({"endpoint_url": endpoint} if endpoint else {})}
    parse_config(data, source=str(tree / "ckptflow.toml"))


@pytest.mark.parametrize(
    "warm",
    [
        "{t}/hot",
        "file://{t}/hot",
        "{t}/hot/",
        "{t}/hot/../hot",
        "{t}/alias",
        "file://{t}/alias/",
        "{t}/data/up/hot",
        "{t}/hot/warm",  # inside hot
        "{t}/alias/sub/warm",  # inside hot, through the link, not yet created
        "{t}",  # hot inside warm
        "{t}/data/up",  # hot inside warm, through the link
    ],
)
def test_tiers_that_are_one_place_or_nested_are_refused(tree, warm):
    with pytest.raises(ConfigError, match="same place|one inside the other"):
        _cfg(tree, warm.format(t=tree))


@pytest.mark.parametrize("warm", ["{t}/warm", "{t}/hotter", "{t}/data/warm", "{t}/data/up/hot2"])
def test_tiers_apart_are_accepted(tree, warm):
    _cfg(tree, warm.format(t=tree))


@pytest.mark.parametrize(
    ("a", "b", "ea", "eb", "same"),
    [
        ("s3://b/p", "s3://b/p/", None, None, True),
        ("s3://b/p", "s3://b/p/q", None, None, True),
        ("s3://b/p", "s3://b//p", None, None, True),
        ("s3://b/p", "s3://b/pq", None, None, False),
        ("s3://b/p", "s3://c/p", None, None, False),
        ("s3://b/p", "s3://b/p", "http://127.0.0.1:9000", "http://127.0.0.1:9000/", True),
        ("s3://b/p", "s3://b/p", "http://127.0.0.1:9000", "http://127.0.0.1:9001", False),
    ],
)
def test_object_store_places_compare_endpoint_bucket_and_prefix(a, b, ea, eb, same):
    assert overlap(place_of(a, local=False, endpoint_url=ea), place_of(b, local=False, endpoint_url=eb)) is same


def test_where_in_tiers_names_the_tier_and_the_path_below_it(tree):
    cfg = parse_config(
        {"hot": {"url": str(tree / "hot")}, "warm": {"url": str(tree / "warm")}}, source=str(tree / "c.toml")
    )
    assert where_in_tiers(cfg, str(tree / "alias" / "r1" / "step_000000004"))[1] == ("r1", "step_000000004")
    assert where_in_tiers(cfg, str(tree / "warm"))[0].name == "warm"
    assert where_in_tiers(cfg, str(tree / "elsewhere")) is None
    assert below(place_of(str(tree / "hot"), local=True), place_of(str(tree / "hot2"), local=True)) is None
