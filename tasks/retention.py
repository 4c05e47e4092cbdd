"""Retention as pure policy: which checkpoints to keep, and why. Nothing here deletes.

A policy answers, for a list of :class:`CheckpointInfo`, ``{step: reason}`` for the
steps it keeps. Policies combine (``a | b`` keeps what either keeps, ``a & b`` what
both keep). :func:`plan` adds the protections no policy can override — what
``latest`` names, the newest verified checkpoint, pinned and leased ones, and steps the
caller protects — and returns what to keep (with every reason) and what to delete.
``tasks.prune`` gathers the facts from a tier, calls :func:`plan`, and deletes.

Quarantined checkpoints (the verify stage found them bad) are never handed to a
policy: keeping a bad checkpoint as "one of the last 3" would silently leave only two
good ones. They are kept only if a protection names them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckptflow.trainer.errors import ConfigError

if TYPE_CHECKING:
    from ckptflow.tasks.config import RetentionConfig


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """What retention may know about one committed checkpoint on one tier."""

    step: int
    metrics: Mapping[str, float] = field(default_factory=dict)
    """The manifest's training meta (loss, lr, …) when a policy ranks by a metric."""
    pinned: bool = False
    verified: bool = False
    """The verify stage passed it (hot), or a tier verified it before committing (warm, cold)."""
    quarantined: bool = False
    latest: bool = False
    """``latest`` names it (the trainer resumes from it)."""
    leased: bool = False
    """A restore or drill is reading it."""


class Policy:
    """Base of retention policies; subclasses implement :meth:`keep`."""

    needs_metrics = False
    """True if :meth:`keep` reads ``CheckpointInfo.metrics`` (prune then reads manifests)."""

    def keep(self, ckpts: Sequence[CheckpointInfo]) -> dict[int, str]:
        """Steps this policy keeps, each with a short reason."""
        raise NotImplementedError

    def __or__(self, other: Policy) -> AnyOf:
        return AnyOf(self, other)

    def __and__(self, other: Policy) -> AllOf:
        return AllOf(self, other)


class KeepLastN(Policy):
    def __init__(self, n: int) -> None:
        if not isinstance(n, int) or n < 1:
            raise ConfigError(f"KeepLastN n={n!r} must be a positive integer")
        self.n = n

    def keep(self, ckpts: Sequence[CheckpointInfo]) -> dict[int, str]:
        newest = sorted((c.step for c in ckpts), reverse=True)[: self.n]
        return dict.fromkeys(newest, f"one of the last {self.n}")

    def __repr__(self) -> str:
        return f"KeepLastN({self.n})"


class KeepEveryKSteps(Policy):
    def __init__(self, k: int) -> None:
        if not isinstance(k, int) or k < 1:
            raise ConfigError(f"KeepEveryKSteps k={k!r} must be a positive integer")
        self.k = k

    def keep(self, ckpts: Sequence[CheckpointInfo]) -> dict[int, str]:
        return {c.step: f"step is a multiple of {self.k}" for c in ckpts if c.step % self.k == 0}

    def __repr__(self) -> str:
        return f"KeepEveryKSteps({self.k})"


class KeepBestN(Policy):
    """The ``n`` best by ``metric`` ("min": lower is better). Checkpoints without the metric
    (or with a non-finite value) are not ranked; ties go to the newer step."""

    needs_metrics = True

    def __init__(self, metric: str, mode: str = "min", n: int = 1) -> None:
        if mode not in ("min", "max"):
            raise ConfigError(f"KeepBestN mode={mode!r} must be 'min' or 'max'")
        if not isinstance(n, int) or n < 1:
            raise ConfigError(f"KeepBestN n={n!r} must be a positive integer")
        if not metric:
            raise ConfigError("KeepBestN needs a metric name")
        self.metric, self.mode, self.n = metric, mode, n

    def keep(self, ckpts: Sequence[CheckpointInfo]) -> dict[int, str]:
        ranked = []
        for c in ckpts:
            v = c.metrics.get(self.metric)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf"):
                ranked.append((v if self.mode == "min" else -v, -c.step, c.step, v))
        ranked.sort()
        return {s: f"best {self.n} by {self.metric} ({self.mode}: {v:.6g})" for _, _, s, v in ranked[: self.n]}

    def __repr__(self) -> str:
        return f"KeepBestN({self.metric!r}, {self.mode!r}, n={self.n})"


class KeepPinned(Policy):
    def keep(self, ckpts: Sequence[CheckpointInfo]) -> dict[int, str]:
        return {c.step: "pinned" for c in ckpts if c.pinned}

    def __repr__(self) -> str:
        return "KeepPinned()"


class KeepAll(Policy):
    def keep(self, ckpts: Sequence[CheckpointInfo]) -> dict[int, str]:
        return {c.step: "the tier keeps everything" for c in ckpts}

    def __repr__(self) -> str:
        return "KeepAll()"


class AnyOf(Policy):
    """Keeps what any member keeps; reasons of all members that keep a step, joined."""

    def __init__(self, *policies: Policy) -> None:
        if not policies:
            raise ConfigError("AnyOf needs at least one policy")
        self.policies = policies
        self.needs_metrics = any(p.needs_metrics for p in policies)

    def keep(self, ckpts: Sequence[CheckpointInfo]) -> dict[int, str]:
        out: dict[int, list[str]] = {}
        for p in self.policies:
            for s, why in p.keep(ckpts).items():
                out.setdefault(s, []).append(why)
        return {s: "; ".join(ws) for s, ws in out.items()}

    def __repr__(self) -> str:
        return " | ".join(map(repr, self.policies))


class AllOf(Policy):
    """Keeps only what every member keeps (e.g. every 100th step, but only the last 10 such)."""

    def __init__(self, *policies: Policy) -> None:
        if not policies:
            raise ConfigError("AllOf needs at least one policy")
        self.policies = policies
        self.needs_metrics = any(p.needs_metrics for p in policies)

    def keep(self, ckpts: Sequence[CheckpointInfo]) -> dict[int, str]:
        answers = [p.keep(ckpts) for p in self.policies]
        both = set(answers[0]).intersection(*answers[1:])
        return {s: " and ".join(a[s] for a in answers) for s in both}

    def __repr__(self) -> str:
        return "(" + " & ".join(map(repr, self.policies)) + ")"


@dataclass(slots=True)
class RetentionPlan:
    keep: dict[int, list[str]]
    """Every kept step and every reason it is kept (protections first)."""
    delete: list[int]
    """Steps no policy or protection keeps, oldest first."""


def protections(ckpts: Sequence[CheckpointInfo], protected_steps: Iterable[int] = ()) -> dict[int, list[str]]:
    """What is kept whatever the policy says."""
    out: dict[int, list[str]] = {}
    extra = set(protected_steps)
    good = [c for c in ckpts if not c.quarantined]
    verified = [c for c in good if c.verified]
    newest = max(verified or good, key=lambda c: c.step, default=None)
    for c in ckpts:
        why = []
        if c.latest:
            why.append("named by latest")
        if newest is not None and c.step == newest.step:
            why.append("newest verified checkpoint" if verified else "newest checkpoint (none verified yet)")
        if c.pinned:
            why.append("pinned")
        if c.leased:
            why.append("leased by a reader")
        if c.step in extra:
            why.append("protected by the caller")
        if why:
            out[c.step] = why
    return out


def plan(policy: Policy, ckpts: Sequence[CheckpointInfo], *, protected_steps: Iterable[int] = ()) -> RetentionPlan:
    """Keep = protections + what ``policy`` keeps among non-quarantined checkpoints."""
    steps = [c.step for c in ckpts]
    if len(set(steps)) != len(steps):
        raise ValueError(f"duplicate steps in retention input: {sorted(steps)}")
    keep = protections(ckpts, protected_steps)
    for s, why in policy.keep([c for c in ckpts if not c.quarantined]).items():
        keep.setdefault(s, []).append(why)
    return RetentionPlan(keep={s: keep[s] for s in sorted(keep)}, delete=sorted(s for s in steps if s not in keep))


def build_policy(cfg: RetentionConfig) -> Policy:
    """The policy a tier's ``retention`` config describes (any rule keeps)."""
    rules: list[Policy] = []
    if cfg.keep_all:
        rules.append(KeepAll())
    if cfg.keep_last:
        rules.append(KeepLastN(cfg.keep_last))
    if cfg.keep_every:
        rules.append(KeepEveryKSteps(cfg.keep_every))
    if cfg.keep_best:
        rules.append(KeepBestN(cfg.best_metric, cfg.best_mode, cfg.keep_best))
    if cfg.keep_pinned:
        rules.append(KeepPinned())
    return rules[0] if len(rules) == 1 else AnyOf(*rules)
