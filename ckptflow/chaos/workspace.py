"""Scratch tiers for trials: hot and warm folders plus a prefix of the campaign's bucket.

Faults only ever happen here. The user's config (``--config``) contributes *how* the
tiers store and check (codecs, levels, storage class, multipart size, the lifecycle's
sanity step and expectations); *where* is always scratch: the folders live under the
campaign's work dir and the cold tier is a prefix on the campaign's own moto server.
Retention is ``keep_last = 2`` on every tier, so the short runs of a trial give prune
real work (a policy that keeps ten checkpoints would never delete anything here).

A *golden* workspace is built once per campaign and cloned per trial (folders copied,
objects copied server-side), so a trial starts in a known state in well under a second:

  golden   hot: steps 2, 4, 6 of the tiny reference job (world size 1)
           lifecycle done for 2 and 4 (warm and cold hold them); step 6 verified only
  final    golden + step 6's remaining stages: the state every stage trial must reach
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

from ckptflow.tasks.config import CkptflowConfig, load_config
from ckptflow.tasks.storage import Tier
from ckptflow.trainer.format import layout

RUN_ID = "chaos"
KEEP_LAST = 2


@dataclass(frozen=True, slots=True)
class Style:
    """What the user's config says about storing and checking; places come from scratch."""

    warm_codec: str = "bytegroup"
    warm_level: int | None = None
    cold_codec: str = "zstd"
    cold_level: int | None = None
    storage_class: str | None = None
    multipart_chunksize_mb: int = 5
    max_concurrency: int = 8
    object_tags: bool = True
    sanity_step: bool = True
    expectations: bool = True
    max_norm_change: float = 0.5
    source: str = "built-in"

    @classmethod
    def from_config(cls, cfg: CkptflowConfig | None) -> Style:
        if cfg is None:
            return cls()
        kw: dict = {
            "source": cfg.source,
            "sanity_step": cfg.lifecycle.sanity_step,
            "expectations": cfg.lifecycle.expectations,
            "max_norm_change": cfg.lifecycle.max_norm_change,
        }
        if cfg.warm is not None:
            kw.update(warm_codec=cfg.warm.codec, warm_level=cfg.warm.level)
        if cfg.cold is not None:
            kw.update(
                cold_codec=cfg.cold.codec,
                cold_level=cfg.cold.level,
                storage_class=cfg.cold.storage_class,
                object_tags=cfg.cold.object_tags,
                max_concurrency=cfg.cold.max_concurrency,
                # a trial's checkpoints are ~2 MB: the smallest part S3 allows keeps
                # multipart reachable when the user's parts are larger
                multipart_chunksize_mb=min(cfg.cold.multipart_chunksize_mb, 8),
            )
        return cls(**kw)


@dataclass(slots=True)
class Scratch:
    """One trial's tiers. ``endpoint`` is what the cold tier talks to (moto or a proxy)."""

    dir: str
    bucket: str
    prefix: str
    endpoint: str
    style: Style
    run_id: str = RUN_ID
    sanity: bool | None = None
    """Override of the style's sanity step (None: the style's)."""
    config_path: str = field(init=False)

    def __post_init__(self) -> None:
        os.makedirs(self.dir, exist_ok=True)
        self.config_path = os.path.join(self.dir, "ckptflow.toml")
        self.write_config()

    @property
    def hot(self) -> str:
        return os.path.join(self.dir, "hot")

    @property
    def warm(self) -> str:
        return os.path.join(self.dir, "warm")

    @property
    def cold_url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    @property
    def run_path(self) -> str:
        return layout.run_dir(self.hot, self.run_id)

    def with_run(self, run_id: str) -> Scratch:
        self.run_id = layout.check_run_id(run_id)
        return self

    def point_cold_at(self, endpoint: str) -> None:
        """Route the cold tier through another endpoint (a fault proxy) from now on."""
        self.endpoint = endpoint
        self.write_config()

    def config(self) -> CkptflowConfig:
        return load_config(self.config_path)

    def tiers(self) -> list[Tier]:
        return [Tier(t) for t in self.config().tiers()]

    def tier(self, name: str) -> Tier:
        return {t.name: t for t in self.tiers()}[name]

    def scratch_dir(self, name: str) -> str:
        path = os.path.join(self.dir, "scratch", name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path

    def write_config(self) -> None:
        s = self.style
        sanity = s.sanity_step if self.sanity is None else self.sanity

        def opt(key: str, value: object) -> str:
            if value is None:
                return ""
            if isinstance(value, bool):
                return f"{key} = {str(value).lower()}\n"
            if isinstance(value, str):
                return f'{key} = "{value}"\n'
            return f"{key} = {value}\n"

        text = (
            "# written by ckptflow chaos: scratch tiers of one trial, never the user's\n"
            f'[hot]\nurl = "{self.hot}"\n[hot.retention]\nkeep_last = {KEEP_LAST}\n'
            f'[warm]\nurl = "{self.warm}"\n'
            + opt("codec", s.warm_codec)
            + opt("level", s.warm_level)
            + f"[warm.retention]\nkeep_last = {KEEP_LAST}\n"
            f'[cold]\nurl = "{self.cold_url}"\n'
            + opt("codec", s.cold_codec)
            + opt("level", s.cold_level)
            + opt("endpoint_url", self.endpoint)
            + opt("storage_class", s.storage_class)
            + opt("multipart_chunksize_mb", s.multipart_chunksize_mb)
            + opt("max_concurrency", s.max_concurrency)
            + opt("object_tags", s.object_tags)
            + f"[cold.retention]\nkeep_last = {KEEP_LAST}\n"
            "[lifecycle]\n"
            + opt("sanity_step", sanity)
            + opt("expectations", s.expectations and sanity)
            + opt("max_norm_change", float(s.max_norm_change))
        )
        with open(self.config_path, "w") as f:
            f.write(text)


def copy_prefix(s3, bucket: str, src: str, dst: str) -> int:
    """Server-side copy of every object under ``src/`` to ``dst/`` (metadata and tags kept)."""
    n = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=src + "/"):
        for o in page.get("Contents", []):
            key = dst + o["Key"][len(src) :]
            s3.copy_object(Bucket=bucket, Key=key, CopySource={"Bucket": bucket, "Key": o["Key"]})
            n += 1
    return n


def list_keys(s3, bucket: str, prefix: str) -> list[str]:
    return [
        o["Key"]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
        for o in page.get("Contents", [])
    ]


def clone(
    src: Scratch, dst_dir: str, s3, *, prefix: str, endpoint: str | None = None, sanity: bool | None = None
) -> Scratch:
    """A new scratch holding a copy of ``src``'s three tiers."""
    for d in ("hot", "warm"):
        if os.path.isdir(os.path.join(src.dir, d)):
            shutil.copytree(os.path.join(src.dir, d), os.path.join(dst_dir, d), symlinks=True)
    copy_prefix(s3, src.bucket, src.prefix, prefix)
    return Scratch(
        dst_dir,
        src.bucket,
        prefix,
        endpoint or src.endpoint,
        src.style,
        src.run_id,
        src.sanity if sanity is None else sanity,
    )


def committed_by_tier(scratch: Scratch) -> dict[str, list[int]]:
    return {t.name: t.committed_steps(scratch.run_id) for t in scratch.tiers()}


def replace_style(style: Style, **kw: Any) -> Style:
    return dataclasses.replace(style, **kw)
