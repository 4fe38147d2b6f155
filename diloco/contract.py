"""The process contract: how a learner or the syncer is started, and what it says back.

The CLI parses these flags, the operator renders them into pod args, and the local runner
builds them into argv; the exit codes and stdout events are what the runner, the tracker
and the operator's log readers act on. One module, so a flag renamed here is renamed for
every caller at once.
"""

from __future__ import annotations

import argparse
import enum
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import IO, Any

TOKEN_ENV = "DILOCO_TOKEN"  # the job token's variable when no --token-file is given
SYNCER_GRPC_PORT = 50051  # gRPC's conventional port
SYNCER_METRICS_PORT = 9101
LEARNER_METRICS_PORT = 9100  # Prometheus exporters conventionally sit at 9100+
# Push refusals (the syncer's `outcome`s) that throw no training away: a superseded process's last
# pushes, a forged recovery, a push to the wrong shard. Every other refusal is badput (goodput).
REFUSED_WITHOUT_WORK = frozenset({"impostor", "forged", "misrouted"})
MIN_TOKEN_CHARS = 16  # 64 bits of hex: guessing it over the network is hopeless
# A learner of spec.learnerGroups[].hostsPerLearner > 1 is H processes of one SPMD program:
# jax.distributed's coordinator (host 0's address), this process's id and the count. Flags win
# over these variables; the operator sets the variables in each pod of a learner's gang.
COORDINATOR_ENV = "DILOCO_COORDINATOR"
PROCESS_ID_ENV = "DILOCO_PROCESS_ID"
NUM_PROCESSES_ENV = "DILOCO_NUM_PROCESSES"
# Where a learner keeps Θ₀ and its lowered train step (trainer/caches/step_cache.py) across restarts: a
# local folder. Unset, beside JAX's compilation cache when that is a local folder (`diloco run`).
STEP_CACHE_ENV = "DILOCO_STEP_CACHE_DIR"
# JAX's persistent cache keeps only programs that took a second to compile by default; a learner
# caches every one, so a restart compiles nothing (the operator's pods and `diloco run` alike).
CACHE_EVERY_PROGRAM = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
COORDINATOR_PORT = 8476  # jax.distributed's customary port on host 0


class Exit(enum.IntEnum):
    """Exit codes of `diloco learner` and `diloco syncer`."""

    OK = 0  # finished (a learner reached spec.training.steps) or stopped by SIGTERM: see Finished
    FAILED = 1  # a crash: restart it
    CONFIG = 2  # the manifest or a flag is wrong: restarting cannot help
    REFUSED = 3  # the syncer refused this learner for good (token, admission): restarting cannot help


# Exit 0 is also SIGTERM's (a liveness probe's kill, a drain), so a learner that reached
# spec.training.steps says so where no kill can: it writes `Finished` to the file named by
# $DILOCO_TERMINATION_LOG (unset: nowhere, as in local runs) just before it exits. The operator
# renders the learner container's terminationMessagePath as TERMINATION_LOG and sets the variable
# to it; the kubelet copies the file's last 4096 bytes into the container's
# `state.terminated.message` (then `lastState`), which operator/status/steps.py reads.
TERMINATION_LOG_ENV = "DILOCO_TERMINATION_LOG"
TERMINATION_LOG = "/dev/termination-log"  # Kubernetes' default terminationMessagePath
FINISHED_MARKER = "diloco.dev/finished"
FINISHED_VERSION = 1


@dataclass(frozen=True)
class Finished:
    """A learner's word that it reached spec.training.steps: one JSON line, versioned."""

    learner: str  # its LearnerId
    steps: int  # the spec.training.steps it reached
    slot: int  # the schedule slot it stopped at (>= steps)

    def line(self) -> str:
        return json.dumps({"marker": FINISHED_MARKER, "version": FINISHED_VERSION, "reason": "finished",
                           "learner": self.learner, "steps": self.steps, "slot": self.slot}) + "\n"

    @classmethod
    def read(cls, message: object) -> Finished | None:
        """The marker in a container's termination message; None for anything else (no message,
        another program's text, another version)."""
        if not isinstance(message, str) or FINISHED_MARKER not in message:
            return None
        try:
            got = json.loads(message.strip().rsplit("\n", 1)[-1])
        except json.JSONDecodeError:
            return None
        if not isinstance(got, dict) or (got.get("marker"), got.get("version")) != (FINISHED_MARKER, FINISHED_VERSION):
            return None
        learner, steps, slot = got.get("learner"), got.get("steps"), got.get("slot")
        if isinstance(learner, str) and type(steps) is int and type(slot) is int:  # not bool
            return cls(learner, steps, slot)
        return None


def permanent_failure(code: int | None) -> bool:
    """An exit that a restart cannot fix, so supervisors stop instead of retrying."""
    return code in (Exit.CONFIG, Exit.REFUSED)


class Event(enum.StrEnum):
    """`event` of the JSON lines a learner prints on stdout (one object per line)."""

    JOINED = "joined"  # admitted, holding the global model; `restart` counts re-admissions
    PROGRESS = "progress"  # about once a second: steps, slot, seconds, tokens, bytes
    EVAL = "eval"  # held-out loss every spec.training.evalIntervalSteps
    PUSH_REFUSED = "push_refused"
    DISCONNECTED = "disconnected"
    REJOINED = "rejoined"  # the syncer restarted and this learner joined the new one
    READOPTED = "readopted"  # ... and rebased its progress onto the new syncer's state
    RECOVERED = "recovered"  # the new syncer adopted fragments this learner offered
    PEER_STATE = "peer_state"  # a mid-run (re)joiner adopted (or refused) a peer's optimizer state
    DIVERGED = "diverged"
    RESYNCED = "resynced"
    FATAL = "fatal"
    EXIT = "exit"  # the last line: flushed or not, and why it stopped
    # once, at the first push the syncer accepted: the start's phases in seconds since the
    # process started (trainer/timeline.py), the re-admission's cost
    TRAINING = "training"


def read_events(stream: IO[bytes], clock: Callable[[], float]) -> Iterator[dict[str, Any]]:
    """A child's stdout as events: each JSON object line as is, any other line as a `log` event
    (the syncer's ready line, a traceback); `t` defaults to when the line was read."""
    for raw in stream:
        line = raw.decode("utf-8", "replace").strip()
        if not line:
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            event = {"event": "log", "line": line}
        if isinstance(event, dict):
            event.setdefault("t", clock())
            yield event


READY_PREFIX = "SYNCER_READY"  # starts the line the syncer prints once it serves


def ready_line(port: int, incarnation: str) -> str:
    """What the syncer prints once it serves: supervisors learn its port and incarnation."""
    return f"{READY_PREFIX} port={port} incarnation={incarnation}"


def leased_incarnation(holder: str, epoch: int) -> str:
    """A syncer's incarnation under a leader lease (spec.syncer.standby): the lease's holder
    (`<pod>/<nonce>`) and epoch, so learners, which compare incarnations, can also refuse one from
    an older epoch (a fenced syncer: syncer/durable/leader.py), and the operator names the pod."""
    return f"{holder}@{epoch}"


# A sharded syncer's incarnation seen as one (diloco/shards.py `aggregate`): its shards', joined
# in shard order (a pod name, a nonce and an epoch never hold one).
SHARD_INCARNATIONS = "+"


def shard_incarnations(incarnation: str) -> list[str]:
    """Each shard's incarnation, in shard order, of one that `aggregate` joined (one when unsharded)."""
    return incarnation.split(SHARD_INCARNATIONS)


def incarnation_epoch(incarnation: str) -> int:
    """The lease epoch of an incarnation; 0 for a syncer that holds no lease."""
    _, sep, epoch = incarnation.rpartition("@")
    return int(epoch) if sep and epoch.isdigit() else 0


def incarnation_host(incarnation: str) -> str | None:
    """The pod (host name) of a leased syncer's incarnation; None for one that holds no lease."""
    host, sep, _ = incarnation.partition("/")
    return host if sep and incarnation_epoch(incarnation) else None


# Within one shard's --syncer address: the addresses of the active syncer and its standby
# (spec.syncer.standby), tried in turn while the one in use is unreachable (trainer/sync/client.py).
ALTERNATE = "|"


@dataclass(frozen=True, order=True)
class LearnerId:
    """A learner's name in every request, metric and event: `<group>-<index>`."""

    group: str
    index: int

    def __str__(self) -> str:
        return f"{self.group}-{self.index}"

    @classmethod
    def parse(cls, text: str) -> LearnerId:
        group, sep, index = text.rpartition("-")
        if not sep or not group or not index.isdigit():
            raise ValueError(f"learner id {text!r}: expected <group>-<index>, e.g. us-0")
        return cls(group, int(index))


# `--shard ordinal`: the shard is the pod's StatefulSet ordinal, the last "-N" of its hostname
# (the pod-index label needs Kubernetes 1.28; the hostname has it everywhere).
SHARD_FROM_HOSTNAME = "ordinal"


def parse_shard(arg: str, hostname: str) -> int:
    """`--shard`: a number, or `ordinal` (from `hostname`, e.g. job-syncer-2 is shard 2)."""
    raw = hostname.rsplit("-", 1)[-1] if arg == SHARD_FROM_HOSTNAME else arg
    if not raw.isdigit():
        where = f" (from hostname {hostname!r})" if arg == SHARD_FROM_HOSTNAME else ""
        raise ValueError(f"--shard {arg!r}{where}: expected a shard number, or `{SHARD_FROM_HOSTNAME}` in a "
                         "StatefulSet pod")
    return int(raw)


# -- argv: one builder and one parser per process ----------------------------------------


@dataclass(frozen=True)
class LearnerArgs:
    config: str
    group: str
    index: int | str  # a string where the pod fills it in, e.g. "$(POD_NAME)" (its ordinal)
    syncer: str
    _: KW_ONLY  # the optional flags by name: a positional slip would pass one as another
    metrics_port: int | None = None
    cpus: str | None = None
    host_cpus: str | None = None
    restart: int | None = None
    token_file: str | None = None  # None: the token is in $DILOCO_TOKEN (the local runner's way)
    tls_ca: str | None = None
    tls_server_name: str | None = None
    coordinator: str | None = None  # host:port of the learner's host 0 (hostsPerLearner > 1)
    process_id: int | None = None
    num_processes: int | None = None

    def argv(self) -> list[str]:
        out = ["--config", self.config, "--group", self.group, "--index", str(self.index), "--syncer", self.syncer]
        out += _optional(("--metrics-port", self.metrics_port), ("--cpus", self.cpus), ("--host-cpus", self.host_cpus),
                         ("--restart", self.restart),
                         ("--token-file", self.token_file), ("--tls-ca", self.tls_ca), ("--tls-server-name", self.tls_server_name),
                         ("--coordinator", self.coordinator), ("--process-id", self.process_id),
                         ("--num-processes", self.num_processes))
        return out


@dataclass(frozen=True)
class SyncerArgs:
    config: str
    _: KW_ONLY
    port: int = SYNCER_GRPC_PORT
    metrics_port: int | None = None
    checkpoint_dir: str | None = None
    token_file: str | None = None  # None: the token is in $DILOCO_TOKEN (the local runner's way)
    tls_cert: str | None = None
    tls_key: str | None = None
    shard: int | str | None = None  # a string where the pod fills it in; None: unsharded (shard 0)

    def argv(self) -> list[str]:
        out = ["--config", self.config, "--port", str(self.port)]
        out += _optional(("--metrics-port", self.metrics_port), ("--checkpoint-dir", self.checkpoint_dir),
                         ("--token-file", self.token_file), ("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key), ("--shard", self.shard))
        return out


def _optional(*pairs: tuple[str, object]) -> list[str]:
    return [x for flag, value in pairs if value is not None for x in (flag, str(value))]


def add_token_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", default=None, help=f"file holding the job token (else ${TOKEN_ENV})")


def add_client_tls_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", default=None, help="CA bundle (PEM): connect to the syncer over TLS")
    p.add_argument("--tls-server-name", default=None,
                   help="expected name in the syncer's certificate; for a sharded syncer one name for every shard, "
                        "or one per --syncer address, comma-separated in the same order")


def ordinal(text: str) -> int:
    """An index given as a number or as a StatefulSet pod's name (`job-us-3` is 3): pods fill it in
    from `metadata.name`, which every Kubernetes version has (the pod-index label needs 1.28)."""
    raw = text.rsplit("-", 1)[-1]
    if not raw.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number or a StatefulSet pod name ending in -N")
    return int(raw)


def add_learner_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="job manifest (YAML or JSON)")
    p.add_argument("--group", required=True, help="learner group name")
    p.add_argument("--index", type=ordinal, required=True,
                   help="replica index within the group, or the StatefulSet pod's name (its ordinal)")
    p.add_argument("--syncer", required=True,
                   help="syncer address host:port; for a sharded syncer every shard's, in shard order, comma-separated; "
                        "a syncer with a standby (spec.syncer.standby): both, `|`-separated (host-a:port|host-b:port)")
    add_token_flag(p)
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (default: none)")
    p.add_argument("--cpus", default=None, help="pin to these CPUs, e.g. 0 or 0,1")
    p.add_argument("--host-cpus", default=None,
                   help="run the learner's own threads (its loop, gRPC, pushes) on these CPUs and leave --cpus to "
                        "XLA's, as an accelerator leaves its host's cores to the host (default: all on --cpus)")
    p.add_argument("--restart", type=int, default=None,
                   help="restart count from the local runner: 0 joins as a new process, more takes the id over (default: a pod, which always takes over)")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: never)")
    p.add_argument("--inject-nan-at-step", type=int, default=-1, help=argparse.SUPPRESS)  # fault-injection tests
    add_client_tls_flags(p)
    p.add_argument("--coordinator", default=None,
                   help=f"multi-host learner: host 0's host:port for jax.distributed (else ${COORDINATOR_ENV})")
    p.add_argument("--process-id", type=ordinal, default=None,
                   help=f"multi-host learner: this host's id, or its pod's name (else ${PROCESS_ID_ENV})")
    p.add_argument("--num-processes", type=int, default=None,
                   help=f"multi-host learner: its host count (else ${NUM_PROCESSES_ENV})")


def add_syncer_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="job manifest (YAML or JSON)")
    p.add_argument("--port", type=int, default=SYNCER_GRPC_PORT, help="gRPC port (0 picks a free one)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (default: none)")
    p.add_argument("--checkpoint-dir", default=None, help="directory for durable checkpoints, or an fsspec URL (s3://bucket/prefix, gs://...; "
                        "a sharded syncer keeps shard i under URL/shard-<i>)")
    p.add_argument("--shard", default="0",
                   help="this process's shard of spec.syncer.shards: a number (default 0), or `ordinal` in a StatefulSet pod")
    add_token_flag(p)
    p.add_argument("--tls-cert", default=None, help="server certificate chain (PEM); serve TLS")
    p.add_argument("--tls-key", default=None, help="server private key (PEM)")


def diloco_argv(command: str, args: Sequence[str]) -> list[str]:
    """`python -P -m diloco.apps.cli COMMAND ...` for a child process of this interpreter; -P keeps
    the working directory off sys.path, so a clone's top-level `operator/` folder can never
    shadow the standard library's `operator`."""
    return [sys.executable, "-P", "-m", "diloco.apps.cli", command, *args]


def container_command(command: str) -> list[str]:
    """The same process in an image, where `pip install` put `diloco` on PATH."""
    return ["diloco", command]
