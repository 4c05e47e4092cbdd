"""The local servers a campaign starts for itself: never the user's.

:class:`~ckptflow.harness.MotoServer` (every trial's cold tier is a prefix of one bucket on
it) and :class:`~ckptflow.harness.PrefectServer` (started once per campaign and only for
the ``prefect`` kind; ``restart()`` brings it back on the same port and database, like a
server redeploy) come from the shared harness. What only chaos needs is here:

* :class:`BlackHole` — accepts TCP connections and never answers: a hung API.
"""

from __future__ import annotations

import socket
import threading

from ckptflow.harness import HarnessError, MotoServer, PrefectServer, free_port

__all__ = ["BlackHole", "HarnessError", "MotoServer", "PrefectServer", "free_port"]


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
