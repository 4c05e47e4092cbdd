"""Real local servers and processes, for the tests, the demo, the chaos campaign and the benchmarks.

One place for what all of them need, so each starts, waits for and stops things the same
(proven) way:

* ports and readiness: :func:`free_port`, :func:`wait_port`, :func:`wait_http`;
* processes: every child in its own session (``setsid``), stopped by process group and PID —
  a worker started with ``&`` from a non-interactive shell ignored SIGTERM here, and
  torchrun's workers must go with their agent (:class:`Supervisor`, :func:`stop_group`);
* servers: :class:`MotoServer` (an S3-compatible server over HTTP),
  :class:`PostgresServer` (a throwaway PostgreSQL cluster) and :class:`PrefectServer`
  (``prefect server start`` with its own ``PREFECT_HOME``, on SQLite or on that PostgreSQL);
* the reference job: :func:`reference_job` (its command line, plain process or torchrun);
* many nodes: :class:`NodeAgents` (torchrun agents as nodes), on loopback or on a real network
  of namespaces (:class:`NetNodes`: a bridge, a veth link per node, faults on the links).

Never imported by the library (trainer, tasks, flows); only standard library at import.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping
from typing import IO

from ckptflow.trainer.errors import CkptflowError

PY = sys.executable
LOCAL_AWS = {
    "AWS_ACCESS_KEY_ID": "ckptflow-local",
    "AWS_SECRET_ACCESS_KEY": "ckptflow-local-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}
"""Credentials for a local moto server (it accepts any); never real ones."""
_CHILD_DROP = ("CKPTFLOW_FAULT", "PREFECT_API_URL", "PREFECT_API_KEY", "CKPTFLOW_CONFIG")


class HarnessError(CkptflowError, RuntimeError):
    """A harness could not do its job (a server did not start); the message names its log."""


# ---- ports and readiness ------------------------------------------------------------------


_PORTS_FROM = 10000
"""Lowest port :func:`free_port` hands out; below it lie well-known services' ports."""


def _ephemeral_start() -> int:
    """Where the kernel's ephemeral range starts (the ports it gives outgoing connections)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, chosen below the ephemeral range.

    A port from ``bind(0)`` comes from the range the kernel also gives every outgoing
    connection: in the seconds between picking it and a child (a torchrun agent importing
    torch) binding it, any client socket on the machine can take it. A CI run lost a
    two-node test that way: no rendezvous, no training, nothing in 120 s. Ports below the
    ephemeral range are never taken by a client, only by a listener that asks for them.
    """
    top = _ephemeral_start()
    if top - _PORTS_FROM >= 1000:
        pick = random.SystemRandom()
        for _ in range(100):
            port = pick.randrange(_PORTS_FROM, top)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:  # no room below the ephemeral range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 30.0, *, proc: subprocess.Popen | None = None, what: str = "server") -> None:
    """Until something accepts TCP connections on 127.0.0.1:``port``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _check_alive(proc, what)
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise HarnessError(f"{what}: nothing listens on 127.0.0.1:{port} after {timeout:.0f} s")


def wait_http(url: str, timeout: float = 60.0, *, proc: subprocess.Popen | None = None, what: str = "server") -> None:
    """Until ``url`` answers with a status below 500 (or ``proc`` exits: then at once)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _check_alive(proc, what)
        try:
            with urllib.request.urlopen(url, timeout=1) as r:  # noqa: S310 - a local URL of ours
                if r.status < 500:
                    return
        except Exception:  # refused, reset, 5xx while starting: try again
            time.sleep(0.2)
    raise HarnessError(f"{what} did not answer at {url} within {timeout:.0f} s")


def _check_alive(proc: subprocess.Popen | None, what: str) -> None:
    if proc is not None and proc.poll() is not None:
        raise HarnessError(f"{what} exited with code {proc.returncode} while starting")


# ---- processes ----------------------------------------------------------------------------


def child_env(extra: Mapping[str, str] | None = None, *, keep: tuple[str, ...] = ()) -> dict[str, str]:
    """Environment for a child we start: one intra-op thread, and none of our own settings
    (a fault, a Prefect API, a config file) leaking in unless ``keep`` names them."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    # MKL may run on fewer threads than it was given when the machine is busy (MKL_DYNAMIC), and a
    # matmul split another way rounds another way: the children's losses are compared bit for bit.
    env.setdefault("MKL_DYNAMIC", "FALSE")
    for k in _CHILD_DROP:
        if k not in keep:
            env.pop(k, None)
    env.update(extra or {})
    return env


def stop_group(proc: subprocess.Popen | None, timeout: float = 10.0) -> None:
    """SIGTERM the child's whole session and every process below it, and wait until all of them
    are gone; SIGKILL what is left after ``timeout``.

    Not only the leader is waited for: a worker's fork server (same session) or a flow run Prefect
    started in a session of its own (not reached by the group's signal) still ran after the worker
    exited, so "every process it started is stopped" held only a moment later."""
    if proc is None:
        return
    below = descendants(proc.pid) if proc.poll() is None else []
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    for pid in below:  # those in sessions of their own
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
    while time.monotonic() < deadline and (_group_alive(proc.pid) or any(_alive(p) for p in below)):
        time.sleep(0.05)
    for pid in below:
        if _alive(pid):
            _signal(pid, signal.SIGKILL)
    if proc.poll() is None or _group_alive(proc.pid):
        kill_group(proc)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie does not: it only waits for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _group_alive(pgid: int) -> bool:
    """Some process of group ``pgid`` runs (zombies aside)."""
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                return True
    return False


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's whole session: what a lost node looks like."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:  # not reaped yet: the kernel has it; nothing more to do here
        pass


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first found, then theirs)."""
    out, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        out += kids
        todo += kids
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a child, its session and every process below it — torchrun starts each worker
    in a session of its own, so killing the agent's group alone leaves the workers running."""
    below = descendants(proc.pid)
    for pid in [proc.pid, *below]:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    proc.wait(30)


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append(int(d))
        except (OSError, IndexError, ValueError):
            continue
    return sorted(out)


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class Supervisor:
    """Starts children in their own sessions and stops every one of them on exit (Ctrl-C too)."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(
        self,
        name: str,
        args: list[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        log: IO | None = None,
    ) -> subprocess.Popen:
        p = subprocess.Popen(
            args,
            env=None if env is None else dict(env),
            cwd=cwd,
            stdout=log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
            start_new_session=True,
        )
        self.procs.append((name, p))
        return p

    def stop(self, p: subprocess.Popen, timeout: float = 10.0) -> None:
        stop_group(p, timeout)

    def stop_all(self) -> None:
        for _, p in reversed(self.procs):
            self.stop(p)
        self.procs.clear()

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


# ---- servers ------------------------------------------------------------------------------


class MotoServer:
    """moto's S3-compatible server in its own process on 127.0.0.1, spoken to over HTTP."""

    def __init__(
        self, log_path: str | None = None, env: Mapping[str, str] | None = None, start_timeout: float = 60.0
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        log = open(log_path, "ab") if log_path else None
        self._proc: subprocess.Popen | None = subprocess.Popen(
            [PY, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
            env=child_env(env),
            start_new_session=True,
        )
        if log is not None:
            log.close()
        try:
            wait_http(f"{self.url}/moto-api/", timeout=start_timeout, proc=self._proc, what="moto")
        except HarnessError:
            self.stop()
            raise HarnessError(f"the local S3 server (moto) did not start; see {log_path or 'its output'}") from None

    def make_bucket(self, bucket: str) -> str:
        import boto3

        boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=LOCAL_AWS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=LOCAL_AWS["AWS_SECRET_ACCESS_KEY"],
            region_name=LOCAL_AWS["AWS_DEFAULT_REGION"],
        ).create_bucket(Bucket=bucket)
        return bucket

    def stop(self) -> None:
        stop_group(self._proc)
        self._proc = None

    def __enter__(self) -> MotoServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


PG_BIN_ENV = "CKPTFLOW_PG_BIN"


def pg_bindir() -> str:
    """PostgreSQL's binaries: ``$CKPTFLOW_PG_BIN``, else the newest ``/usr/lib/postgresql/*/bin``,
    else wherever ``initdb`` is on PATH."""
    import glob
    import shutil

    if os.environ.get(PG_BIN_ENV):
        return os.environ[PG_BIN_ENV]
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return os.path.dirname(found[-1])
    on_path = shutil.which("initdb")
    if on_path:
        return os.path.dirname(on_path)
    raise HarnessError(
        f"no PostgreSQL binaries (initdb): install PostgreSQL (e.g. apt install postgresql-15) or set {PG_BIN_ENV}"
    )


class PostgresServer:
    """A throwaway PostgreSQL cluster on 127.0.0.1 with one database, for a Prefect server.

    PostgreSQL refuses to run as root, so as root the cluster belongs to the ``postgres``
    user (its data folder is created under the system temp dir, which that user can reach —
    a pytest ``tmp_path`` under a root-only folder it cannot) and every server binary runs
    through ``runuser -u postgres``. As any other user it runs as that user. Trust auth on
    127.0.0.1 only: it is a test and benchmark database, never a production set-up
    (README, "Deploy for real", shows one).
    """

    def __init__(self, log_path: str | None = None, *, database: str = "prefect", start_timeout: float = 60.0) -> None:
        import pwd
        import tempfile

        self.bindir = pg_bindir()
        self.port = free_port()
        self.database = database
        self.root = os.geteuid() == 0
        self.datadir = tempfile.mkdtemp(prefix="ckptflow-pg-")
        self.log_path = log_path or os.path.join(self.datadir + ".log")
        self._as: list[str] = []
        if self.root:
            try:
                pw = pwd.getpwnam("postgres")
            except KeyError:
                raise HarnessError(
                    "PostgreSQL refuses to run as root and there is no 'postgres' user to run it as: "
                    "create one (useradd --system --create-home postgres) or run as another user"
                ) from None
            os.chown(self.datadir, pw.pw_uid, pw.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]
        self.url = f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{database}"
        self._started = False
        try:
            self._run("initdb", "-D", self.datadir, "-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8")
            self._run(
                "pg_ctl",
                "-D",
                self.datadir,
                "-l",
                self._server_log(),
                "-w",
                "-t",
                str(int(start_timeout)),
                "-o",
                f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.datadir} -c max_connections=200",
                "start",
            )
            self._started = True
            self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", database)
        except BaseException:
            self.stop()
            raise

    def _server_log(self) -> str:
        # The server writes its log as its own user: inside its data folder's parent is not
        # ours to hand out, so it goes next to the data, then is readable by us (root) anyway.
        return os.path.join(self.datadir, "server.log")

    def _run(self, tool: str, *args: str) -> None:
        cmd = [*self._as, os.path.join(self.bindir, tool), *args]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(f"$ {' '.join(cmd)}\n{r.stdout}{r.stderr}")
        if r.returncode != 0:
            raise HarnessError(
                f"PostgreSQL: {tool} failed ({r.returncode}): {(r.stderr or r.stdout).strip()[-800:]}; "
                f"see {self.log_path} and {self._server_log()}"
            )

    def query(self, sql: str) -> list[list[str]]:
        """Rows of ``sql`` on the database (psql, unaligned), for checks."""
        cmd = [*self._as, os.path.join(self.bindir, "psql"), "-h", "127.0.0.1", "-p", str(self.port)]
        cmd += ["-U", "postgres", "-d", self.database, "-At", "-F", "\t", "-c", sql]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise HarnessError(f"psql: {r.stderr.strip()[-500:]}")
        return [line.split("\t") for line in r.stdout.splitlines()]

    def stop(self) -> None:
        import shutil

        if self._started:
            try:
                self._run("pg_ctl", "-D", self.datadir, "-m", "fast", "-w", "stop")
            except HarnessError:
                pass
            self._started = False
        shutil.rmtree(self.datadir, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class PrefectServer:
    """A throwaway Prefect API with its own ``PREFECT_HOME``; ``url`` is what
    ``PREFECT_API_URL`` should be. Its database is SQLite in that home, or ``database_url``
    (a :class:`PostgresServer`'s ``url``). ``restart()`` kills it and starts it again on the
    same port and database, like a server redeploy."""

    def __init__(
        self,
        home: str,
        log_path: str,
        env: Mapping[str, str] | None = None,
        *,
        start_timeout: float = 180.0,
        start: bool = True,
        database_url: str | None = None,
    ) -> None:
        os.makedirs(home, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.database_url = database_url
        self.env = dict(
            child_env(env),
            PREFECT_HOME=home,
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            PREFECT_UI_ENABLED="false",
            PREFECT_API_URL=self.url,
            # Concurrency-slot leases in PREFECT_HOME, not in memory: with the default in-memory
            # store a server restart forgets every lease while the limits keep their slots
            # counted as taken, and every lifecycle waiting on that machine's limit waits forever
            # (found by benchmarks/bench_fleet.py's outage round).
            PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE="prefect.server.concurrency.lease_storage.filesystem",
        )
        if database_url:
            self.env["PREFECT_API_DATABASE_CONNECTION_URL"] = database_url
        self.db_path = None if database_url else os.path.join(home, "prefect.db")  # Prefect's default
        self.log_path = log_path
        self.start_timeout = start_timeout
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._from_template = False
        if start:
            self.start()

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the process without waiting (seconds, tens of them on a busy machine: start other things meanwhile)."""
        self._from_template = False
        if self.db_path and not os.path.exists(self.db_path) and _usable(_db_template()):
            shutil.copyfile(_db_template(), self.db_path)
            self._from_template = True
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [PY, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )

    def wait_ready(self) -> None:
        try:
            wait_http(self.url + "/health", timeout=self.start_timeout, proc=self._proc, what="prefect server")
        except HarnessError:
            self.stop()
            if self._from_template:  # never start from that copy again
                _remove(_db_template())
            raise HarnessError(f"prefect server did not start on port {self.port}; see {self.log_path}") from None
        if self.db_path and not self._from_template and not os.path.exists(_db_template()):
            _save_template(self.db_path)

    def kill(self) -> None:
        """Down hard (SIGKILL): what a crashed or preempted server pod looks like."""
        if self._proc is not None and self._proc.poll() is None:
            kill_group(self._proc)

    def restart(self) -> float:
        """Kill and start again on the same port and database; returns seconds it was down."""
        t0 = time.monotonic()
        self.kill()
        self.start()
        self.restarts += 1
        return time.monotonic() - t0

    def stop(self) -> None:
        stop_group(self._proc)

    def __enter__(self) -> PrefectServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _db_template() -> str:
    """Where an empty, migrated Prefect database of the installed Prefect version is kept.

    A fresh SQLite database makes ``prefect server start`` run every migration: 12 CPU-s to
    ready instead of 7 when it starts from a copy of one already migrated (this VM, Prefect
    3.9). The suite starts about ten servers, the demos and the chaos campaign one each. The
    copy is the database a server of this version had just after it came up, before any
    client spoke to it, so a server started from it is the same as one started from nothing;
    keyed by version, an upgrade makes a new one (and Prefect would migrate an old one anyway).
    """
    from importlib.metadata import version

    return os.path.join(tempfile.gettempdir(), f"ckptflow-prefect-{version('prefect')}-empty.db")


def _usable(template: str) -> bool:
    """Whether ``template`` is a migrated Prefect database (SQLite, one Alembic version); one that
    is there but is not (a damaged disk, a stray file) is removed, and the server migrates anew."""
    import sqlite3

    if not os.path.exists(template):
        return False
    try:
        con = sqlite3.connect(f"file:{template}?immutable=1", uri=True)  # no lock files beside it
        try:
            (n,) = con.execute("SELECT count(*) FROM alembic_version").fetchone()
        finally:
            con.close()
        if n == 1:
            return True
    except sqlite3.Error:
        pass
    _remove(template)
    return False


def _save_template(db_path: str) -> None:
    """A consistent copy of the live database (SQLite's online backup), put in place atomically:
    several servers starting at once each write their own and the last rename wins."""
    import sqlite3

    dest = _db_template()
    tmp = f"{dest}.{os.getpid()}.tmp"
    try:
        src, dst = sqlite3.connect(db_path, timeout=30), sqlite3.connect(tmp)
        try:
            src.backup(dst)
        finally:
            src.close()
            dst.close()
        os.replace(tmp, dest)
    except (OSError, sqlite3.Error):  # only a cache: the next server migrates from nothing
        _remove(tmp)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def wait_deployments(names: list[str], timeout: float) -> None:
    """Until the Prefect API (``PREFECT_API_URL``) knows every deployment in ``names``
    (``flow/deployment``): a server just started registers them within seconds."""
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with get_client(sync_client=True) as c:
                for n in names:
                    c.read_deployment_by_name(n)
            return
        except Exception:  # not there yet, or the API is still starting
            time.sleep(1)
    raise HarnessError(f"deployments {names} were not registered within {timeout:.0f} s (see the serve log)")


# ---- the reference job --------------------------------------------------------------------

REFERENCE_JOB = "ckptflow.trainer.train"


def reference_job(
    root: str,
    run_id: str,
    *,
    max_steps: int,
    save_every: int,
    nproc: int = 1,
    model: str = "tiny",
    max_restarts: int = 0,
    extra: list[str] | None = None,
    module: str = REFERENCE_JOB,
) -> list[str]:
    """The reference job's command: a plain process at ``nproc=1`` (no torchrun, ~5 s on the
    tiny model), a standalone torchrun job of ``nproc`` ranks above."""
    args = [
        "--ckpt-root",
        str(root),
        "--run-id",
        run_id,
        "--max-steps",
        str(max_steps),
        "--save-every",
        str(save_every),
        "--model",
        model,
        *(extra or []),
    ]
    if nproc == 1 and max_restarts == 0:
        if "--parallel" not in args:
            args = ["--parallel", "none", *args]
        return [PY, "-m", module, *args]
    return torchrun(module, args, nproc=nproc, max_restarts=max_restarts)


def torchrun(
    module: str,
    args: list[str],
    *,
    nproc: int,
    max_restarts: int = 0,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_port: int | None = None,
    rdzv_host: str = "127.0.0.1",
    local_addr: str | None = None,
) -> list[str]:
    """``torchrun`` of ``module``: standalone on one node, or one agent of ``nnodes`` nodes
    meeting at a c10d rendezvous on ``rdzv_host:rdzv_port``. With ``local_addr`` (a node in a
    namespace of its own) the agent says which address is its own, and node 0 hosts the
    rendezvous store (torch finds the host by matching the machine's host name, which a
    namespace does not change)."""
    if nnodes == 1:
        where = ["--standalone"]
    else:
        if rdzv_port is None:
            raise ValueError("a multi-node torchrun needs rdzv_port")
        where = [
            f"--nnodes={nnodes}",
            f"--node-rank={node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rdzv_host}:{rdzv_port}",
            "--rdzv-id=ckptflow",
        ]
        if local_addr is not None:
            where += [f"--local-addr={local_addr}", f"--rdzv-conf=is_host={int(node_rank == 0)}"]
    return [
        PY,
        "-m",
        "torch.distributed.run",
        *where,
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.5",
        "-m",
        module,
        *args,
    ]


class NodeAgents:
    """``n`` torchrun agents on this machine acting as ``n`` nodes: one c10d rendezvous on
    127.0.0.1 (or, with ``net``, each agent in its node's namespace, the rendezvous on node 0's
    address and gloo on the node's link), and each node its own hot folder (its "local disk").
    Every agent runs in its own session, so :meth:`kill` takes a node's agent and workers down
    together, as a lost node does; :meth:`start` brings a node (back) up — with an emptied
    folder, a replaced one.

    Ranks are assigned at rendezvous: rank order is not node order.
    """

    def __init__(
        self,
        roots: list[str],
        module_args: list[str],
        *,
        nproc: int = 1,
        max_restarts: int = 0,
        module: str = REFERENCE_JOB,
        env: Mapping[str, str] | None = None,
        log_dir: str,
        port: int | None = None,
        net: NetNodes | None = None,
    ) -> None:
        if net is not None and net.n != len(roots):
            raise ValueError(f"{len(roots)} roots for a network of {net.n} nodes")
        self.net = net
        self.roots = [str(r) for r in roots]
        self.args, self.module, self.nproc, self.max_restarts = list(module_args), module, nproc, max_restarts
        self.env = child_env(env)
        self.log_dir = log_dir
        self.port = port or free_port()
        self.procs: list[subprocess.Popen | None] = [None] * len(self.roots)
        self.starts = [0] * len(self.roots)
        os.makedirs(log_dir, exist_ok=True)

    @property
    def n(self) -> int:
        return len(self.roots)

    def command(self, node: int) -> list[str]:
        net = self.net
        cmd = torchrun(
            self.module,
            ["--ckpt-root", self.roots[node], *self.args],
            nproc=self.nproc,
            max_restarts=self.max_restarts,
            nnodes=self.n,
            node_rank=node,
            rdzv_port=self.port,
            rdzv_host=net.addr(0) if net else "127.0.0.1",
            local_addr=net.addr(node) if net else None,
        )
        return [*net.exec_prefix(node), *cmd] if net else cmd

    def log_path(self, node: int) -> str:
        return os.path.join(self.log_dir, f"node{node}.{self.starts[node]}.log")

    def start(self, node: int | None = None, *, env: Mapping[str, str] | None = None) -> None:
        for i in range(self.n) if node is None else [node]:
            self.starts[i] += 1
            # gloo picks its interface by host name unless told: the node's link, in a namespace
            link = {"GLOO_SOCKET_IFNAME": NetNodes.LINK} if self.net else {}
            with open(self.log_path(i), "wb") as log:
                self.procs[i] = subprocess.Popen(
                    self.command(i),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=dict(self.env, **link, **(env or {})),
                    start_new_session=True,
                )

    def wait(self, timeout: float) -> list[int | None]:
        """Exit codes of every node (None: still running after ``timeout``, then killed)."""
        deadline = time.monotonic() + timeout
        out: list[int | None] = []
        for p in self.procs:
            if p is None:
                out.append(None)
                continue
            try:
                out.append(p.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                kill_tree(p)
                out.append(None)
        return out

    def kill(self, node: int) -> None:
        """SIGKILL the node's agent and every worker: a lost node."""
        p = self.procs[node]
        if p is not None and p.poll() is None:
            kill_tree(p)

    def output(self, node: int) -> str:
        with open(self.log_path(node), errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        for p in self.procs:
            if p is not None and p.poll() is None:
                kill_tree(p)

    def __enter__(self) -> NodeAgents:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class NetNodes:
    """``n`` nodes in network namespaces of their own, joined by a bridge: a real network on one
    machine (root only). Node ``i`` is namespace ``<name>-n<i>`` with ``eth0`` at ``10.77.0.<i+1>``,
    one end of a veth pair whose other end, ``n<i>``, is a port of the bridge ``br0`` in the
    namespace ``<name>-br``.

    Faults act on the node's bridge port, as a switch's would: :meth:`link_down` /
    :meth:`link_up` (the node's own interface stays up; its packets go nowhere), and
    :meth:`throttle` (``tc``'s token bucket, ``tbf``, both ways). This kernel has no ``netem``:
    a node in ``relay`` reaches its bridge port through a namespace ``<name>-r<i>`` where a
    userspace relay (``ckptflow.netrelay``) forwards every frame, and :meth:`impair` sets its
    delay and loss.

    Every name carries this process's id, and a new harness first removes the namespaces of
    harnesses whose process is gone (:func:`remove_stale_namespaces`: SIGKILLed, no clean-up
    ran). :meth:`close` (also on ``with`` exit, Ctrl-C included, and at interpreter exit)
    deletes every namespace this object made, and their links with them.
    """

    SUBNET = "10.77.0"
    LINK = "eth0"

    def __init__(self, n: int, *, name: str | None = None, relay: tuple[int, ...] = ()) -> None:
        if os.geteuid() != 0:
            raise HarnessError("network namespaces need root (ip netns add); run the harness as root")
        self.n = n
        self.name = name or f"ckf{os.getpid()}x{random.randrange(1 << 16):04x}"
        self.bridge_ns = f"{self.name}-br"
        self.made: list[str] = []
        self.relays: dict[int, subprocess.Popen] = {}
        self._ctl = tempfile.mkdtemp(prefix=f"{self.name}-relay-")
        remove_stale_namespaces()  # a harness SIGKILLed earlier ran no clean-up
        atexit.register(self.close)
        try:
            self._add(self.bridge_ns)
            self._in(self.bridge_ns, "ip", "link", "add", "br0", "type", "bridge")
            self._in(self.bridge_ns, "ip", "link", "set", "br0", "up")
            for i in range(n):
                ns = self.ns(i)
                self._add(ns)
                if i in relay:  # node -- relay namespace -- bridge port
                    r = f"{self.name}-r{i}"
                    self._add(r)
                    _veth(self.LINK, ns, "ra", r)
                    _veth("rb", r, f"n{i}", self.bridge_ns)
                    for dev in ("ra", "rb"):
                        self._in(r, "ip", "link", "set", dev, "promisc", "on", "up")
                    self._start_relay(i, r)
                else:
                    _veth(self.LINK, ns, f"n{i}", self.bridge_ns)
                self._in(ns, "ip", "addr", "add", f"{self.addr(i)}/24", "dev", self.LINK)
                self._in(ns, "ip", "link", "set", self.LINK, "up")
                self._in(self.bridge_ns, "ip", "link", "set", f"n{i}", "master", "br0")
                self._in(self.bridge_ns, "ip", "link", "set", f"n{i}", "up")
        except BaseException:
            self.close()
            raise

    def ns(self, i: int) -> str:
        return f"{self.name}-n{i}"

    def addr(self, i: int) -> str:
        return f"{self.SUBNET}.{i + 1}"

    def exec_prefix(self, i: int) -> list[str]:
        """Put in front of a command to run it in node ``i``'s namespace."""
        return ["ip", "netns", "exec", self.ns(i)]

    def link_down(self, i: int) -> None:
        self._in(self.bridge_ns, "ip", "link", "set", f"n{i}", "down")

    def link_up(self, i: int) -> None:
        self._in(self.bridge_ns, "ip", "link", "set", f"n{i}", "up")

    def throttle(self, i: int, rate: str = "50mbit") -> None:
        """Node ``i``'s link at ``rate``, both ways (``tc qdisc replace ... tbf``)."""
        for ns, dev in ((self.ns(i), self.LINK), (self.bridge_ns, f"n{i}")):
            self._in(
                ns,
                "tc",
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "64kb",
                "latency",
                "400ms",
            )

    def unthrottle(self, i: int) -> None:
        for ns, dev in ((self.ns(i), self.LINK), (self.bridge_ns, f"n{i}")):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)

    def _start_relay(self, i: int, ns: str) -> None:
        self.impair(i)
        p = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "ckptflow.netrelay", "ra", "rb", self._ctl_path(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.relays[i] = p
        line = p.stdout.readline() if p.stdout is not None else ""
        if "relay up" not in line:
            raise HarnessError(f"the relay of node {i} did not start: {line}")

    def _ctl_path(self, i: int) -> str:
        return os.path.join(self._ctl, f"node{i}.json")

    def impair(self, i: int, *, delay_ms: float = 0.0, loss: float = 0.0) -> None:
        """Node ``i``'s relay (``relay=`` at construction): every frame held ``delay_ms`` each way and dropped
        with probability ``loss``, from within 50 ms on; no arguments: a clean link again."""
        tmp = self._ctl_path(i) + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"delay_ms": delay_ms, "loss": loss}, f)
        os.replace(tmp, self._ctl_path(i))

    def _add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self.made.append(ns)
        self._in(ns, "ip", "link", "set", "lo", "up")

    def _in(self, ns: str, *cmd: str) -> None:
        _ip("netns", "exec", ns, *cmd)

    def close(self) -> None:
        """Stop the relays, delete every namespace this object made (their veth links go with them)."""
        for p in self.relays.values():
            p.kill()
            p.wait(30)
        self.relays.clear()
        shutil.rmtree(self._ctl, ignore_errors=True)
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.made.clear()

    def __enter__(self) -> NetNodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _veth(a: str, ns_a: str, b: str, ns_b: str) -> None:
    """A veth pair: ``a`` in namespace ``ns_a``, its peer ``b`` in ``ns_b``."""
    _ip("link", "add", a, "netns", ns_a, "type", "veth", "peer", "name", b, "netns", ns_b)


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise HarnessError(f"ip {' '.join(args)}: {r.stderr.strip()}")


def namespaces(prefix: str = "ckf") -> list[str]:
    """This harness's network namespaces on the machine (any process's)."""
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    names = [ln.split()[0] for ln in r.stdout.splitlines() if ln.strip()]
    return [n for n in names if re.fullmatch(rf"{prefix}\d+x[0-9a-f]{{4}}-(br|[nr]\d+)", n)]


def remove_stale_namespaces(prefix: str = "ckf") -> list[str]:
    """Delete the namespaces of harnesses whose process is gone (SIGKILLed: no clean-up ran)."""
    gone = []
    for name in namespaces(prefix):
        pid = int(re.match(rf"{prefix}(\d+)", name).group(1))  # type: ignore[union-attr]
        if not _alive(pid):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
            gone.append(name)
    return gone
