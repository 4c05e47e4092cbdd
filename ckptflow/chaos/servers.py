"""The local servers a campaign starts for itself: never the user's.

* :class:`MotoServer` — an S3-compatible server (moto) in its own process on 127.0.0.1;
  every trial's cold tier is a prefix of one bucket on it.
* :class:`PrefectServer` — ``prefect server start`` with its own ``PREFECT_HOME`` (SQLite),
  started once per campaign and only for the ``prefect`` kind; ``restart()`` kills it
  and brings it back on the same port and database, like a server redeploy.
* :class:`BlackHole` — accepts TCP connections and never answers: a hung API.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from ckptflow.trainer.errors import CkptflowError


class HarnessError(CkptflowError, RuntimeError):
    """The chaos harness itself could not do its job (a server did not start)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise HarnessError(f"{url} did not answer within {timeout:.0f} s")


def _stop(proc: subprocess.Popen | None, timeout: float = 10.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # the server's own children too
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout)


class MotoServer:
    def __init__(self, log_path: str, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "ab")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_http(f"{self.url}/moto-api/", timeout=60)
        except HarnessError:
            self.stop()
            raise HarnessError(f"the local S3 server (moto) did not start; see {log_path}") from None

    def stop(self) -> None:
        _stop(self._proc)
        self._log.close()


class PrefectServer:
    """A throwaway Prefect API; ``url`` is what ``PREFECT_API_URL`` should be."""

    def __init__(self, home: str, log_path: str, env: dict[str, str], *, start_timeout: float = 180) -> None:
        os.makedirs(home, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.env = dict(env, PREFECT_HOME=home, PREFECT_SERVER_ANALYTICS_ENABLED="false",
                        PREFECT_UI_ENABLED="false", PREFECT_API_URL=self.url)
        self.log_path = log_path
        self.start_timeout = start_timeout
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
             str(self.port)], stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        log.close()
        try:
            wait_http(self.url + "/health", timeout=self.start_timeout)
        except HarnessError:
            self.stop()
            raise HarnessError(f"prefect server did not start on port {self.port}; see {self.log_path}") from None

    def kill(self) -> None:
        """Down hard (SIGKILL): what a crashed or preempted server pod looks like."""
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._proc.wait(10)

    def restart(self) -> float:
        """Kill and start again on the same port and database; returns seconds it was down."""
        t0 = time.monotonic()
        self.kill()
        self.start()
        self.restarts += 1
        return time.monotonic() - t0

    def stop(self) -> None:
        _stop(self._proc)


class BlackHole:
    """A TCP port that accepts and then says nothing, ever (until stopped)."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._conns: list[socket.socket] = []
        self._stopped = threading.Event()
        threading.Thread(target=self._accept, name="ckptflow-chaos-blackhole", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}/api"

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                c, _ = self._sock.accept()
            except OSError:
                return
            self._conns.append(c)  # held open, never read: the client waits for its timeout

    def stop(self) -> None:
        self._stopped.set()
        for c in self._conns:
            c.close()
        self._sock.close()
