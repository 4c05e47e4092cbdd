"""A fork server for the lifecycle's work: torch, DCP, Great Expectations, boto3 and s3fs
imported once per worker, a fresh forked child per check or stage.

    python -m ckptflow.tasks.forkserver --socket PATH [--parent PID]   # ``ckptflow worker`` starts it

Why: every lifecycle verifies its checkpoint, and on this machine the checks cost more in
imports than in work (docs/benchmarks.md, "Fleet"): the sanity step's fresh process spent
~3.5 of its 5.2-5.7 CPU-seconds importing torch and DCP, and Great Expectations ~5 s importing
in each flow-run process against 0.15 s validating, and the stages' own first use of torch
(DCP's metadata), boto3 and s3fs another ~5 s in every fresh flow-run process. At a fleet's
commit rate that import time is what the cores run out of. Prefect still starts a fresh
flow-run process per lifecycle (not ours to change); it now only orchestrates.

Isolation stays what a fresh process gives. The server imports modules and does nothing
else (no checkpoint, no model, no tensor op, no thread pool, no Prefect), then forks one
child per request: one check never sees another's state, and a check that crashes or hangs
is only that child (the caller kills it on its timeout). A child whose caller is gone (the
flow-run process killed) kills itself, so no stage goes on working for a lifecycle that a
later one will redo. The child takes the caller's
environment, working directory and ``PYTHONPATH``, so it imports the same builders the
caller's own subprocess would have.

Only the jobs in :data:`JOBS` run (the socket is in a directory only its user can open).
Prefect's flow-run processes are not forked from here: the server never imports Prefect
(a fork of a process that did would copy its threads' locks and its client state). A caller
with no server (``$CKPTFLOW_FORKSERVER`` unset, or nothing listening) gets ``None`` from
:func:`call` and runs the check in a fresh process. The server exits when the process that
started it is gone (``--parent``); children still running finish their check.
Code upgraded under a running server takes effect when its worker restarts, like the
worker's own.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from importlib import import_module
from typing import Any

ENV = "CKPTFLOW_FORKSERVER"
"""The socket's path; ``ckptflow worker`` sets it for its flow runs."""

PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "ckptflow.tasks.sanity",
    "ckptflow.trainer.reference.build",
    "great_expectations",
    "ckptflow.tasks.expectations",
    # what the lifecycle's stages import (tasks/stages.py runs them here too)
    "ckptflow.tasks.stages",
    "ckptflow.tasks.verify",
    "ckptflow.tasks.transfer",
    "ckptflow.tasks.prune",
    "ckptflow.tasks.storage",
    "ckptflow.trainer.format.dcpmeta",
    "boto3",
    "s3fs",
    "zstandard",
)

# Variables a check must not inherit: distributed settings of whatever started the caller
# (the sanity step is its own world of size 1), and fault injection meant for the job under test.
_DROP_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_FAULT_ENV = "CKPTFLOW_FAULT"


def _sanity(args: dict[str, Any]) -> Any:
    from ckptflow.tasks.sanity import main

    return {"rc": main(list(args["argv"]))}


def _expectations(args: dict[str, Any]) -> Any:
    from dataclasses import asdict

    from ckptflow.tasks.expectations import validate

    return asdict(validate(**args))


def _stage(args: dict[str, Any]) -> Any:
    from ckptflow.tasks.stages import run_stage_by_name

    return run_stage_by_name(args)


JOBS: dict[str, Callable[[dict[str, Any]], Any]] = {"sanity": _sanity, "expectations": _expectations, "stage": _stage}

# The sanity step is a checker: fault injection is for the job under test (as for its fresh
# process). A lifecycle stage is the job under test: its faults fire in the child, and kill
# the caller too (``faults.also_kill``), as they would have killed it running the stage itself.
_KEEPS_FAULTS = {"stage"}


class ForkServerError(RuntimeError):
    """A check the fork server ran raised, or its child died before answering."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


# --------------------------------------------------------------------------- client


def available() -> str | None:
    """The socket path this process should use, if one is configured."""
    path = os.environ.get(ENV, "")
    return path if path and os.path.exists(path) else None


def call(
    job: str, args: dict[str, Any], *, timeout_s: float, connect_timeout_s: float = 120.0, forward_output: bool = False
) -> Any:
    """Run ``job`` in a fresh child of this machine's fork server; ``None`` when there is none.

    Raises what the child raised when it is one of ckptflow's errors (same class, same
    message), else :class:`ForkServerError` with its traceback; :class:`ForkServerError` when
    it died before it answered (with the tail of its output), and :class:`TimeoutError` after
    ``timeout_s`` (the child is killed first). ``forward_output``: the child's output is
    copied to this process's stderr afterwards (a stage's log lines, as if it ran here).
    """
    started = _start_job(job, args, connect_timeout_s=connect_timeout_s)
    if started is None:
        return None
    s, f, pid, log = started
    with s:
        try:
            s.settimeout(timeout_s)
            try:
                line = f.readline()
            except TimeoutError:
                _kill(pid)
                raise TimeoutError(f"fork-server job {job} (pid {pid}) ran past {timeout_s:.0f} s; killed") from None
            if not line:
                raise ForkServerError(f"fork-server job {job} (pid {pid}) died before answering", _tail(log))
            res = json.loads(line)
            if "error" in res:
                _reraise(job, res, _tail(log))
            return res["value"]
        finally:
            if forward_output:
                _forward(log)
            _remove(log)


def _start_job(
    job: str, args: dict[str, Any], *, connect_timeout_s: float
) -> tuple[socket.socket, Any, int, str] | None:
    """Connect, send the request, read the child's hello: the socket, its reader, the child's
    pid and log; ``None`` when no server answered (nothing ran)."""
    if job not in JOBS:
        raise ValueError(f"unknown fork-server job {job!r}; known: {sorted(JOBS)}")
    s = _connect(connect_timeout_s)
    if s is None:
        return None
    head = _request(s, job, args)
    if head is None:
        s.close()
        return None
    return (s, *head)


def _connect(timeout_s: float) -> socket.socket | None:
    path = available()
    if path is None:
        return None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # The server binds before it imports (~10 s, more on a busy machine): a caller that connects
    # meanwhile waits in the backlog for its child instead of paying the imports itself. One
    # that gives up runs the job the old way; the child, if it comes later, sees it gone.
    s.settimeout(timeout_s)
    try:
        s.connect(path)
    except OSError:
        s.close()
        return None  # nothing listening (a stale path): the caller's old way
    return s


def _request(s: socket.socket, job: str, args: dict[str, Any]) -> tuple[Any, int, str] | None:
    """Send the request; the child's pid and log from its hello, or ``None`` when the server
    went away before forking (nothing ran)."""
    req = {"job": job, "args": args, "env": dict(os.environ), "cwd": os.getcwd(), "pid": os.getpid()}
    try:
        s.sendall(json.dumps(req).encode() + b"\n")
        f = s.makefile("rb")
        hello = f.readline()
    except OSError:
        return None
    if not hello:
        return None
    head = json.loads(hello)
    return f, int(head["pid"]), str(head["log"])


def _reraise(job: str, res: dict[str, Any], log_tail: str) -> None:
    err = ForkServerError(f"fork-server job {job} raised:\n{res['error']}", log_tail)
    cls = _ckptflow_error(str(res.get("exc_type", "")))
    if cls is not None:
        try:
            exc = cls(str(res.get("message", "")))
        except TypeError:  # a constructor that wants more than the message
            raise err from None
        raise exc from err
    raise err


def _ckptflow_error(spec: str) -> type | None:
    """ckptflow's own error class named ``module:qualname`` (the caller acts on the class)."""
    from ckptflow.trainer.errors import CkptflowError

    mod, _, name = spec.partition(":")
    if not mod.startswith("ckptflow."):
        return None
    try:
        cls = getattr(import_module(mod), name)
    except (ImportError, AttributeError):
        return None
    return cls if isinstance(cls, type) and issubclass(cls, CkptflowError) else None


def _forward(path: str) -> None:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return
    if data:
        sys.stderr.write(data.decode(errors="replace"))
        sys.stderr.flush()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# --------------------------------------------------------------------------- server


def new_socket_path() -> str:
    """A fresh socket path in a directory only this user can enter (AF_UNIX paths are short)."""
    return os.path.join(tempfile.mkdtemp(prefix="ckptflow-fork-"), "sock")


def start(env: dict[str, str] | None = None, preload: tuple[str, ...] = PRELOAD) -> tuple[Any, str]:
    """Start a fork server for this process (it exits when this process does); returns the
    ``Popen`` and the socket path — put it in ``$CKPTFLOW_FORKSERVER`` for the callers.
    ``preload``: the modules it imports (the lifecycle's by default)."""
    import subprocess

    path = new_socket_path()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ckptflow.tasks.forkserver",
            "--socket",
            path,
            "--parent",
            str(os.getpid()),
            "--preload",
            ",".join(preload),
        ],
        env={**(env if env is not None else os.environ), "OMP_NUM_THREADS": "1"},
        stdin=subprocess.DEVNULL,
    )
    # It binds before importing; wait for the bind only (callers then queue in its backlog).
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise ForkServerError(f"the fork server did not start (exit code {proc.poll()}); see its output above")
        time.sleep(0.05)
    return proc, path


def enable(env: dict[str, str] | Any, preload: tuple[str, ...] = PRELOAD) -> str | None:
    """Start a fork server and name it in ``env`` (a dict for a child, or ``os.environ``) for
    the processes this one starts; on failure say so and leave ``env`` alone (checks then run
    in fresh processes, as without one)."""
    try:
        _, path = start(dict(env), preload)
    except (ForkServerError, OSError) as e:
        print(f"ckptflow: no fork server ({e}); checks run in fresh processes", file=sys.stderr, flush=True)
        return None
    env[ENV] = path
    return path


def serve(path: str, *, parent: int | None = None, preload: tuple[str, ...] = PRELOAD) -> int:
    """Listen on ``path``; fork a child per request. Returns when ``parent`` is gone or on SIGTERM."""
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(64)
    try:
        t0 = time.perf_counter()
        for name in preload:
            import_module(name)
        import threading

        if "prefect" in sys.modules:  # its client and log/event workers must not be forked
            print(f"ckptflow forkserver: a preload imported Prefect ({preload}); not serving", file=sys.stderr)
            return 2
        # A fork copies only the forking thread: a lock another thread held stays locked in
        # every child. The preloads must start none (Prefect's, for one, start on first use).
        others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
        print(
            f"ckptflow forkserver: {path}, preloaded {len(preload)} modules in {time.perf_counter() - t0:.1f} s"
            + (f"; WARNING: threads running before fork: {others}" if others else ""),
            file=sys.stderr,
            flush=True,
        )
        sock.settimeout(1.0)
        while not stop:
            _reap()
            if parent is not None and os.getppid() != parent:
                break  # whoever started us is gone (we were re-parented)
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            pid = os.fork()
            if pid == 0:  # the child: never returns into the server loop
                code = 1
                try:
                    sock.close()
                    code = _child(conn)
                finally:
                    os._exit(code)
            conn.close()
    finally:
        sock.close()
        _remove(path)
        try:
            os.rmdir(os.path.dirname(path))
        except OSError:
            pass
    return 0


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _child(conn: socket.socket) -> int:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    conn.settimeout(None)
    f = conn.makefile("rwb")
    line = f.readline()
    # The check's output goes to its own file (the caller reads the tail if the child dies).
    fd, log = tempfile.mkstemp(prefix="ckptflow-forkjob-", suffix=".log")
    fds = [os.open(os.devnull, os.O_RDONLY), fd, fd]
    f.write(json.dumps({"pid": os.getpid(), "log": log}).encode() + b"\n")
    f.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    _die_with_caller(conn)
    try:
        req = json.loads(line)
        name = str(req.get("job"))
        job = JOBS.get(name)
        if job is None:
            raise ValueError(f"unknown job {req.get('job')!r}")
        _take_callers_world(req, keep_faults=name in _KEEPS_FAULTS)
        out: dict[str, Any] = {"value": job(dict(req.get("args") or {}))}
    except BaseException as e:  # noqa: BLE001 - whatever the check raised goes back to the caller
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        out = {"error": tb[-4000:], "exc_type": f"{type(e).__module__}:{type(e).__qualname__}", "message": str(e)}
    sys.stdout.flush()
    sys.stderr.flush()
    f.write(json.dumps(out).encode() + b"\n")
    f.flush()
    return 0


def _die_with_caller(conn: socket.socket) -> None:
    """The caller sends nothing after its request: end of stream means it is gone (killed, or
    gave up at its timeout), and a check or stage nobody waits for must not go on writing —
    a lifecycle started after the caller died would do the same work beside it."""
    import select
    import threading

    # First synchronously: a caller that gave up while we sat in the backlog (its wait for our
    # hello timed out, so it runs the job itself) must not find the job done twice.
    if select.select([conn], [], [], 0)[0] and not conn.recv(1, socket.MSG_PEEK):
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        try:
            while conn.recv(4096):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="ckptflow-forkjob-watchdog", daemon=True).start()


def _take_callers_world(req: dict[str, Any], *, keep_faults: bool) -> None:
    env = {str(k): str(v) for k, v in dict(req.get("env") or {}).items()}
    for k in _DROP_ENV:
        env.pop(k, None)
    if keep_faults and req.get("pid"):
        from ckptflow.trainer import faults

        faults.also_kill(int(req["pid"]))
    else:
        env.pop(_FAULT_ENV, None)
    env.setdefault("OMP_NUM_THREADS", "1")
    os.environ.clear()
    os.environ.update(env)
    if req.get("cwd"):
        os.chdir(str(req["cwd"]))
    for p in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if p not in sys.path:
            sys.path.insert(0, p)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckptflow.tasks.forkserver", description=__doc__.split("\n\n")[0])
    p.add_argument("--socket", required=True)
    p.add_argument("--parent", type=int, default=None, help="exit when this process is gone")
    p.add_argument("--preload", default=",".join(PRELOAD), help="the modules to import, comma-separated")
    a = p.parse_args(argv)
    return serve(a.socket, parent=a.parent, preload=tuple(m for m in a.preload.split(",") if m))


if __name__ == "__main__":
    sys.exit(main())
