"""Helpers shared by tests (not fixtures): paths, the reference job, configs, the CLI.

Servers, ports and processes come from the shared harness (``ckptflow.harness``); what is
here is only what tests need on top of it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ckptflow.harness import PY, child_env, free_port, reference_job, torchrun
from ckptflow.trainer.format import layout
from ckptflow.trainer.reference.metrics import last_per_step, read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
__all__ = ["PY", "REPO", "free_port", "last_per_step"]


def torchrun_env(extra: dict | None = None) -> dict:
    """A child's environment: no Prefect API, no fault, one thread (``extra`` on top)."""
    return child_env(extra)


def adopt_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``ckptflow adopt ARGS`` through the console script's entry, in a forked child with a child's environment
    (the tests that need a fresh interpreter, signals or privileges start ``python -m ckptflow.cli.main``)."""
    r = forked_cli(["adopt", *args], environ=env or torchrun_env(), cwd=REPO, timeout=120)
    assert not r.hung, f"ckptflow adopt {' '.join(args)} hung"
    return subprocess.CompletedProcess(["ckptflow", "adopt", *args], r.code, r.out, r.err)


def run_script(script: str, env: dict | None = None, *, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -c script`` from the repository, in a child's environment (``env`` on top): a real
    process of its own, so a script can build its process group and exit as a worker does. A script
    that runs to its end exits as the trainer's workers do (``distenv.exit_process``): interpreter
    finalization can tear down gloo's threads mid-call and SIGABRT a script that succeeded (seen in CI:
    ``terminate called without an active exception`` after its result was printed)."""
    ended = script + "\nfrom ckptflow.trainer.distenv import exit_process as _exit_process\n_exit_process(0)\n"
    return subprocess.run(
        [PY, "-c", ended], cwd=REPO, env=torchrun_env(env), capture_output=True, text=True, timeout=timeout
    )


def script_result(stdout: str) -> dict:
    """The JSON a script printed on its ``RESULT `` line."""
    line = next(x for x in stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def run_torchrun(
    args: list[str],
    *,
    nproc: int = 2,
    max_restarts: int = 0,
    env: dict | None = None,
    module: str = "ckptflow.trainer.train",
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    cmd = torchrun(module, args, nproc=nproc, max_restarts=max_restarts)
    return subprocess.run(cmd, cwd=REPO, env=torchrun_env(env), capture_output=True, text=True, timeout=timeout)


def make_run(
    root: str,
    run_id: str = "r1",
    *,
    max_steps: int = 6,
    save_every: int = 2,
    nproc: int = 1,
    extra_args: list[str] | None = None,
    env: dict | None = None,
) -> str:
    """Train the tiny reference model and commit checkpoints; returns the run dir.

    ``nproc=1`` runs a plain process (no torchrun, ~5 s); more launches torchrun.
    """
    cmd = reference_job(str(root), run_id, max_steps=max_steps, save_every=save_every, nproc=nproc, extra=extra_args)
    r = subprocess.run(cmd, cwd=REPO, env=torchrun_env(env), capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise AssertionError(f"training failed (rc={r.returncode}):\n{r.stderr[-4000:]}")
    return os.path.join(str(root), run_id)


def metrics(run_dir: str) -> list[dict]:
    return read_metrics(run_dir)


def step_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, layout.step_name(step))


def tmp_dirs(run_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(run_dir) if layout.parse_tmp_step(n) is not None)


def read_latest(run_dir: str) -> str:
    with open(os.path.join(run_dir, layout.LATEST)) as f:
        return f.read().strip()


def flip_byte(path: str, offset: int | None = None) -> None:
    size = os.path.getsize(path)
    off = size // 2 if offset is None else offset
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x01]))


# ---- configs -------------------------------------------------------------------------


def write_config(
    tmp_path, hot, s3_endpoint, bucket, *, hot_keep=2, warm_keep=2, cold_keep=3, sanity=True, lifecycle=""
) -> str:
    cfg = tmp_path / "ckptflow.toml"
    cfg.write_text(f"""
[hot]
url = "{hot}"
[hot.retention]
keep_last = {hot_keep}
[warm]
url = "{tmp_path / "warm"}"
codec = "zstd"
[warm.retention]
keep_last = {warm_keep}
[cold]
url = "s3://{bucket}/ckpt"
codec = "zstd"
endpoint_url = "{s3_endpoint}"
storage_class = "STANDARD_IA"
[cold.retention]
keep_last = {cold_keep}
[lifecycle]
sanity_step = {str(sanity).lower()}
{lifecycle}
""")
    return str(cfg)


# ---- the CLI in this process -----------------------------------------------------------


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self):
        return json.loads(self.out)


def invoke(capsys, *args: str) -> Result:
    """Run ``ckptflow ARGS`` in this process; returns exit code, stdout, stderr."""
    from ckptflow.cli.errors import run_cli
    from ckptflow.cli.main import app

    capsys.readouterr()
    code = run_cli(app, [str(a) for a in args])
    cap = capsys.readouterr()
    return Result(code, cap.out, cap.err)


@dataclass
class Ran:
    """A command run in a child process: its exit code (None: it was killed after ``timeout``)."""

    code: int | None
    out: str
    err: str
    seconds: float

    @property
    def hung(self) -> bool:
        return self.code is None

    def one_line_error(self) -> str:
        """The command's error, which must be exactly one ``ckptflow: error:`` line on stderr."""
        lines = [x for x in self.err.splitlines() if x.strip()]
        errors = [x for x in lines if x.startswith("ckptflow: error:")]
        assert len(errors) == 1 and lines[-1] == errors[0], f"not one clear error line:\n{self.err[-2000:]}"
        return errors[0]


def forked_cli(
    argv: list[str],
    *,
    env: dict | None = None,
    environ: dict | None = None,
    cwd: str | None = None,
    timeout: float = 60,
) -> Ran:
    """``ckptflow ARGV`` as the console script runs it (``run_cli`` of its app), in a child forked from this
    process (its imports already done: milliseconds instead of a fresh interpreter's seconds), with its own
    stdout, stderr, environment (``env`` added to this one's, or ``environ`` instead of it) and working
    directory, killed after ``timeout``: a command that would hang on hostile input fails the test instead of
    the suite."""
    from ckptflow.cli.errors import run_cli
    from ckptflow.cli.main import app

    _warm_commands()
    return forked(lambda: run_cli(app, [str(a) for a in argv]), env=env, environ=environ, cwd=cwd, timeout=timeout)


_COMMAND_IMPORTS = (
    "rich.console",
    "rich.progress",
    "rich.table",
    "rich.text",
    "safetensors.torch",
    "zstandard",
    "ckptflow.trainer.format.dcpmeta",
    "ckptflow.trainer.verify",
    "ckptflow.tasks.adopt",
    "ckptflow.tasks.codec.tool",
    "ckptflow.tasks.export",
    "ckptflow.tasks.prune",
    "ckptflow.tasks.retention",
    "ckptflow.tasks.stages",
    "ckptflow.tasks.storage",
    "ckptflow.tasks.transfer",
)


_WARM: list[bool] = []


def _warm_commands() -> None:
    """What the commands import when they run (and what building the command line imports: click, pydantic),
    imported here once: each forked child starts from it instead of importing it again per command (a forked
    ``verify`` 1.2 s -> 0.07 s)."""
    import contextlib
    import importlib
    import io

    from ckptflow.cli.errors import run_cli
    from ckptflow.cli.main import app

    if _WARM:
        return
    for name in _COMMAND_IMPORTS:
        importlib.import_module(name)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        run_cli(app, ["ls", "--help"])
    _WARM.append(True)


def forked(
    fn, *, env: dict | None = None, environ: dict | None = None, cwd: str | None = None, timeout: float = 60
) -> Ran:
    """``fn()`` in a forked child (see :func:`forked_cli`); its exit code is what ``fn`` returns (an int; 0
    for anything else), 99 for an exception, whose type and message end its stderr."""
    import signal
    import sys
    import tempfile
    import time

    with tempfile.TemporaryDirectory(prefix="ckptflow-fork-") as d:
        out_p, err_p = os.path.join(d, "out"), os.path.join(d, "err")
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 99
            try:
                os.setpgid(0, 0)
                for fd, p in ((1, out_p), (2, err_p)):
                    os.dup2(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
                sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the child's own streams
                sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
                if cwd:
                    os.chdir(cwd)
                if environ is not None:
                    os.environ.clear()
                os.environ.update(environ or {})
                os.environ.update(env or {})
                got = fn()
                code = got if isinstance(got, int) and not isinstance(got, bool) else 0
                sys.stdout.flush()
                sys.stderr.flush()
            except BaseException as e:  # noqa: BLE001 - reported through the exit code and stderr
                os.write(2, f"forked: {type(e).__name__}: {e}\n".encode())
            finally:
                os._exit(code)
        code: int | None = None
        while time.monotonic() - t0 < timeout:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                break
            time.sleep(0.01)
        else:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        seconds = time.monotonic() - t0
        with open(out_p) as fo, open(err_p) as fe:
            return Ran(code, fo.read(), fe.read(), seconds)


def pickle_bomb(depth: int = 60) -> bytes:
    """``str`` of a list nested in itself ``depth`` times: only allow-listed callables, a few hundred bytes,
    more work than any machine has (each level doubles the text)."""
    out = b"\x80\x04cbuiltins\nstr\n]q\x000"  # PROTO 4, GLOBAL builtins.str, EMPTY_LIST, BINPUT 0, POP
    out += b"(h\x00h\x00lq\x000" * depth  # MARK, BINGET 0, BINGET 0, LIST, BINPUT 0, POP: a = [a, a]
    return out + b"h\x00\x85R."  # BINGET 0, TUPLE1, REDUCE: str(a)


# ---- a run's files as the trainer and the drill write them ------------------------------


def fake_run(
    root,
    run_id="m1",
    *,
    step_s=0.5,
    stall_s=2.0,
    commit_s=3.0,
    every=10,
    steps=40,
    restart_at=25,
    drills=(100.0, 120.0, 110.0),
) -> str:
    """A run's files as the trainer and the drill write them: saves every ``every`` steps,
    each adding ``stall_s`` to the next step; a torchrun restart resumes after ``restart_at``'s
    last checkpoint (steps repeat, ``t`` restarts from zero)."""
    run = os.path.join(root, "hot", run_id)
    os.makedirs(run)
    rows, outbox, wall0 = [], [], 1.8e9
    resume = (restart_at // every) * every
    for attempt, (first, last) in enumerate([(1, restart_at), (resume + 1, steps)]):
        t = 3.0  # start-up before the first step
        for s in range(first, last + 1):
            t += step_s + (stall_s if (s - 1) % every == 0 and s > 1 else 0.0)
            rows.append(
                {
                    "step": s,
                    "loss": 1.0,
                    "lr": 1e-3,
                    "attempt": attempt,
                    "t": round(t, 4),
                    "wall": wall0 + attempt * 1000 + t,
                }
            )
            if s % every == 0:
                outbox.append({"step": s, "committed_at": rows[-1]["wall"] + commit_s})
    with open(os.path.join(run, layout.METRICS), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
        f.write('{"step": 41, "t": ')  # a torn last line (killed mid-write) is ignored
    with open(os.path.join(run, layout.OUTBOX), "w") as f:
        f.writelines(json.dumps(o) + "\n" for o in outbox)
    for s in range(every, steps + 1, every):
        os.makedirs(os.path.join(run, layout.step_name(s)))
    hist = os.path.join(root, "drills")
    os.makedirs(hist)
    with open(os.path.join(hist, f"{run_id}.jsonl"), "w") as f:
        for d in drills:
            f.write(json.dumps({"run_id": run_id, "ok": True, "recovery_seconds": d}) + "\n")
        f.write(json.dumps({"run_id": run_id, "ok": False, "recovery_seconds": 5.0}) + "\n")  # failed: ignored
    return run


# ---- the checkpoint-interval model, written independently (brute force) ---------------


def grid(center: float, span: float = 100.0, n: int = 40001) -> np.ndarray:
    """Log-spaced intervals around ``center``: neighbours differ by < 0.03 %."""
    return np.exp(np.linspace(math.log(center / span), math.log(center * span), n))


def brute_first_order(s: float, r: float, m: float) -> float:
    t = grid(math.sqrt(2 * s * m))
    return float(t[np.argmin(s / t + (t / 2 + r) / m)])


def brute_exact(s: float, r: float, m: float) -> float:
    """argmax of Daly's availability T / (M e^{R/M} (e^{(T+S)/M} - 1)), written independently."""
    t = grid(min(math.sqrt(2 * s * m), m))
    t = t[(t + s) / m < 600]  # no overflow in exp
    a = t / (m * np.exp(r / m) * np.expm1((t + s) / m))
    return float(t[np.argmax(a)])


# ---- the cold tier as S3 sees it ------------------------------------------------------


def cold_steps(s3_endpoint, bucket, run_id) -> set[int]:
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    keys = [
        o["Key"]
        for p in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"ckpt/{run_id}/")
        for o in p.get("Contents", [])
    ]
    return {layout.parse_step(k.split("/")[2]) for k in keys if k.endswith("/" + layout.COMMIT_MARKER)}


def cold_objects(s3_endpoint, bucket) -> dict[str, str]:
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    return {
        o["Key"]: str(o["LastModified"])
        for p in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        for o in p.get("Contents", [])
    }


# ---- processes ---------------------------------------------------------------------------


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def _drain_prefect_workers() -> None:
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=10)


@contextmanager
def prefect_at(api: str) -> Iterator[str]:
    """This process's Prefect settings pointed at the server ``api`` for the block.

    Prefect's event and log workers are process-wide, and each keeps the server it first sent
    to: after a block on another server (the fleet's PostgreSQL one), a later test's events went
    to that stopped server and were lost, and the process spent minutes at exit retrying them.
    They are drained, with a bound, on the way in and on the way out."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    _drain_prefect_workers()
    with temporary_settings(updates={PREFECT_API_URL: api}):
        try:
            yield api
        finally:
            _drain_prefect_workers()


def server_event(api: str, resource: str, name: str | None = None) -> dict:
    """The event about ``resource`` (named ``name``, when given) that the Prefect server stored,
    read through its REST API as a client reads it."""
    import time
    import urllib.request

    filt: dict = {"resource": {"id": [resource]}}
    if name is not None:
        filt["event"] = {"name": [name]}
    body = json.dumps({"filter": filt, "limit": 5}).encode()
    for _ in range(100):  # the server's consumer stores events in the background
        req = urllib.request.Request(
            api.rstrip("/") + "/events/filter", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            found = json.loads(resp.read())["events"]
        if found:
            return found[0]
        time.sleep(0.2)
    raise AssertionError(f"no {name or 'event'} about {resource} on {api}")
