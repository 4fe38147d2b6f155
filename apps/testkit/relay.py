"""A threaded TCP relay on 127.0.0.1 that counts the bytes each way and whose behaviour can be
switched while traffic flows: the fault tests cut and slow links with it, the bandwidth benchmark
reads what a learner really puts on the wire (gRPC framing included).

Modes (`FaultProxy.set_mode`):

- ``pass``: forward bytes both ways as fast as they come.
- ``drop``: close every open connection and reset each new one at once (a link that went
  down, or a peer that refuses connections); gRPC sees UNAVAILABLE and reconnects later.
- ``stall``: keep every connection open and accept new ones, but forward nothing (a black
  hole: packets vanish, no reset). The proxy stops reading, so TCP flow control pushes back
  on the sender; when the mode returns to ``pass`` the held bytes flow again, late.
- ``slow``: forward at most ``rate`` bytes per second in each direction (one shared token
  bucket per direction, like a thin WAN link).

Only loopback is used: the proxy listens on 127.0.0.1 and connects to a 127.0.0.1 target.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

MODES = ("pass", "drop", "stall", "slow")
CHUNK = 64 * 1024
POLL = 0.1  # seconds a pump blocks before it re-reads the mode


@dataclass
class ProxyStats:
    accepted: int = 0  # connections forwarded
    refused: int = 0  # connections reset on arrival in drop mode
    dropped: int = 0  # open connections closed by a switch to drop
    upstream_bytes: int = 0  # client -> target
    downstream_bytes: int = 0  # target -> client
    mode_changes: list[tuple[float, str]] = field(default_factory=list)


class _Bucket:
    """Shared token bucket: `reserve(n)` says how long to wait before sending n bytes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.next_free = time.monotonic()

    def reserve(self, n: int, rate: float) -> float:
        with self.lock:
            now = time.monotonic()
            start = max(now, self.next_free)
            self.next_free = start + n / rate
            return self.next_free - now


class _Conn:
    def __init__(self, client: socket.socket, upstream: socket.socket):
        self.client, self.upstream = client, upstream
        self.closed = threading.Event()
        self._pumps_left = 2
        self._lock = threading.Lock()

    def shutdown(self, reset: bool = False) -> None:
        """Wake both pumps; the last pump to finish closes the sockets (never close an fd
        another thread may still be reading)."""
        self.closed.set()
        for s in (self.client, self.upstream):
            try:
                if reset:  # RST instead of FIN: what a dead middlebox or peer looks like
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def pump_done(self) -> None:
        with self._lock:
            self._pumps_left -= 1
            last = self._pumps_left == 0
        if last:
            self.closed.set()
            for s in (self.client, self.upstream):
                try:
                    s.close()
                except OSError:
                    pass


class FaultProxy:
    """`FaultProxy(target_port).start()`; point a learner at `proxy.address`."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1"):
        self.target = (target_host, target_port)
        self.mode = "pass"
        self.rate = 0.0
        self.stats = ProxyStats()
        self.cond = threading.Condition()
        self.conns: set[_Conn] = set()
        self.buckets = {"up": _Bucket(), "down": _Bucket()}
        self._closed = False
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.listener.settimeout(POLL)
        self.port = int(self.listener.getsockname()[1])
        self._threads: list[threading.Thread] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        t = threading.Thread(target=self._accept_loop, name=f"proxy-{self.port}", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def set_mode(self, mode: str, rate: float = 0.0) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "slow" and rate <= 0:
            raise ValueError("slow mode needs a positive rate in bytes per second")
        with self.cond:
            self.mode, self.rate = mode, float(rate)
            self.stats.mode_changes.append((time.time(), mode))
            victims = list(self.conns) if mode == "drop" else []
            self.cond.notify_all()
        for c in victims:
            self.stats.dropped += 1
            c.shutdown(reset=True)

    def close(self) -> None:
        with self.cond:
            self._closed = True
            victims = list(self.conns)
            self.cond.notify_all()
        for c in victims:
            c.shutdown()
        try:
            self.listener.close()
        except OSError:
            pass
        for t in self._threads:
            t.join(timeout=2.0)

    # -- internals -------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.mode == "drop":
                self.stats.refused += 1
                try:
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                finally:
                    client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=2.0)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.settimeout(None)  # blocking; reads poll with select, shutdown() wakes a blocked send
            conn = _Conn(client, upstream)
            with self.cond:
                self.conns.add(conn)
                self.stats.accepted += 1
            for src, dst, direction in ((client, upstream, "up"), (upstream, client, "down")):
                t = threading.Thread(target=self._pump, args=(conn, src, dst, direction), daemon=True,
                                     name=f"proxy-{self.port}-{direction}")
                t.start()

    def _wait_while(self, conn: _Conn, predicate, timeout: float | None = None) -> None:
        """Block (woken by mode changes) while predicate() holds, up to timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while predicate() and not self._closed and not conn.closed.is_set():
                remaining = POLL if deadline is None else min(POLL, deadline - time.monotonic())
                if remaining <= 0:
                    return
                self.cond.wait(remaining)

    def _pump(self, conn: _Conn, src: socket.socket, dst: socket.socket, direction: str) -> None:
        try:
            while not self._closed and not conn.closed.is_set():
                # A stalled link neither reads nor writes: the sender's buffers fill up.
                self._wait_while(conn, lambda: self.mode == "stall")
                if self._closed or conn.closed.is_set():
                    return
                size = CHUNK if self.mode != "slow" else max(256, min(CHUNK, int(self.rate / 20)))
                try:
                    readable, _, _ = select.select([src], [], [], POLL)
                    if not readable:
                        continue
                    data = src.recv(size)
                except (OSError, ValueError):
                    return
                if not data:
                    try:
                        dst.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    return
                if self.mode == "slow":
                    delay = self.buckets[direction].reserve(len(data), self.rate)
                    self._wait_while(conn, lambda: self.mode == "slow", timeout=delay)
                # Bytes read just before a stall are held until the link comes back.
                self._wait_while(conn, lambda: self.mode == "stall")
                if self._closed or conn.closed.is_set():
                    return
                try:
                    dst.sendall(data)
                except OSError:
                    return
                with self.cond:
                    if direction == "up":
                        self.stats.upstream_bytes += len(data)
                    else:
                        self.stats.downstream_bytes += len(data)
        finally:
            conn.shutdown()
            with self.cond:
                self.conns.discard(conn)
            conn.pump_done()
