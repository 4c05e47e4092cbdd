"""A fault-injecting HTTP proxy on 127.0.0.1, put between ckptflow and a local server.

The cold tier's ``endpoint_url`` (or a flow's ``PREFECT_API_URL``) points at the proxy;
the proxy forwards every request to the real upstream (the campaign's moto S3 server,
or its Prefect API) and, for a set share of requests, misbehaves instead:

=============  ================================================================
``500``        answers ``500 InternalError`` (S3 error XML), nothing forwarded
``503``        answers ``503 SlowDown`` — S3's "reduce your request rate"
``reset``      drops the connection with a TCP RST before forwarding anything
``reset_after`` forwards the request (it takes effect upstream), then RSTs instead
               of answering: the client must retry something that already worked
``stall``      holds the request for a while, then forwards it (a slow network)
=============  ================================================================

Why a real proxy and not a mocked client: the retries under test live in botocore,
s3transfer, s3fs/aiobotocore and Prefect's httpx client; only bytes on a socket reach
all of them the way a flaky network does. Decisions come from a seeded RNG, so a
campaign replays the same faults for the same seed (thread timing aside).

The proxy also counts what it saw: requests and faults per mode, and *completed*
uploads per key (a PutObject or CompleteMultipartUpload whose 2xx answer reached the
client). A key uploaded to completion twice is duplicated work. WebSocket upgrades
(Prefect's event stream) are tunnelled byte for byte after the fault decision.
"""

from __future__ import annotations

import http.client
import random
import re
import select
import socket
import struct
import threading
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODES = ("500", "503", "reset", "reset_after", "stall")
_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "te", "trailers", "upgrade", "expect"}
_S3_ERROR = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{msg}'
    "</Message><RequestId>ckptflow-chaos</RequestId></Error>"
)


@dataclass
class ProxyStats:
    requests: int = 0
    faults: Counter = field(default_factory=Counter)
    """Faulted requests per mode."""
    methods: Counter = field(default_factory=Counter)
    completed_uploads: Counter = field(default_factory=Counter)
    """Object key -> uploads whose success answer reached the client."""

    def duplicate_uploads(self) -> dict[str, int]:
        return {k: n for k, n in self.completed_uploads.items() if n > 1}

    def to_dict(self) -> dict:
        return {
            "requests": self.requests,
            "faults": dict(self.faults),
            "methods": dict(self.methods),
            "duplicate_uploads": self.duplicate_uploads(),
        }


class FaultProxy:
    """``with FaultProxy("http://127.0.0.1:5000", share=0.2, seed=1) as p: ... p.url ...``"""

    def __init__(
        self,
        upstream: str,
        *,
        share: float = 0.0,
        modes: tuple[str, ...] = MODES,
        seed: int = 0,
        stall_s: tuple[float, float] = (0.2, 1.5),
        upstream_timeout_s: float = 120.0,
        paths: str | None = None,
    ) -> None:
        u = urllib.parse.urlsplit(upstream)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"FaultProxy upstream must be http://host:port, not {upstream!r}")
        self.upstream_host, self.upstream_port = u.hostname, u.port or 80
        self.upstream_timeout_s = upstream_timeout_s
        self.stats = ProxyStats()
        self.paths = re.compile(paths) if paths else None
        """Only requests whose path matches may be faulted (e.g. data objects only)."""
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self.set_faults(share=share, modes=modes, stall_s=stall_s)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- control ----------------------------------------------------------------

    def set_faults(
        self,
        *,
        share: float | None = None,
        modes: tuple[str, ...] | None = None,
        stall_s: tuple[float, float] | None = None,
    ) -> None:
        """Change what misbehaves, while running (e.g. share=0 for a clean re-run)."""
        with self._lock:
            if share is not None:
                if not 0.0 <= share <= 1.0:
                    raise ValueError(f"fault share {share!r} must be in [0, 1]")
                self.share = share
            if modes is not None:
                bad = [m for m in modes if m not in MODES]
                if bad or not modes:
                    raise ValueError(f"unknown fault modes {bad}; choose from {MODES}")
                self.modes = tuple(modes)
            if stall_s is not None:
                self.stall_s = stall_s

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="ckptflow-chaos-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._server is not None, "start() the proxy first"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # ---- per request ---------------------------------------------------------------

    def _decide(self, method: str, path: str) -> tuple[str | None, float]:
        with self._lock:
            self.stats.requests += 1
            self.stats.methods[method] += 1
            if self.paths is not None and not self.paths.search(path):
                return None, 0.0
            if self.share <= 0 or self._rng.random() >= self.share:
                return None, 0.0
            mode = self._rng.choice(self.modes)
            self.stats.faults[mode] += 1
            return mode, self._rng.uniform(*self.stall_s)

    def _completed(self, key: str) -> None:
        with self._lock:
            self.stats.completed_uploads[key] += 1


class _Handler(BaseHTTPRequestHandler):
    owner: FaultProxy
    protocol_version = "HTTP/1.1"  # keep-alive: clients reuse connections, as with a real store

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - base signature
        pass  # requests carry signed headers; never echo them anywhere

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        except (ConnectionError, TimeoutError, OSError):
            self.close_connection = True

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        self._serve()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = do_OPTIONS = do_GET  # noqa: N815

    def _serve(self) -> None:
        body = self._read_body()
        mode, stall = self.owner._decide(self.command, self.path)
        if mode == "stall":
            time.sleep(stall)
        elif mode in ("500", "503"):
            self._error(int(mode))
            return
        elif mode == "reset":
            self._reset()
            return
        if "upgrade" in self.headers.get("Connection", "").lower():
            self._tunnel(body)
            return
        try:
            status, reason, headers, data = self._forward(body)
        except OSError:
            self._error(502)
            return
        if mode == "reset_after":
            self._reset()
            return
        self.send_response_only(status, reason)
        for k, v in headers:
            if k.lower() not in _HOP and k.lower() not in ("transfer-encoding", "content-length"):
                self.send_header(k, v)
        if self.command == "HEAD":
            length = {k.lower(): v for k, v in headers}.get("content-length")
            if length is not None:
                self.send_header("Content-Length", length)
        else:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        self.wfile.flush()
        if 200 <= status < 300 and self._is_upload():
            self.owner._completed(urllib.parse.urlsplit(self.path).path)

    def _is_upload(self) -> bool:
        q = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query, keep_blank_values=True)
        if self.command == "PUT":
            return (
                "partNumber" not in q
                and "tagging" not in q
                and "x-amz-copy-source" not in {k.lower() for k in self.headers}
            )
        return self.command == "POST" and "uploadId" in q  # CompleteMultipartUpload

    def _read_body(self) -> bytes:
        """The request body as sent (chunked framing kept: it is forwarded unchanged)."""
        n = self.headers.get("Content-Length")
        if n is not None:
            return self.rfile.read(int(n))
        if "chunked" not in self.headers.get("Transfer-Encoding", "").lower():
            return b""
        raw = bytearray()
        while True:
            line = self.rfile.readline()
            raw += line
            size = int(line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, then the empty line
                    t = self.rfile.readline()
                    raw += t
                    if t in (b"\r\n", b"\n", b""):
                        return bytes(raw)
            raw += self.rfile.read(size + 2)

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(
            self.owner.upstream_host, self.owner.upstream_port, timeout=self.owner.upstream_timeout_s
        )
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for k, v in self.headers.items():
                if k.lower() not in _HOP:
                    conn.putheader(k, v)
            conn.putheader("Connection", "close")
            conn.endheaders()
            if body:
                conn.send(body)
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, resp.reason, resp.getheaders(), data
        finally:
            conn.close()

    def _error(self, status: int) -> None:
        code, msg = {
            500: ("InternalError", "We encountered an internal error. Please try again."),
            502: ("BadGateway", "The upstream server could not be reached."),
            503: ("SlowDown", "Please reduce your request rate."),
        }[status]
        data = _S3_ERROR.format(code=code, msg=msg).encode()
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(data)))
        if status == 503:
            self.send_header("Retry-After", "0")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        self.wfile.flush()

    def _reset(self) -> None:
        # SO_LINGER 0: close() sends RST, what a crashed load balancer or a dropped NAT
        # entry looks like to the client ("connection reset by peer").
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass
        self.close_connection = True

    def _tunnel(self, body: bytes) -> None:
        """WebSocket (Prefect's event stream): replay the request upstream, then pipe bytes."""
        up = socket.create_connection((self.owner.upstream_host, self.owner.upstream_port), timeout=10)
        head = (
            f"{self.command} {self.path} HTTP/1.1\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
            + "\r\n"
        )
        up.sendall(head.encode() + body)
        self.wfile.flush()
        down = self.connection
        up.settimeout(None)
        down.settimeout(None)
        socks = [down, up]
        try:
            while True:
                ready, _, _ = select.select(socks, [], [], 60)
                if not ready:
                    continue
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    (up if s is down else down).sendall(data)
        except OSError:
            return
        finally:
            up.close()
            self.close_connection = True
