"""A userspace relay between two interfaces: the harness's delay and loss (this kernel has no ``netem``).

    python -m ckptflow.netrelay IFACE_A IFACE_B CONTROL_FILE

Run inside a network namespace holding both interfaces (``ip netns exec``): every Ethernet frame that arrives on
one is sent out of the other, held back by the current delay and dropped with the current loss probability, the
two directions independent, order kept. The settings are read from ``CONTROL_FILE`` (JSON: ``{"delay_ms": 50,
"loss": 0.02}``; absent or unreadable: none) every 50 ms, so a harness changes them mid-run by replacing the file.

Frames are read and written with their virtio-net header (``PACKET_VNET_HDR``): a TCP segment the sender's
stack left unsegmented (veth offloads it) crosses as one frame and is segmented by the kernel on the far side,
so the relay handles tens of frames per MB, not hundreds. A dropped one is a burst of segments lost together,
which TCP recovers as it would from a congested switch's tail drop.
"""

from __future__ import annotations

import collections
import json
import os
import random
import socket
import sys
import threading
import time

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
POLL_S = 0.05


class Settings:
    def __init__(self, path: str) -> None:
        self.path = path
        self.delay_s = 0.0
        self.loss = 0.0
        self._seen: tuple[int, int] | None = None

    def refresh(self) -> None:
        try:
            st = os.stat(self.path)
            if (st.st_ino, st.st_mtime_ns) == self._seen:  # replaced files get a new inode
                return
            with open(self.path) as f:
                d = json.load(f)
            self.delay_s, self.loss = float(d.get("delay_ms", 0)) / 1000.0, float(d.get("loss", 0))
            self._seen = (st.st_ino, st.st_mtime_ns)
        except (OSError, ValueError, TypeError, AttributeError):
            self.delay_s, self.loss, self._seen = 0.0, 0.0, None


def _socket(iface: str) -> socket.socket:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.bind((iface, 0))
    return s


def _direction(src: socket.socket, dst: socket.socket, cfg: Settings, rng: random.Random) -> None:
    """Frames from ``src`` to ``dst``: a reader queues each with its due time, a writer sends it then."""
    q: collections.deque[tuple[float, bytes]] = collections.deque()
    ready = threading.Condition()

    def write() -> None:
        while True:
            with ready:
                while not q:
                    ready.wait()
                due, frame = q[0]
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            with ready:
                q.popleft()
            try:
                dst.send(frame)
            except OSError:  # the far link is down: the frame is lost, as on a wire
                pass

    threading.Thread(target=write, daemon=True).start()
    while True:
        frame = src.recv(1 << 17)
        if cfg.loss and rng.random() < cfg.loss:
            continue
        with ready:
            q.append((time.monotonic() + cfg.delay_s, frame))
            ready.notify()


def main(a: str, b: str, control: str) -> None:
    parent = os.getppid()
    cfg = Settings(control)
    cfg.refresh()
    sa, sb = _socket(a), _socket(b)
    rng = random.Random()
    for src, dst in ((sa, sb), (sb, sa)):
        threading.Thread(target=_direction, args=(src, dst, cfg, rng), daemon=True).start()
    print("relay up", flush=True)
    while os.getppid() == parent:  # a harness killed without clean-up takes its relay with it
        time.sleep(POLL_S)
        cfg.refresh()


if __name__ == "__main__":
    main(*sys.argv[1:4])
