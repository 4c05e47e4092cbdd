"""``CheckpointRef``: one committed checkpoint, as every lifecycle stage sees it.

A stage needs the run, the step and the tiers the checkpoint lives on; everything else
(the run's folder on hot, where the stage records live, the step's directory, the
opened tiers) follows from those three and is derived here, once, instead of being
passed around as four to six loose values.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckptflow.tasks.config import CkptflowConfig, load_config
from ckptflow.trainer.format import layout

if TYPE_CHECKING:
    from ckptflow.tasks.storage import Tier


@dataclass(frozen=True)
class CheckpointRef:
    """Run ``run_id``, step ``step``, on the tiers of ``cfg`` (whose hot root is the trainer's)."""

    cfg: CkptflowConfig
    run_id: str
    step: int
    records_tier: str = "hot"
    """Where the stage records live: the trainer's hot root, or warm for a checkpoint saved on
    node-local roots (no single hot root holds it; warm is where its parts are joined)."""
    nodes: tuple[str, ...] = ()
    """Node-local roots: the nodes that committed the checkpoint (the event's node list)."""
    _tiers: dict[str, Tier] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        layout.check_run_id(self.run_id)
        layout.step_name(self.step)  # validates the step

    @classmethod
    def of(
        cls, run_id: str, step: int, *, config: str | None = None, root: str | None = None, uri: str = ""
    ) -> CheckpointRef:
        """From a commit event's fields: the config file, and the trainer's hot root (the event's
        ``root``, else derived from its ``uri``, else the config's hot tier)."""
        cfg = load_config(config)
        return cls(with_hot_root(cfg, hot_root_for(cfg, uri, root)), run_id, int(step))

    def to_wire(self) -> dict:
        """JSON for another process of this machine (the fork server's stage job): the config
        travels as its file (re-read there) plus its contents, which must match."""
        return {
            "source": self.cfg.source,
            "cfg": _plain(self.cfg),
            "hot": self.cfg.hot.url,
            "run_id": self.run_id,
            "step": self.step,
            "records_tier": self.records_tier,
            "nodes": list(self.nodes),
        }

    @classmethod
    def from_wire(cls, d: dict) -> CheckpointRef:
        from ckptflow.tasks.config import BUILTIN
        from ckptflow.trainer.errors import ConfigError

        cfg = with_hot_root(load_config(None if d["source"] == BUILTIN else d["source"]), d["hot"])
        if _plain(cfg) != d["cfg"]:
            raise ConfigError(
                f"{d['source']}: the config read here differs from the caller's (changed since the "
                "lifecycle started?); run the stage in the caller instead"
            )
        return cls(cfg, d["run_id"], int(d["step"]), d["records_tier"], tuple(d["nodes"]))

    @property
    def run_path(self) -> str:
        """The run on the hot tier: the trainer's folder, where the stage records live."""
        return layout.run_dir(self.cfg.hot.url, self.run_id)

    @property
    def records_path(self) -> str:
        """The run on the records tier: ``_lifecycle/`` (stage records, heartbeat, stats) is here."""
        return layout.run_dir(getattr(self.cfg, self.records_tier).url, self.run_id)

    @property
    def hot_dir(self) -> str:
        """The checkpoint's directory on the hot tier."""
        return layout.join(self.run_path, layout.step_name(self.step))

    @property
    def uri(self) -> str:
        """Where the checkpoint is, as events and reports name it (warm for node-local roots)."""
        if self.records_tier == "hot":
            return self.hot_dir
        return self.tier(self.records_tier).url_for(self.run_id, self.step)

    @property
    def name(self) -> str:
        return f"{self.run_id} {layout.step_name(self.step)}"

    def has(self, tier: str) -> bool:
        """Whether the config has tier ``tier`` ("hot", "warm", "cold")."""
        return getattr(self.cfg, tier) is not None

    def tier(self, name: str) -> Tier:
        """The opened tier ``name`` (built once per reference: S3 clients are not free)."""
        if name not in self._tiers:
            from ckptflow.tasks.storage import Tier

            tcfg = getattr(self.cfg, name)
            if tcfg is None:
                raise KeyError(f"tier {name!r} is not configured in {self.cfg.source}")
            self._tiers[name] = Tier(tcfg)
        return self._tiers[name]


def _plain(cfg: CkptflowConfig) -> dict:
    import json

    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def hot_root_for(cfg: CkptflowConfig, uri: str, root: str | None) -> str:
    """The trainer's root for a checkpoint: the event's, else derived from the uri."""
    if root:
        return os.path.abspath(root)
    if uri and "://" not in uri:
        return os.path.dirname(os.path.dirname(os.path.abspath(uri)))
    return cfg.hot.url


def with_hot_root(cfg: CkptflowConfig, root: str) -> CkptflowConfig:
    """``cfg`` with its hot tier at ``root`` (a trainer may run with another --ckpt-root)."""
    if os.path.abspath(cfg.hot.url) == os.path.abspath(root):
        return cfg
    return dataclasses.replace(cfg, hot=dataclasses.replace(cfg.hot, url=os.path.abspath(root)))
