"""Child processes of a local run: start, read JSON events, kill, restart.

The syncer is started with `subprocess`; learners are forked from a zygote that has imported
their code (apps/local/zygote.py; never a fork after JAX starts), so a restart costs its own
start, not the imports, or with `subprocess` where the zygote is not available. Each learner is
pinned to one core so learners share the machine fairly (docs/DEVELOPMENT.md). A learner of
several hosts (hostsPerLearner) is one child of several processes that start, die and restart
together, as the operator restarts a gang.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from diloco.apps.local.zygote import Zygote, become_subreaper
from diloco.contract import read_events


class Process(Protocol):
    """What the supervisor needs of a child process: a `subprocess.Popen` or a zygote's fork."""

    pid: int
    stdout: IO[bytes] | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...


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
    # A multi-host learner: each host's own flags (process id, core), the coordinator added at start.
    hosts: list[list[str]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # on top of the supervisor's
    proc: Process | None = None  # host 0: the one that speaks (events on stdout)
    others: list[Process] = field(default_factory=list)
    restarts: int = 0
    started_at: float = 0.0
    down_since: float | None = None  # set while killed and waiting to restart
    reader: threading.Thread | None = None
    last_event: dict[str, Any] = field(default_factory=dict)

    @property
    def procs(self) -> list[Process]:
        return ([self.proc] if self.proc is not None else []) + self.others

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def exit_code(self) -> int | None:
        """How the child ended, if any of its processes has: host 0's code, else the first
        other host's (a lost host ends the learner)."""
        if self.proc is None:
            return None
        codes = [p.poll() for p in self.procs]
        if codes[0] is not None:
            return codes[0]
        return next((c for c in codes[1:] if c is not None), None)


class Supervisor:
    """Starts children, funnels their stdout JSON events into one queue."""

    def __init__(self, env: dict[str, str], zygote_log: Path | None = None):
        self.env = env
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.children: dict[str, Child] = {}
        # Learners fork from a zygote per environment when we can adopt them (Linux).
        self.zygote_log = zygote_log if zygote_log is not None and become_subreaper() else None
        self.zygotes: dict[tuple[tuple[str, str], ...], Zygote] = {}

    def add(self, child: Child) -> None:
        self.children[child.name] = child

    def start(self, name: str, extra: list[str] | None = None) -> None:
        c = self.children[name]
        argv = c.argv + (extra or [])
        env = {**self.env, **c.env}
        log = open(c.log_path, "ab")  # noqa: SIM115 - the child owns it for its lifetime
        hosts = c.hosts or [[]]
        # A fresh coordinator port per start: the last one may linger in TIME_WAIT.
        coordinator = ["--coordinator", f"127.0.0.1:{free_port()}"] if len(hosts) > 1 else []
        zygote = self._zygote(env) if c.kind == "learner" else None
        try:
            c.proc = self._launch(zygote, argv + hosts[0] + coordinator, None, log, env)
            c.others = [self._launch(zygote, argv + h + coordinator, log, log, env) for h in hosts[1:]]
        finally:
            log.close()
        c.started_at, c.down_since = time.time(), None
        c.reader = threading.Thread(target=self._read, args=(c.name, c.proc.stdout), daemon=True)
        c.reader.start()

    def _zygote(self, env: dict[str, str]) -> Zygote | None:
        if self.zygote_log is None:
            return None
        key = tuple(sorted(env.items()))
        if key not in self.zygotes:
            self.zygotes[key] = Zygote(env, self.zygote_log)
        return self.zygotes[key]

    def _launch(self, zygote: Zygote | None, argv: list[str], stdout: IO[bytes] | None, log: IO[bytes],
                env: dict[str, str]) -> Process:
        """Fork from the zygote, or start with `subprocess` where there is none; stdout None is a
        pipe to us. A zygote that fails is reported once and not used again."""
        if zygote is not None:
            r, w = os.pipe() if stdout is None else (-1, stdout.fileno())
            try:
                forked = zygote.spawn(argv, w, log.fileno())
            except RuntimeError as exc:
                print(f"diloco run: {exc}; starting learners without it", file=sys.stderr)
                self.zygote_log = None
                for z in self.zygotes.values():
                    z.close()
                self.zygotes.clear()
                if stdout is None:
                    os.close(r)
                    os.close(w)
            else:
                if stdout is None:
                    os.close(w)
                    forked.stdout = os.fdopen(r, "rb")
                return forked
        return subprocess.Popen(argv, stdout=subprocess.PIPE if stdout is None else stdout, stderr=log, env=env,
                                start_new_session=True)

    def close(self) -> None:
        """Let the zygotes go (after the learners have stopped)."""
        for zygote in self.zygotes.values():
            zygote.close()
        self.zygotes.clear()

    def _read(self, name: str, stream: IO[bytes] | None) -> None:
        if stream is None:
            return
        for event in read_events(stream, time.time):
            event["source"] = name
            self.events.put(event)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Kill every process of the child (all hosts of a learner: none can go on alone)."""
        c = self.children[name]
        for p in reversed(c.procs):
            if p.poll() is None:
                os.killpg(p.pid, sig)
            p.wait()
        c.down_since = time.time()

    def stop_all(self, kinds: tuple[str, ...], timeout: float = 20.0) -> None:
        """SIGTERM, then SIGKILL whatever has not exited after `timeout`."""
        victims = [c for c in self.children.values() if c.kind in kinds]
        procs = [p for c in victims for p in c.procs if p.poll() is None]
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
        deadline = time.time() + timeout
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for c in victims:
            if c.reader is not None:
                c.reader.join(timeout=2.0)

