"""A real Decoupled DiLoCo job as local processes, for fault-injection tests.

`Cluster` starts one syncer (or two sharing a checkpoint store: an active one and its
standby, `syncers=2`, spec.syncer.standby; as many per shard with spec.syncer.shards) and N
learners with `python -m diloco.apps.cli syncer|learner` (the container entry points), each
in its own process group, learners pinned to one core each. It reads every learner's stdout
JSON events on a thread, polls the syncer's Status RPC on another, and lets a test wait on any
condition over those with a deadline (`wait_for`), never with a bare sleep. `close()` SIGKILLs
every process group it started, including stopped ones, and runs even when the test failed
(use it as a context manager).

The model is tiny (2 layers, d_model 64, context 64, batch 8: about 15 ms a step), so a
learner starts, compiles and joins in a few seconds; JAX's persistent compilation cache is
shared by every process of a test session, so restarts skip most of the compilation.
"""

from __future__ import annotations

import atexit
import os
import secrets
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

import grpc
import yaml

from diloco.apps.local.procs import free_port
from diloco.apps.testkit.relay import FaultProxy
from diloco.contract import TOKEN_ENV, LearnerArgs, SyncerArgs, diloco_argv, read_events
from diloco.wire import GRPC_OPTIONS, auth_metadata, pb, rpc
from tests.helpers import TINY_MODEL

T = TypeVar("T")
# One persistent JAX compilation cache for every test process, so learners (re)start in a few
# seconds; keyed by user so parallel CI jobs on one machine do not share it.
SHARED_JAX_CACHE = Path(tempfile.gettempdir()) / f"diloco-tests-jax-cache-{os.getuid()}"
STATUS_POLL = 0.25  # seconds between Status RPCs: fine-grained enough to see every restart


_OPEN: set[Cluster] = set()  # clusters not yet closed; an interpreter exit closes them too


@atexit.register
def _close_all() -> None:
    for cluster in list(_OPEN):
        cluster.close()


def job_manifest(name: str, learners: int, syncer: dict[str, Any] | None = None,
                 training: dict[str, Any] | None = None) -> dict[str, Any]:
    """The tiny job every fault test runs (tests/helpers.py TINY_MODEL: ~15 ms a step)."""
    return {
        "apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": name},
        "spec": {
            "learnerGroups": [{"name": "local", "region": "local", "replicas": learners}],
            "syncer": {"fragments": 4, "checkpointIntervalSeconds": 1.0, **(syncer or {})},
            "model": dict(TINY_MODEL),
            "training": {"batchSize": 8, "learningRate": 0.003, "warmupSteps": 20, "decaySteps": 3000,
                         "evalIntervalSteps": 100, "evalBatches": 2, **(training or {})},
        },
    }


@dataclass
class Proc:
    """One slot (the syncer or a learner) and its current process."""

    name: str
    kind: str  # "syncer" | "learner"
    log_path: Path
    metrics_port: int
    popen: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    stopped: bool = False  # SIGSTOPped and not yet continued
    reader: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


@dataclass
class Status:
    """One Status RPC reply, as plain values, with the local receive time."""

    t: float
    incarnation: str
    versions: list[int]
    outer_steps: int
    tokens_merged: int
    active_learners: int
    refused: int
    checkpoint_version: int
    seconds_since_publish: float
    learners: dict[str, dict[str, float]] = field(default_factory=dict)
    step_seconds: float = 0.0  # the learners' median step time, as the syncer hears it
    port: int = 0  # which syncer answered (with a standby, only the active one serves)


class Cluster:
    def __init__(self, root: Path, name: str, learners: int, *, syncer: dict[str, Any] | None = None,
                 training: dict[str, Any] | None = None, checkpoint_dir: Path | str | None = None,
                 via_proxy: tuple[int, ...] = (), learner_args: dict[int, list[str]] | None = None,
                 cache_dir: Path | None = None, syncers: int = 1):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        (root / "logs").mkdir(exist_ok=True)
        self.manifest = job_manifest(name, learners, syncer, training)
        self.config = root / "job.yaml"
        self.config.write_text(yaml.safe_dump(self.manifest, sort_keys=False))
        self.token = secrets.token_hex(16)
        self.port = free_port()
        # With a standby: "syncer" listens on `port`, "syncer-b" on the next; learners get both.
        # Sharded (spec.syncer.shards N): shard s > 0's are "syncer-<s>" (and "syncer-<s>-b"), and
        # learners get each shard's, comma-separated in shard order.
        self.shards = int((syncer or {}).get("shards", 1))
        self.syncer_shard = {f"{'syncer' if s == 0 else f'syncer-{s}'}{suffix}": s
                             for s in range(self.shards) for suffix in ("", "-b")[:syncers]}
        self.syncer_ports = {name: self.port if name == "syncer" else free_port() for name in self.syncer_shard}
        self.checkpoint_dir = checkpoint_dir
        self.learner_args = learner_args or {}
        self.env = dict(os.environ, **{
            TOKEN_ENV: self.token, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu",
            "JAX_COMPILATION_CACHE_DIR": str(cache_dir or SHARED_JAX_CACHE),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        })
        self.ncpu = len(os.sched_getaffinity(0))
        self.cond = threading.Condition()
        self.events: list[dict[str, Any]] = []  # every learner event, in arrival order
        self.statuses: list[Status] = []
        self.procs: dict[str, Proc] = {n: Proc(n, "syncer", root / "logs" / f"{n}.log", free_port())
                                       for n in self.syncer_ports}
        self.learners = [f"local-{i}" for i in range(learners)]
        for n in self.learners:
            self.procs[n] = Proc(n, "learner", root / "logs" / f"{n}.log", free_port())
        self.proxies: dict[str, FaultProxy] = {}
        for i in via_proxy:
            self.proxies[self.learners[i]] = FaultProxy(self.port).start()
        self.channels = {port: grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
                         for port in self.syncer_ports.values()}
        self.channel = self.channels[self.port]
        self.stub = rpc.SyncerStub(self.channel)
        self.stubs = {port: rpc.SyncerStub(ch) for port, ch in self.channels.items()}
        self._closing = threading.Event()
        self._poller = threading.Thread(target=self._poll_status, name="status-poller", daemon=True)
        self._poller.start()
        _OPEN.add(self)

    # -- processes -------------------------------------------------------------------

    def _spawn(self, p: Proc, argv: list[str]) -> None:
        log = open(p.log_path, "ab")  # noqa: SIM115 - the child owns it for its lifetime
        log.write(f"\n=== {time.strftime('%H:%M:%S')} start #{p.restarts}: {' '.join(argv[2:])}\n".encode())
        log.flush()
        p.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, env=self.env, start_new_session=True)
        log.close()
        p.stopped = False
        p.reader = threading.Thread(target=self._read, args=(p.name, p.restarts, p.popen.stdout), daemon=True)
        p.reader.start()

    def start_syncer(self, extra: list[str] | None = None, wait: bool = True, timeout: float = 60.0,
                     name: str = "syncer") -> None:
        p = self.procs[name]
        ckpt = str(self.checkpoint_dir) if self.checkpoint_dir is not None else None
        shard = self.syncer_shard[name] if self.shards > 1 else None
        argv = diloco_argv("syncer", SyncerArgs(str(self.config), port=self.syncer_ports[name],
                                                  metrics_port=p.metrics_port, checkpoint_dir=ckpt,
                                                  shard=shard).argv())
        before = {s.incarnation for s in self.statuses}
        self._spawn(p, argv + (extra or []))
        if wait:
            self.wait_for(lambda: self.latest_status() is not None and self.latest_status().incarnation not in before,
                          timeout, "the syncer to answer Status")

    def start_learner(self, i: int, extra: list[str] | None = None) -> None:
        name = self.learners[i]
        p = self.procs[name]
        proxy = self.proxies.get(name)
        address = proxy.address if proxy else ",".join(
            "|".join(f"127.0.0.1:{port}" for syncer, port in self.syncer_ports.items() if self.syncer_shard[syncer] == s)
            for s in range(self.shards))
        argv = diloco_argv("learner", LearnerArgs(str(self.config), "local", i, address, metrics_port=p.metrics_port,
                                                  cpus=str(i % self.ncpu), restart=p.restarts).argv())
        self._spawn(p, argv + self.learner_args.get(i, []) + (extra or []))

    def restart(self, name: str, wait: bool = True) -> None:
        p = self.procs[name]
        p.restarts += 1
        if p.kind == "syncer":
            self.start_syncer(name=name, wait=wait)
        else:
            self.start_learner(self.learners.index(name))

    def kill(self, name: str, sig: int = signal.SIGKILL) -> float:
        """Signal the process group; SIGKILL also reaps it. Returns the time it was sent."""
        p = self.procs[name]
        assert p.popen is not None, f"{name} was never started"
        t = time.time()
        if p.popen.poll() is None:
            os.killpg(p.popen.pid, sig)
        if sig == signal.SIGSTOP:
            p.stopped = True
        elif sig == signal.SIGCONT:
            p.stopped = False
        elif sig == signal.SIGKILL:
            p.popen.wait(timeout=10)
            p.stopped = False
        return t

    def close(self) -> None:
        """SIGKILL every process group we started (stopped ones too), then the helpers."""
        _OPEN.discard(self)
        self._closing.set()
        for p in self.procs.values():
            if p.popen is not None and p.popen.poll() is None:
                try:
                    os.killpg(p.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs.values():
            if p.popen is not None:
                try:
                    p.popen.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            if p.reader is not None:
                p.reader.join(timeout=2.0)
        for proxy in self.proxies.values():
            proxy.close()
        self._poller.join(timeout=2.0)
        for ch in self.channels.values():
            ch.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- observation -----------------------------------------------------------------

    def _read(self, name: str, incarnation: int, stream: IO[bytes] | None) -> None:
        if stream is None:
            return
        for event in read_events(stream, time.time):
            event.update(source=name, run=incarnation, seen=time.time())
            with self.cond:
                self.events.append(event)
                self.cond.notify_all()

    def _poll_status(self) -> None:
        while not self._closing.wait(STATUS_POLL):
            for port in self.stubs:
                s = self.status(timeout=1.0, port=port)
                if s is not None:
                    with self.cond:
                        self.statuses.append(s)
                        self.cond.notify_all()

    def status(self, timeout: float = 2.0, port: int | None = None) -> Status | None:
        port = self.port if port is None else port
        try:
            r = self.stubs[port].Status(pb.StatusRequest(), metadata=auth_metadata(self.token), timeout=timeout)
        except grpc.RpcError:
            return None
        learners = {ls.learner: {"joins": ls.joins, "contributions": ls.contributions, "tokens_merged": ls.tokens_merged,
                                 "seconds_since_seen": ls.seconds_since_seen} for ls in r.learners}
        return Status(time.time(), r.incarnation, list(r.versions), r.outer_steps, r.tokens_merged,
                      r.active_learners, r.contributions_refused, r.checkpoint_version, r.seconds_since_publish,
                      learners, r.step_seconds, port)

    def latest_status(self) -> Status | None:
        with self.cond:
            return self.statuses[-1] if self.statuses else None

    def select(self, source: str | None = None, kind: str | None = None, after: float = 0.0,
               where: Callable[[dict[str, Any]], bool] | None = None) -> list[dict[str, Any]]:
        """Learner events (by source, kind, arrival time) seen so far."""
        with self.cond:
            evs = list(self.events)
        return [e for e in evs if (source is None or e["source"] == source) and (kind is None or e["event"] == kind)
                and e["seen"] >= after and (where is None or where(e))]

    def last(self, source: str, kind: str, after: float = 0.0) -> dict[str, Any] | None:
        evs = self.select(source, kind, after)
        return evs[-1] if evs else None

    def wait_for(self, condition: Callable[[], T], timeout: float, what: str) -> T:
        """Return condition()'s first truthy value, re-checked on every event and status poll;
        fail with `what`, the processes' state and their log tails after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            value = condition()
            if value:
                return value
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.diagnose()}")
            with self.cond:
                self.cond.wait(min(remaining, STATUS_POLL))

    def wait_event(self, source: str, kind: str, after: float = 0.0, timeout: float = 30.0,
                   where: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any]:
        return self.wait_for(lambda: next(iter(self.select(source, kind, after, where)), None), timeout,
                             f"a {kind!r} event from {source}")

    def wait_steps(self, source: str, steps: int, after: float, timeout: float = 30.0) -> dict[str, Any]:
        """The first progress event of `source` after `after` that has advanced `steps` beyond
        the first progress event after `after`."""
        def check() -> dict[str, Any] | None:
            prog = self.select(source, "progress", after)
            return next((e for e in prog if e["step"] >= prog[0]["step"] + steps), None) if prog else None
        return self.wait_for(check, timeout, f"{source} to take {steps} more steps")

    def metrics(self, name: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Scrape a process's Prometheus endpoint: {(sample name, sorted labels): value}."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.procs[name].metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def log(self, name: str) -> str:
        path = self.procs[name].log_path
        return path.read_text(errors="replace") if path.exists() else ""

    def diagnose(self) -> str:
        lines = []
        for p in self.procs.values():
            rc = None if p.popen is None else p.popen.poll()
            lines.append(f"--- {p.name}: alive={p.alive} returncode={rc} stopped={p.stopped} restarts={p.restarts}")
            lines.extend(self.log(p.name).splitlines()[-12:])
        s = self.latest_status()
        lines.append(f"--- latest status: {s}")
        lines.append(f"--- last events: {self.events[-8:]}")
        return "\n".join(lines)
