"""A warm start for learner processes: one process imports the learner's code once, and forks
every learner of a local run from there.

A restarted learner used to spend about 3 s of CPU before training again, most of it importing
JAX, Flax, gRPC and pydantic and loading the codec kernels (numba). On a shared core that CPU
is taken from the learners that are training: under chaos (a kill every ~20 s) it was a fifth of
the core. A fork of a process that has already done it costs milliseconds, so a restart pays
only for what is its own: starting JAX's backend, loading the compiled step from the cache and
joining.

Forking is safe here because the zygote never starts a JAX backend (XLA's thread pools are
created there, and JAX itself warns on a fork after it): it only imports modules and loads numba
kernels; its only other threads are OpenBLAS's idle pool, which OpenBLAS shuts down around a
fork. The zygote checks this before it reports ready. Each learner is forked twice (the
intermediate exits at once), so it is reparented to the runner, which has made itself a child
subreaper: the runner waits for, signals and reads the exit status of a forked learner as it does
for any child it started itself. One zygote per distinct environment, because JAX reads some of
its settings (JAX_PLATFORMS, the compilation cache) from the environment at import.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from diloco.contract import diloco_argv

READY_SECONDS = 120.0  # preloading takes 2-3 s on an idle core; a cold page cache and a busy machine, far more
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
# What `diloco learner` imports before it trains (trainer/learner.py), so a fork has it all.
PRELOAD = (
    "numpy", "jax", "jax.numpy", "flax.linen", "optax", "grpc", "prometheus_client",
    "diloco.apps.cli", "diloco.apps.commands", "diloco.launch", "diloco.spec", "diloco.shards",
    "diloco.core.fragments", "diloco.core.ledger", "diloco.core.schedule", "diloco.core.seed",
    "diloco.trainer.learner", "diloco.trainer.sync.client", "diloco.trainer.data", "diloco.trainer.hosts",
    "diloco.trainer.metrics", "diloco.trainer.model", "diloco.trainer.recipe", "diloco.trainer.sync.sharded_client",
    "diloco.trainer.sharding", "diloco.trainer.models.gpt", "diloco.trainer.models.llama", "diloco.trainer.caches.theta0",
    "diloco.trainer.caches.step_cache", "diloco.trainer.sync.peer_state", "diloco.trainer.sync.fragment_sync", "diloco.trainer.sync.link",
    "diloco.trainer.bringup", "diloco.trainer.sync.mirrored",
    # Imported lazily by a learner's first channel and first lowering: after a fork they cost
    # every restart about 0.1 s of CPU (profiled in a chaos run).
    "grpc._channel", "grpc.experimental", "jaxlib.mlir.dialects.mhlo",
)


def become_subreaper() -> bool:
    """Adopt our orphaned descendants (Linux's PR_SET_CHILD_SUBREAPER). False where that is
    not available: the caller then starts its children without a zygote."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


class Forked:
    """A learner forked by a zygote, after it was reparented to us: the part of
    `subprocess.Popen`'s interface the supervisor uses."""

    def __init__(self, pid: int, args: Sequence[str], stdout: IO[bytes] | None):
        self.pid, self.args, self.stdout = pid, list(args), stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode


class Zygote:
    """The runner's handle on one zygote process: `spawn` forks a `diloco` command from it."""

    def __init__(self, env: dict[str, str], log_path: Path):
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "diloco.apps.local.zygote", "--fd", str(child.fileno())],
                pass_fds=[child.fileno()], env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True)
        child.close()
        self.sock, self.log_path = parent, log_path
        self.lock = threading.Lock()
        self.ready: dict[str, object] | None = None

    def spawn(self, argv: Sequence[str], stdout: int, stderr: int) -> Forked:
        """Fork `argv` (a `diloco` command line, as `diloco_argv` makes it) with these as its
        stdout and stderr; the caller keeps its own copies of the descriptors."""
        prefix = diloco_argv("", [])[:-1]
        if list(argv[:len(prefix)]) != prefix:
            raise ValueError(f"not a diloco command line: {list(argv)}")
        with self.lock:
            if self.ready is None:
                self.ready = self._receive(READY_SECONDS)
            try:
                socket.send_fds(self.sock, [json.dumps({"args": list(argv[len(prefix):])}).encode()], [stdout, stderr])
            except OSError as exc:
                raise RuntimeError(f"the learners' zygote is gone ({exc}); see {self.log_path}") from exc
            reply = self._receive(30.0)
        return Forked(int(reply["pid"]), argv, None)  # type: ignore[call-overload]

    def _receive(self, timeout: float) -> dict[str, object]:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except OSError as exc:  # a timeout, or the zygote died
            raise RuntimeError(f"the learners' zygote did not answer ({exc}); see {self.log_path}") from exc
        if not data:
            raise RuntimeError(f"the learners' zygote exited (code {self.proc.poll()}); see {self.log_path}")
        reply: dict[str, object] = json.loads(data)
        if "error" in reply:
            raise RuntimeError(f"the learners' zygote: {reply['error']}")
        return reply

    def close(self) -> None:
        self.sock.close()  # the zygote exits at end of file
        try:
            self.proc.wait(10.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- inside the zygote ------------------------------------------------------------------------


def preload() -> dict[str, object]:
    """Import what a learner imports and load its codec kernels, without starting JAX."""
    import importlib

    t0, cpu0 = time.monotonic(), time.process_time()
    for name in PRELOAD:
        importlib.import_module(name)
    from diloco.core import codecs, warmup

    warmup.warm_codecs(codecs.CODECS)
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():  # a fork would copy XLA's threads' locks mid-use
        raise RuntimeError("a JAX backend started while preloading; forking now is unsafe")
    return {"ready": True, "seconds": round(time.monotonic() - t0, 3), "cpu_seconds": round(time.process_time() - cpu0, 3)}


def serve(sock: socket.socket) -> int:
    """Answer fork requests until the runner closes its end."""
    try:
        sock.send(json.dumps(preload()).encode())
    except Exception as exc:  # reported to the runner, which falls back to plain starts
        sock.send(json.dumps({"error": f"preload failed: {exc!r}"}).encode())
        raise
    while True:
        data, fds, _, _ = socket.recv_fds(sock, 65536, 2)
        if not data:
            return 0
        args = json.loads(data)["args"]
        pid = fork_learner(sock, args, fds)
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"pid": pid}).encode())


def fork_learner(sock: socket.socket, args: list[str], fds: list[int]) -> int:
    """Fork twice and return the grandchild's pid: the intermediate exits at once, so the
    grandchild is reparented to the runner (a subreaper) and reaped by it, never by us. The
    grandchild reports its pid itself, once it leads its own session: the runner signals that
    process group, so it must exist before the runner knows the pid (a kill at once would
    otherwise find no such group)."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(r)
        if os.fork() == 0:
            os.setsid()
            os.write(w, str(os.getpid()).encode())
            os.close(w)
            sock.close()
            run_child(args, fds)  # never returns
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        pid = int(pipe.read())  # to EOF: both ends closed, by the middle and by the grandchild
    os.waitpid(middle, 0)
    return pid


def run_child(args: list[str], fds: list[int]) -> None:
    """The learner, leading its own session: the given stdout and stderr, nothing else
    inherited; then exactly what `python -m diloco.apps.cli ARGS` does."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    for target, fd in ((0, devnull), (1, fds[0]), (2, fds[1])):
        os.dup2(fd, target)
    os.closerange(3, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024)
    sys.argv = ["diloco", *args]
    code = 1
    try:
        from diloco.apps.cli import main

        code = main(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # a crash is the learner's, reported as a plain process's would be
        import traceback

        traceback.print_exc()
    finally:
        import atexit

        atexit._run_exitfuncs()  # what the interpreter's exit would run (JAX's distributed shutdown, logging)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def main() -> int:
    parser = argparse.ArgumentParser(description="internal: the local runner's learner zygote")
    parser.add_argument("--fd", type=int, required=True, help="our end of the runner's socket pair")
    args = parser.parse_args()
    return serve(socket.socket(fileno=args.fd))


if __name__ == "__main__":
    sys.exit(main())
