"""The verify stage: integrity, restore sanity step, expectations — or quarantine.

(a) every file against the manifest (size + xxh3-128), before anything is loaded;
(b) the restore sanity step in a *fresh process* at world size 1 (``tasks.sanity``):
    rebuild, load (resharding), recompute the probe loss and compare (bitwise on the
    same platform), check the restored scheduler's learning rate;
(c) Great Expectations over per-tensor statistics (finite, Adam v >= 0, bounded norm
    change since the previous verified checkpoint, step forward).

"Could not check" is not "bad": only damaged bytes, a probe or learning-rate mismatch, a failed
parse or a failed expectation quarantine. A sanity step that could not run to its verdict (killed
for memory, past ``lifecycle.sanity_timeout_s``, no builder for the model on this worker, a model
that would not take the verified bytes) leaves a checkpoint whose every byte verified *unproven*:
the record says why (``proven: false``, ``not_proven``), the flow alerts, and the checkpoint goes
on to warm and cold. Holding it back would keep the only copies on the machine most likely to
fail, for a doubt about the checker; a restore drill proves it later.

The action of the lifecycle's verify stage (``tasks/stages.py`` writes its record:
``verified.json`` on a pass, ``quarantined.json`` with the reasons on a fail — then the
checkpoint is never promoted and the trainer's resume skips it). It writes the
companions the next checkpoint's expectations compare against (``stats.json``,
``expectations.json``) beside the records. :func:`verify_parts` checks the nodes' parts of
one node-local checkpoint together (``ckptflow verify DIR DIR ...``).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ckptflow.tasks import forkserver, records
from ckptflow.tasks.adopt import is_adopted, parse_check
from ckptflow.tasks.checkpoint import CheckpointRef
from ckptflow.tasks.expectations import ExpectationReport
from ckptflow.trainer import faults
from ckptflow.trainer.errors import CheckpointNotFoundError
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.commit import set_aside_steps
from ckptflow.trainer.verify import VerifyResult, verify_checkpoint

SANITY_MODULE = "ckptflow.tasks.sanity"

log = logging.getLogger(__name__)


@dataclass(slots=True)
class VerifyOutcome:
    run_id: str
    step: int
    ok: bool
    reasons: list[str] = field(default_factory=list)
    integrity: dict[str, Any] = field(default_factory=dict)
    sanity: dict[str, Any] = field(default_factory=dict)
    expectations: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    proven: bool = True
    """False when the sanity step could not run to a verdict (``ok`` stays True: see the module doc)."""
    not_proven: str | None = None
    """Why it could not, when ``proven`` is False."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


CRASHED, TIMEOUT = "sanity-crashed", "timeout"

_COULD_NOT = {
    CRASHED: "the check's process died before its verdict",
    TIMEOUT: "the check ran past lifecycle.sanity_timeout_s",
    "ConfigError": "this worker cannot build the model",
    "load": "the model built here would not take the verified bytes",
    "resources": "the check ran out of memory",
    "ResourceError": "the check could not get what it needs to run",
    "no-sanity-spec": "the manifest records no model to rebuild",
    "no-replay": "the model's builder cannot replay the recorded step",
}
"""Errors of a sanity step (or an adopted checkpoint's own check) that did not reach a verdict on the
checkpoint: each is a fact about the worker or the check, not the bytes (which verified first)."""


def could_not_check(res: dict[str, Any]) -> str | None:
    """Why a check's result says nothing about the checkpoint, or None when it is a verdict (a pass, or a
    mismatch, damaged bytes, a failed parse: those quarantine)."""
    what = _COULD_NOT.get(str(res.get("error")))
    if res.get("ok") or what is None:
        return None
    problems = res.get("problems") or []
    return f"{what} ({problems[0][:500]})" if problems else what


FORK_DIED = -1001
"""``_sanity_forked``'s return code for a fork-server child that died before answering (its status is the
server's): killed, most likely, for memory."""


def _died(returncode: int) -> str:
    if returncode == FORK_DIED:
        return "the fork server's child died before its verdict (killed: by a memory limit, or an operator)"
    if returncode < 0:
        import signal

        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else str(-returncode)
        hint = " (the kernel's OOM killer or a memory limit, or an operator)" if name == "SIGKILL" else ""
        return f"killed by {name}{hint}"
    return f"exited {returncode} without a result"


def run_sanity(ckpt_dir: str, *, nproc: int = 1, timeout_s: float = 900, stats: bool = True) -> dict[str, Any]:
    """Run ``tasks.sanity`` in a fresh process (or a torchrun job of ``nproc`` ranks).

    At world size 1 the fresh process is a child of this machine's fork server when there is
    one (``tasks/forkserver.py``: the imports are done once per worker, not per checkpoint);
    ``process`` in the result says which ran it.
    """
    with tempfile.TemporaryDirectory(prefix="ckptflow-sanity-") as tmp:
        out = os.path.join(tmp, "result.json")
        args = [ckpt_dir, "--out", out, *(["--stats"] if stats else [])]
        t0 = time.perf_counter()
        try:
            ran = _sanity_forked(args, timeout_s) if nproc == 1 else None
            if ran is not None:
                returncode, stderr = ran
                how = "forkserver"
            else:
                returncode, stderr = _sanity_fresh(args, nproc, timeout_s)
                how = "fresh" if nproc == 1 else f"torchrun x{nproc}"
        except subprocess.TimeoutExpired:
            return {
                "ok": False,
                "error": TIMEOUT,
                "problems": [f"the sanity step ran past {timeout_s:g} s on {ckpt_dir}; killed"],
                "process_seconds": time.perf_counter() - t0,
            }
        try:
            with open(out) as f:
                res = json.load(f)
        except (OSError, json.JSONDecodeError):
            res = {"ok": False, "error": CRASHED, "problems": [f"{_died(returncode)}: {stderr[-2000:]}"]}
        res["process_seconds"] = time.perf_counter() - t0
        res["returncode"] = returncode
        res["process"] = how
        return res


ADOPTED_CHECK = """
import importlib, json, sys, traceback
name, ckpt, out = sys.argv[1:4]
try:
    mod, fn = name.split(":")
    got = getattr(importlib.import_module(mod), fn)(ckpt)
    res = {"ok": True, "details": got if isinstance(got, dict) else None}
except Exception as e:
    why = f"{name}: {type(e).__name__}: {e}"[:2000]
    res = {"ok": False, "problems": [why], "trace": traceback.format_exc()[-4000:]}
with open(out, "w") as f:
    json.dump(res, f, default=str)
"""


def run_adopted_check(name: str, ckpt_dir: str, *, timeout_s: float = 900) -> dict[str, Any]:
    """The configured ``lifecycle.adopted_check`` on ``ckpt_dir``, in a fresh process: its result,
    ``ok`` False with the error when the function raised, crashed or ran past ``timeout_s``."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ckptflow-adopted-check-") as tmp:
        out = os.path.join(tmp, "result.json")
        r = None
        try:
            r = subprocess.run(
                [sys.executable, "-c", ADOPTED_CHECK, name, ckpt_dir, out],
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
            with open(out) as f:
                res = json.load(f)
        except subprocess.TimeoutExpired:
            res = {"ok": False, "error": TIMEOUT, "problems": [f"{name} ran past {timeout_s:.0f} s on {ckpt_dir}"]}
        except (OSError, json.JSONDecodeError):
            why = f"{_died(r.returncode)}: {r.stderr[-1500:]}" if r is not None else "did not start"
            res = {"ok": False, "error": CRASHED, "problems": [f"{name} crashed ({why})"]}
    res.update(check=name, seconds=time.perf_counter() - t0)
    return res


def _sanity_forked(args: list[str], timeout_s: float) -> tuple[int, str] | None:
    try:
        got = forkserver.call("sanity", {"argv": args}, timeout_s=timeout_s)
    except TimeoutError:
        raise subprocess.TimeoutExpired(["forkserver:sanity", *args], timeout_s) from None
    except forkserver.ForkServerError as e:  # the check died (or raised past main): like a crash
        return FORK_DIED, f"{e}\n{e.log_tail}"
    return None if got is None else (int(got["rc"]), "")


def _sanity_fresh(args: list[str], nproc: int, timeout_s: float) -> tuple[int, str]:
    mod = ["-m", SANITY_MODULE, *args]
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "--max-restarts=0",
            *mod,
        ]
    else:
        cmd = [sys.executable, *mod]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.pop("CKPTFLOW_FAULT", None)  # faults are for the job under test, not the checker
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    return p.returncode, p.stderr


def validate_expectations(
    stats: list[dict], prev_stats: list[dict] | None, *, step: int, prev_step: int | None, max_norm_change: float
) -> ExpectationReport:
    """The expectation suite, in a fork-server child when there is one (Great Expectations is
    ~5 CPU-s to import, 0.15 s to validate), else here."""
    args = {"stats": stats, "prev_stats": prev_stats, "step": step, "prev_step": prev_step}
    got = forkserver.call("expectations", {**args, "max_norm_change": max_norm_change}, timeout_s=600)
    if got is not None:
        return ExpectationReport(**got)
    from ckptflow.tasks.expectations import validate

    return validate(stats, prev_stats, step=step, prev_step=prev_step, max_norm_change=max_norm_change)


def _previous_verified(run_path: str, step: int) -> tuple[int | None, list[dict] | None]:
    """The newest earlier step the verify stage passed with statistics (an unproven one has none: the norm change
    is measured against the one before it, never against nothing)."""
    from ckptflow.tasks.stages import VERIFY

    for s in sorted(records.steps_with_records(run_path), reverse=True):
        if s < step and records.read_record(run_path, s, VERIFY.record) is not None:
            stats = records.read_side_file(run_path, s, layout.STATS)
            if stats is not None:
                return s, stats
    return None, None


def verify(
    ref: CheckpointRef,
    *,
    sanity_step: bool = True,
    expectations: bool = True,
    max_norm_change: float = 0.5,
    ckpt_dir: str | None = None,
) -> VerifyOutcome:
    """Integrity, then the sanity step, then the expectations, of the checkpoint on hot (or in
    ``ckpt_dir``: a complete copy fetched from warm); the first check that fails decides, and a sanity
    step that could not run leaves it unproven (module doc)."""
    run_path, step, run_id = ref.records_path, ref.step, ref.run_id
    sanity_timeout_s = ref.cfg.lifecycle.sanity_timeout_s
    t0 = time.perf_counter()
    ckpt = ckpt_dir or ref.hot_dir
    if not os.path.isdir(ckpt):
        aside = [n for n in set_aside_steps(ref.run_path) if layout.parse_set_aside(n) == step]
        if aside and ckpt_dir is None:
            raise CheckpointNotFoundError(
                f"{ckpt} was found damaged and set aside ({os.path.join(ref.run_path, layout.DAMAGED_DIR, aside[-1])}"
                "): no longer committed, nothing to verify; a new save of the step starts its own lifecycle"
            )
        # Not a bad checkpoint but no checkpoint: a stale event, or pruned before its
        # lifecycle ran. Quarantining a name would be misleading; fail loudly instead.
        raise CheckpointNotFoundError(
            f"{ckpt} does not exist (pruned, or the event is stale); "
            "nothing to verify — check the run's committed steps"
        )
    out = VerifyOutcome(run_id, step, False)

    integ = verify_checkpoint(ckpt, expect=(run_id, step), part=True)
    if integ.elsewhere and not integ.problems:
        # Saved on node-local roots, and this node holds only its part: not a bad checkpoint, one
        # that cannot be checked from here. Quarantining it would throw a good checkpoint away.
        raise CheckpointNotFoundError(
            f"{ckpt} is one node's part of step {step}: {len(integ.elsewhere)} of its files are on other nodes "
            f"({', '.join(integ.elsewhere[:3])}{' ...' if len(integ.elsewhere) > 3 else ''}); a node-local "
            "checkpoint is verified where it is whole — run with replicas covering every node, or verify the "
            "parts together ('ckptflow verify DIR DIR ...'); nothing was quarantined"
        )
    faults.maybe_crash("verify.integrity", step)
    out.integrity = {
        "ok": integ.ok,
        "bytes": integ.bytes_checked,
        "seconds": integ.seconds,
        "problems": [str(p) for p in integ.problems],
    }
    if not integ.ok:
        out.reasons = [f"integrity: {p}" for p in integ.problems]
        return _finish(out, t0)

    stats = None
    if sanity_step and integ.manifest is not None and is_adopted(integ.manifest):
        # Adopted from another tool: no probe was recorded to replay; every file must parse.
        out.sanity = parse_check(ckpt, integ.manifest)
        check = ref.cfg.lifecycle.adopted_check
        if out.sanity["ok"] and check:  # then the user's own check, in a fresh process
            user = run_adopted_check(check, ckpt, timeout_s=sanity_timeout_s)
            out.not_proven = could_not_check(user)
            if out.not_proven is None:
                out.sanity.update(ok=user["ok"], user_check=user)
                out.sanity["problems"] += user.get("problems", [])
            else:
                out.sanity.update(user_check=user)
        if not out.sanity["ok"]:
            out.reasons = [f"sanity: {w}" for w in out.sanity["problems"]]
            return _finish(out, t0)
    elif sanity_step:
        san = run_sanity(ckpt, stats=expectations, timeout_s=sanity_timeout_s)
        faults.maybe_crash("verify.sanity", step)
        stats = san.pop("stats", None)
        out.sanity = san
        out.not_proven = could_not_check(san)
        if out.not_proven is None and not san.get("ok"):
            why = san.get("problems") or [
                f"probe loss {san.get('probe_loss_restored')} != recorded {san.get('probe_loss_recorded')} "
                f"({san.get('probe_match')}); lr {san.get('lr_restored')} vs {san.get('lr_recorded')}"
            ]
            out.reasons = [f"sanity: {w}" for w in why]
            return _finish(out, t0)

    if expectations and stats is not None:
        prev_step, prev_stats = _previous_verified(run_path, step)
        rep = validate_expectations(stats, prev_stats, step=step, prev_step=prev_step, max_norm_change=max_norm_change)
        out.expectations = {
            "success": rep.success,
            "failures": rep.failures,
            "previous_step": prev_step,
            "result_file": records.write_side_file(run_path, step, layout.EXPECTATIONS, rep.result),
        }
        if not rep.success:
            out.reasons = [f"expectations: {f}" for f in rep.failures]
            return _finish(out, t0)
    out.ok = True
    if out.not_proven is not None:
        out.proven = False
        log.warning("%s step %d: not proven restorable, carried on: %s", run_id, step, out.not_proven)
    if stats is not None:  # what the next checkpoint's norm-change expectation compares against
        records.write_side_file(run_path, step, layout.STATS, stats)
    return _finish(out, t0)


def _finish(out: VerifyOutcome, t0: float) -> VerifyOutcome:
    out.seconds = time.perf_counter() - t0
    return out


def verify_parts(
    ckpt_dirs: list[str], *, threads: int = 4, key: bytes | None = None
) -> tuple[list[VerifyResult], list[str]]:
    """Several nodes' parts of one checkpoint: each part verifies, all carry the same manifest, together they
    hold every file. Returns (per part, global problems)."""
    parts = [verify_checkpoint(d, threads=threads, key=key, part=True) for d in ckpt_dirs]
    problems: list[str] = []
    manifests = {r.manifest.to_json(key=b"") if r.manifest else None for r in parts}
    if None in manifests or len(manifests) != 1:
        problems.append("the parts do not carry one and the same readable manifest")
        return parts, problems
    m = parts[0].manifest
    assert m is not None  # every part's manifest was read (checked just above)
    held = {n for r in parts for n in m.files if n not in r.elsewhere}
    lost = sorted(set(m.files) - held)
    if lost:
        problems.append(f"step {m.step}: no part holds {', '.join(lost)}")
    return parts, problems
