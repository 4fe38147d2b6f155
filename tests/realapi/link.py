"""One operator replica's network path to the API server, which a test can cut like a node dying.

A TCP forwarder on 127.0.0.1 (TLS passes through untouched: the server's certificate names
127.0.0.1, whatever the port). `cut()` closes the listener and every open connection at once:
from then on nothing of that replica reaches the server (no keep-alive, no clean-up of its
peering record, no write from a handler thread that was mid-flight), which is what the API
server sees when a node loses power. The replica's process keeps running, unheard.
"""

from __future__ import annotations

import socket
import threading
from typing import Any
from urllib.parse import urlsplit


class Link:
    def __init__(self, server: str):
        parts = urlsplit(server)
        self.target = (parts.hostname or "127.0.0.1", parts.port or 443)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.url = f"https://127.0.0.1:{self._listener.getsockname()[1]}"
        self._cut = threading.Event()
        self._open: set[socket.socket] = set()
        self._guard = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name=f"link {self.url}", daemon=True)

    def __enter__(self) -> Link:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cut()

    def cut(self) -> None:
        """Every connection reset, and no new one accepted (connection refused from now on)."""
        self._cut.set()
        self._thread.join(5)
        self._listener.close()
        with self._guard:
            for s in self._open:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            self._open.clear()

    def _accept(self) -> None:
        while not self._cut.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            with self._guard:
                if self._cut.is_set():
                    client.close()
                    upstream.close()
                    return
                self._open |= {client, upstream}
            done = threading.Barrier(2, action=lambda c=client, u=upstream: self._close(c, u))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b, done), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, done: threading.Barrier) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            try:
                sink.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            try:
                done.wait(timeout=600)  # both directions ended: close the pair
            except threading.BrokenBarrierError:
                pass

    def _close(self, *sockets: socket.socket) -> None:
        with self._guard:
            for s in sockets:
                self._open.discard(s)
                s.close()
