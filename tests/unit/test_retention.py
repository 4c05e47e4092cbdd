"""Retention policies as tables: input checkpoints -> kept steps (and why)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptflow.tasks.config import RetentionConfig
from ckptflow.tasks.retention import (
    AllOf,
    AnyOf,
    CheckpointInfo,
    KeepAll,
    KeepBestN,
    KeepEveryKSteps,
    KeepLastN,
    KeepPinned,
    build_policy,
    plan,
    protections,
)
from ckptflow.trainer.errors import ConfigError


def ck(step: int, **kw) -> CheckpointInfo:
    return CheckpointInfo(step=step, **kw)


STEPS = [ck(s) for s in (100, 200, 300, 400, 500)]


@pytest.mark.parametrize(
    "policy, ckpts, kept",
    [
        (KeepLastN(2), STEPS, {400, 500}),
        (KeepLastN(10), STEPS, {100, 200, 300, 400, 500}),
        (KeepLastN(1), [], set()),
        (KeepLastN(2), list(reversed(STEPS)), {400, 500}),  # input order does not matter
        (KeepEveryKSteps(200), STEPS, {200, 400}),
        (KeepEveryKSteps(1000), STEPS, set()),
        (KeepPinned(), [ck(1), ck(2, pinned=True), ck(3)], {2}),
        (KeepAll(), STEPS, {100, 200, 300, 400, 500}),
        (KeepLastN(1) | KeepEveryKSteps(200), STEPS, {200, 400, 500}),
        (AllOf(KeepEveryKSteps(100), KeepLastN(3)), STEPS, {300, 400, 500}),
        (KeepEveryKSteps(200) & KeepLastN(2), STEPS, {400}),
    ],
)
def test_policy_keeps_exactly(policy, ckpts, kept):
    """Invariant: a policy keeps exactly the steps its rule names, whatever the input order."""
    assert set(policy.keep(ckpts)) == kept


@pytest.mark.parametrize(
    "mode, n, kept",
    [
        ("min", 1, {300}),
        ("min", 2, {300, 500}),  # 100 and 500 tie at 2.0: the newer step wins
        ("max", 1, {200}),
        ("max", 2, {200, 500}),
    ],
)
def test_keep_best_ranks_by_metric_and_prefers_newer_on_ties(mode, n, kept):
    """Invariant: KeepBestN keeps the n best by the metric, ties broken toward the newer step;
    checkpoints without the metric or with NaN/inf are never ranked."""
    ckpts = [
        ck(100, metrics={"loss": 2.0}),
        ck(200, metrics={"loss": 3.0}),
        ck(300, metrics={"loss": 1.0}),
        ck(400, metrics={"lr": 0.1}),
        ck(500, metrics={"loss": 2.0}),
        ck(600, metrics={"loss": float("nan")}),
        ck(700, metrics={"loss": float("inf")}),
    ]
    assert set(KeepBestN("loss", mode, n).keep(ckpts)) == kept


def test_any_of_lists_every_reason():
    """Invariant: a step kept by several rules carries all their reasons."""
    why = (KeepLastN(1) | KeepEveryKSteps(500)).keep(STEPS)
    assert why[500] == "one of the last 1; step is a multiple of 500"


@pytest.mark.parametrize(
    "ckpts, expected",
    [
        # latest, pinned, leased: kept whatever the policy says
        (
            [ck(1, latest=True), ck(2), ck(3, verified=True)],
            {1: ["named by latest"], 3: ["newest verified checkpoint"]},
        ),
        (
            [ck(1, pinned=True), ck(2, leased=True), ck(3)],
            {1: ["pinned"], 2: ["leased by a reader"], 3: ["newest checkpoint (none verified yet)"]},
        ),
        # the newest *verified* one, even if newer unverified ones exist
        ([ck(1, verified=True), ck(2, verified=True), ck(3), ck(4)], {2: ["newest verified checkpoint"]}),
        # a quarantined checkpoint is never "the newest verified"
        ([ck(1, verified=True), ck(2, verified=True, quarantined=True)], {1: ["newest verified checkpoint"]}),
        ([], {}),
    ],
)
def test_protections(ckpts, expected):
    """Invariant: latest, the newest verified (else newest good), pinned and leased are protected."""
    assert protections(ckpts) == expected


@pytest.mark.parametrize(
    "policy, ckpts, keep, delete",
    [
        # keep last 1 -> only step 5 by policy; 2 is latest, 3 newest verified
        (KeepLastN(1), [ck(1), ck(2, latest=True), ck(3, verified=True), ck(4), ck(5)], {2, 3, 5}, [1, 4]),
        # quarantined ones do not count toward "last N": the two newest *good* ones stay
        (KeepLastN(2), [ck(1, verified=True), ck(2, verified=True), ck(3, quarantined=True)], {1, 2}, [3]),
        # a quarantined checkpoint that latest names stays (protections win)
        (KeepLastN(1), [ck(1, verified=True), ck(2, quarantined=True, latest=True)], {1, 2}, []),
        # every-K keeps history, last-N the recent ones; the rest goes, oldest first
        (KeepLastN(1) | KeepEveryKSteps(3), [ck(s, verified=True) for s in range(1, 8)], {3, 6, 7}, [1, 2, 4, 5]),
    ],
)
def test_plan_adds_protections_to_the_policy(policy, ckpts, keep, delete):
    """Invariant: plan keeps policy ∪ protections; quarantined checkpoints never count toward
    a policy; delete is everything else, oldest first."""
    p = plan(policy, ckpts)
    assert set(p.keep) == keep and p.delete == delete


def test_plan_caller_protection_and_duplicates():
    p = plan(KeepLastN(1), [ck(1), ck(2), ck(3)], protected_steps=[1])
    assert p.keep[1] == ["protected by the caller"] and p.delete == [2]
    with pytest.raises(ValueError, match="duplicate"):
        plan(KeepLastN(1), [ck(1), ck(1)])


@given(
    st.lists(
        st.builds(
            CheckpointInfo,
            step=st.integers(0, 10_000),
            pinned=st.booleans(),
            verified=st.booleans(),
            quarantined=st.booleans(),
            latest=st.booleans(),
            leased=st.booleans(),
        ),
        unique_by=lambda c: c.step,
        max_size=30,
    ),
    st.integers(1, 5),
    st.integers(1, 1000),
)
@settings(max_examples=200, deadline=None)
def test_plan_never_deletes_a_protected_checkpoint(ckpts, n, k):
    """Invariant, for any input: nothing latest/pinned/leased or the newest verified is deleted;
    keep and delete partition the input."""
    p = plan(KeepLastN(n) | KeepEveryKSteps(k), ckpts)
    steps = {c.step for c in ckpts}
    assert set(p.keep) | set(p.delete) == steps and not set(p.keep) & set(p.delete)
    for c in ckpts:
        if c.latest or c.pinned or c.leased:
            assert c.step in p.keep
    good = [c.step for c in ckpts if c.verified and not c.quarantined]
    if good:
        assert max(good) in p.keep


def test_build_policy_from_config():
    pol = build_policy(RetentionConfig(keep_last=2, keep_every=300, keep_best=1, keep_pinned=False))
    ckpts = [ck(100, metrics={"loss": 0.5}), ck(200), ck(300), ck(400), ck(500)]
    assert set(pol.keep(ckpts)) == {100, 300, 400, 500} and pol.needs_metrics
    assert repr(build_policy(RetentionConfig(keep_last=3, keep_pinned=False))) == "KeepLastN(3)"


@pytest.mark.parametrize(
    "make", [lambda: KeepLastN(0), lambda: KeepEveryKSteps(-1), lambda: KeepBestN("loss", "median"), lambda: AnyOf()]
)
def test_bad_policy_arguments(make):
    with pytest.raises(ConfigError):
        make()
