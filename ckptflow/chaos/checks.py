"""The invariants a trial checks, each through the code path a user's recovery would take.

* :func:`tier_views` — every checkpoint a tier calls committed is fetched with every byte
  checked (``tasks.transfer.fetch``) and verified (``trainer.verify``): a committed half
  checkpoint shows up as ``bad``.
* :func:`latest_problem` — ``latest`` names a checkpoint that verifies.
* :func:`restore_check` — ``tasks.transfer.restore`` returns a checkpoint that verifies.
* :func:`resume_problem` — ``trainer.resume.find_resume_point`` picks the expected step.
* :class:`NoUnpickle` — proves a block of code unpickled nothing (a CPython audit hook on
  ``pickle.find_class``, which fires for every global any pickle asks for) except through
  ``trainer.dcpmeta``'s allow-listed reader of ``.metadata``, which resolves only DCP's own
  record classes and is counted apart.
* :func:`leftovers` — garbage a crash left (orphan objects, ``.tmp``/``.deleting`` dirs):
  not a broken promise, but reported, since nothing but age-based clean-up removes it.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from ckptflow.chaos.workspace import Scratch, list_keys
from ckptflow.tasks.storage import Tier
from ckptflow.tasks.transfer import fetch, restore
from ckptflow.trainer.errors import CkptflowError
from ckptflow.trainer.format import commit, layout
from ckptflow.trainer.format.atomicity import DELETING_SUFFIX
from ckptflow.trainer.resume import ResumeReport, find_resume_point
from ckptflow.trainer.verify import verify_checkpoint


@dataclass(slots=True)
class TierView:
    tier: str
    committed: list[int] = field(default_factory=list)
    good: list[int] = field(default_factory=list)
    bad: dict[int, str] = field(default_factory=dict)
    unlisted: str | None = None
    """The tier could not even be listed (then nothing on it counts as good)."""


def _fresh(scratch: Scratch, what: str) -> str:
    return scratch.scratch_dir(f"{what}-{uuid.uuid4().hex[:8]}")


def tier_view(tier: Tier, scratch: Scratch) -> TierView:
    v = TierView(tier.name)
    try:
        v.committed = tier.committed_steps(scratch.run_id)
    except (CkptflowError, OSError) as e:
        v.unlisted = str(e)
        return v
    for s in v.committed:
        dst = _fresh(scratch, f"view-{tier.name}-{s}")
        try:
            fetch(tier, scratch.run_id, s, dst)
            res = verify_checkpoint(dst)
            if res.ok:
                v.good.append(s)
            else:
                v.bad[s] = str(res.problems[0])
        except (CkptflowError, OSError) as e:
            v.bad[s] = f"{type(e).__name__}: {e}"
        finally:
            shutil.rmtree(dst, ignore_errors=True)
    return v


def tier_views(scratch: Scratch, tiers: Sequence[Tier] | None = None) -> dict[str, TierView]:
    return {t.name: tier_view(t, scratch) for t in (tiers or scratch.tiers())}


def half_committed(views: dict[str, TierView]) -> list[str]:
    """A committed checkpoint that does not verify: the one thing a commit protocol forbids."""
    return [
        f"{v.tier} step {s} is committed but does not verify: {why}"
        for v in views.values()
        for s, why in sorted(v.bad.items())
    ]


def lost_steps(views: dict[str, TierView], must_survive: set[int]) -> list[str]:
    good = {s for v in views.values() for s in v.good}
    return [f"step {s} exists on no tier in a form that verifies" for s in sorted(must_survive - good)]


def latest_problem(run_path: str) -> str | None:
    """None when ``latest`` is absent (nothing committed yet) or names a checkpoint that verifies."""
    path = os.path.join(run_path, layout.LATEST)
    if not os.path.exists(path):
        return None
    step = commit.read_latest(run_path)
    if step is None:
        return f"{path} is unreadable"
    res = verify_checkpoint(os.path.join(run_path, layout.step_name(step)))
    return None if res.ok else f"latest names {layout.step_name(step)}, which does not verify: {res.problems[0]}"


@dataclass(slots=True)
class RestoreOutcome:
    step: int | None
    tier: str | None
    problem: str | None
    skipped: list[tuple[str, str]]
    seconds: float


def restore_check(tiers: Sequence[Tier], scratch: Scratch) -> RestoreOutcome:
    """Restore the newest good checkpoint into scratch, then verify what came back."""
    dst = _fresh(scratch, "restore")
    try:
        got = restore(list(tiers), scratch.run_id, dst)
        res = verify_checkpoint(got.dst_dir)
        problem = None if res.ok else f"restore returned {got.uri}, which does not verify: {res.problems[0]}"
        return RestoreOutcome(got.step, got.tier, problem, [(k.uri, k.reason) for k in got.skipped], got.seconds)
    except (CkptflowError, OSError) as e:
        return RestoreOutcome(None, None, f"{type(e).__name__}: {e}", [], 0.0)
    finally:
        shutil.rmtree(dst, ignore_errors=True)


def resume_problem(run_path: str, expect: int | None) -> tuple[str | None, ResumeReport]:
    rep = find_resume_point(run_path)
    got = rep.chosen.step if rep.chosen else None
    if got != expect:
        return f"resume would start from {got}, expected {expect} (skipped: {rep.skipped})", rep
    return None, rep


def leftovers(scratch: Scratch, s3) -> list[str]:
    """Objects under a cold step prefix without its marker; .tmp/.deleting dirs on hot/warm."""
    out = []
    marked = set()
    keys = list_keys(s3, scratch.bucket, f"{scratch.prefix}/{scratch.run_id}")
    for k in keys:
        if k.endswith("/" + layout.COMMIT_MARKER):
            marked.add(k.rsplit("/", 2)[-2])
    for k in keys:
        step_part = k.split("/")[-2] if k.count("/") >= 3 else ""
        if layout.parse_step(step_part) is not None and step_part not in marked:
            out.append(f"cold: {k} (no {layout.COMMIT_MARKER})")
    for tier_dir in (scratch.hot, scratch.warm):
        run = os.path.join(tier_dir, scratch.run_id)
        for n in sorted(os.listdir(run)) if os.path.isdir(run) else []:
            if layout.parse_tmp_step(n) is not None or n.endswith(DELETING_SUFFIX):
                out.append(f"{os.path.basename(tier_dir)}: {n}")
    return out


class NoUnpickle:
    """``with NoUnpickle() as n: ...`` then ``n.events`` lists every (module, name) unpickled.

    Audit hooks cannot be removed, so one hook is installed per process and switched on
    for the calling thread only (other threads' pickles are not this block's doing).

    A global resolved by ``trainer.dcpmeta``'s restricted unpickler is not an event but is
    counted in ``n.restricted``: that reader is how every ckptflow path parses ``.metadata``
    (after its checksum matched), it resolves only DCP's record classes and refuses the rest
    before resolving them, so it runs no code a file asks for. Anything else (``pickle.load``,
    ``torch.load``, DCP's own reader) is an event.
    """

    _installed = False
    _active: dict[int, NoUnpickle] = {}
    _restricted_code: object = None

    def __enter__(self) -> NoUnpickle:
        if not NoUnpickle._installed:
            from ckptflow.trainer.format.dcpmeta import MetadataUnpickler

            NoUnpickle._restricted_code = MetadataUnpickler.find_class.__code__
            sys.addaudithook(NoUnpickle._hook)
            NoUnpickle._installed = True
        self.events: list[tuple[str, str]] = []
        self.restricted = 0
        NoUnpickle._active[threading.get_ident()] = self
        return self

    def __exit__(self, *exc: object) -> None:
        NoUnpickle._active.pop(threading.get_ident(), None)

    @staticmethod
    def _hook(event: str, args: tuple) -> None:
        if event != "pickle.find_class":
            return
        sink = NoUnpickle._active.get(threading.get_ident())
        if sink is None:
            return
        # The event is raised inside C's find_class; the nearest Python frame is whoever
        # called it: the restricted unpickler's override, or a plain unpickler's caller.
        caller = sys._getframe(1)
        if caller.f_code is NoUnpickle._restricted_code:
            sink.restricted += 1
        else:
            sink.events.append((str(args[0]), str(args[1])))
