"""Which operator replica acts: kopf's peering, one priority per replica, and who wrote what.

The chart runs two replicas. kopf's peering keeps all but one paused: every replica writes a
keep-alive (identity, priority, lifetime, last seen) into one peering object (a
ClusterKopfPeering, or a KopfPeering in each watched namespace) and pauses while a live peer
has a higher priority; a peer of the *same* priority pauses everyone (kopf's rule: safe, but
nothing runs), so priorities must differ. A replica that dies without cleaning up (its node
lost) stays in the object until its record expires `lifetime` seconds after its last
keep-alive; a standby then resumes, re-lists the jobs and handles what changed meanwhile.

Priority: the older replica ranks higher (start time, then a random tie-break), so a new pod (a
rollout, a rescheduled replica) joins as the standby instead of pausing the active one mid-pass.
Identity and User-Agent carry the pod name (POD_NAME, the downward API), so the peering object
and the API server's audit log say which replica wrote.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import secrets
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import kopf

from diloco.operator.kube import ApiError, Kube

# Seconds a replica's keep-alive counts as alive. kopf renews it every max(1, lifetime - 5..10)
# seconds (so every 1-5 s at 10): a standby takes over at most `lifetime` after the active
# one's last keep-alive, and a keep-alive may be 5-9 s late (a slow API server, clock skew
# between nodes, a busy event loop) before a live replica is taken for dead.
LIFETIME = 10
MIN_LIFETIME = 5  # below, kopf renews every second and a 1 s hiccup flips the active replica
POD_ENV = "POD_NAME"
NAME_ENV, LIFETIME_ENV = "DILOCO_PEERING_NAME", "DILOCO_PEERING_LIFETIME_SECONDS"
GROUP_VERSION = "kopf.dev/v1"
TIEBREAK = 1_000_000  # random part of a priority: two replicas starting in one millisecond still differ


def pod_name(env: Mapping[str, str] = os.environ) -> str | None:
    return env.get(POD_ENV) or None


def kopf_agent(agent: str) -> str:
    """kopf's client: ours plus kopf's own mark, so its requests (watches, the job's annotations,
    keep-alives) are told apart from our children's writes."""
    try:
        version = importlib.metadata.version("kopf")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return f"{agent} kopf/{version}"


def priority(started_ms: int, tiebreak: int) -> int:
    """kopf pauses replicas of lower priority: the earlier start wins, `tiebreak` (0..TIEBREAK-1)
    separates starts in the same millisecond. Negative, and within int64 until the year 2262."""
    if not 0 <= tiebreak < TIEBREAK:
        raise ValueError(f"tiebreak {tiebreak} is outside 0..{TIEBREAK - 1}")
    return -(started_ms * TIEBREAK + tiebreak)


@dataclass(frozen=True)
class Peering:
    """One replica's peering: the shared object's `name`, its own `identity` and `priority`."""

    name: str
    identity: str
    priority: int
    lifetime: int = LIFETIME

    def __post_init__(self) -> None:
        if self.lifetime < MIN_LIFETIME:
            raise ValueError(f"${LIFETIME_ENV}: the peering lifetime must be at least {MIN_LIFETIME} seconds "
                             f"(got {self.lifetime}); kopf renews it every lifetime minus 5-10 s")
        if not self.name or not self.identity:
            raise ValueError(f"${NAME_ENV}: name the peering object the chart creates (got {self.name!r})")

    @classmethod
    def start(cls, name: str, identity: str, lifetime: int = LIFETIME) -> Peering:
        """A replica starting now: its priority from this moment and a random tie-break."""
        return cls(name, identity, priority(time.time_ns() // 1_000_000, secrets.randbelow(TIEBREAK)), lifetime)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Peering:
        """The chart's settings: the peering object's name, the lifetime, the pod's name."""
        name = env.get(NAME_ENV, "")
        if not name:
            raise ValueError(f"${NAME_ENV} is not set: name the chart's peering object (the release's "
                             "full name), or run with --standalone (one replica only)")
        raw = env.get(LIFETIME_ENV) or str(LIFETIME)
        try:
            lifetime = int(raw)
        except ValueError:
            raise ValueError(f"${LIFETIME_ENV}: expected whole seconds, got {raw!r}") from None
        return cls.start(name, pod_name(env) or default_identity(), lifetime)

    def apply(self, settings: kopf.OperatorSettings) -> None:
        """Mandatory peering: without the object every replica stays paused, never runs unpeered."""
        settings.peering.standalone = False
        settings.peering.mandatory = True
        settings.peering.name = self.name
        settings.peering.priority = self.priority
        settings.peering.lifetime = self.lifetime
        settings.peering.stealth = True  # no log line per keep-alive; pauses and resumes are still logged

    def run_kwargs(self) -> dict[str, Any]:
        """kopf.run's arguments for this replica (the settings come from `apply`)."""
        return {"standalone": False, "identity": self.identity, "priority": self.priority, "peering_name": self.name}


def default_identity() -> str:
    """Outside a pod (a developer's run): the host and process, unique while it runs."""
    return f"{socket.gethostname()}/{os.getpid()}"


def peering_path(name: str, namespace: str | None) -> str:
    if namespace is None:
        return "apis/kopf.dev/v1/clusterkopfpeerings"
    return f"apis/kopf.dev/v1/namespaces/{namespace}/kopfpeerings"


def missing(kube: Kube, name: str, namespaces: Sequence[str]) -> list[str]:
    """Where the peering object is absent (listed by name: the list verb kopf needs anyway).
    kopf would sit paused there without a word; the operator refuses to start instead."""
    where: list[str] = []
    scopes: list[str | None] = [*namespaces] or [None]
    for namespace in scopes:
        label = f"KopfPeering {namespace}/{name}" if namespace else f"ClusterKopfPeering {name}"
        try:
            items = kube.request("GET", peering_path(name, namespace),
                                 params={"fieldSelector": f"metadata.name={name}"}).get("items")
        except ApiError as exc:
            if exc.status != 404:
                raise
            items = None  # the CRD itself is not installed
        if not items:
            where.append(label)
    return where


def require(kube: Kube, peering: Peering, namespaces: Sequence[str]) -> None:
    absent = missing(kube, peering.name, namespaces)
    if absent:
        raise ValueError(f"peering object missing: {', '.join(absent)} (apiVersion {GROUP_VERSION}); the chart "
                         "creates it with its CRDs (`helm show crds`); or run one replica with --standalone")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentConnectionInfo(kopf.ConnectionInfo):
    """kopf's credentials plus a User-Agent header (kopf sets its own only where none is given)."""

    user_agent: str | None = None

    def as_http_headers(self) -> dict[str, str]:
        headers: dict[str, str] = dict(super().as_http_headers())
        if self.user_agent:
            headers["User-Agent"] = self.user_agent
        return headers


def connection_info(kube: Kube) -> kopf.ConnectionInfo:
    """kopf logs in with our client's credentials and a User-Agent naming the same replica."""
    token = kube.token()
    return AgentConnectionInfo(server=kube.host, ca_path=kube.ca_file, insecure=not kube.verify,
                               scheme="Bearer" if token else None, token=token, certificate_path=kube.cert_file,
                               private_key_path=kube.key_file, user_agent=kopf_agent(kube.user_agent))
