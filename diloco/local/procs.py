"""Child processes of a local run: start, read JSON events, kill, restart.

Children are started with `subprocess` (never fork after JAX starts) and each learner
is pinned to one core so learners share the machine fairly (docs/DEVELOPMENT.md).
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from diloco.contract import read_events


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Child:
    """One slot (the syncer or a learner) and its current process, if any."""

    name: str
    kind: str  # "syncer" | "learner"
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0
    down_since: float | None = None  # set while killed and waiting to restart
    reader: threading.Thread | None = None
    last_event: dict[str, Any] = field(default_factory=dict)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    """Starts children, funnels their stdout JSON events into one queue."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.children: dict[str, Child] = {}

    def add(self, child: Child) -> None:
        self.children[child.name] = child

    def start(self, name: str, extra: list[str] | None = None) -> None:
        c = self.children[name]
        argv = c.argv + (extra or [])
        log = open(c.log_path, "ab")  # noqa: SIM115 - the child owns it for its lifetime
        c.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, env=self.env, start_new_session=True)
        log.close()
        c.started_at, c.down_since = time.time(), None
        c.reader = threading.Thread(target=self._read, args=(c.name, c.proc.stdout), daemon=True)
        c.reader.start()

    def _read(self, name: str, stream: IO[bytes] | None) -> None:
        if stream is None:
            return
        for event in read_events(stream, time.time):
            event["source"] = name
            self.events.put(event)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        c = self.children[name]
        if c.proc is not None and c.proc.poll() is None:
            os.killpg(c.proc.pid, sig)
            c.proc.wait()
        c.down_since = time.time()

    def stop_all(self, kinds: tuple[str, ...], timeout: float = 20.0) -> None:
        """SIGTERM, then SIGKILL whatever has not exited after `timeout`."""
        victims = [c for c in self.children.values() if c.kind in kinds and c.alive]
        for c in victims:
            os.killpg(c.proc.pid, signal.SIGTERM)  # type: ignore[union-attr]
        deadline = time.time() + timeout
        for c in victims:
            try:
                c.proc.wait(max(0.1, deadline - time.time()))  # type: ignore[union-attr]
            except subprocess.TimeoutExpired:
                os.killpg(c.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
                c.proc.wait()  # type: ignore[union-attr]
        for c in victims:
            if c.reader is not None:
                c.reader.join(timeout=2.0)

