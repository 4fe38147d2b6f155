"""What a job needs from outside itself: the Secrets it only names, and a syncer that takes its token.

A cluster that hosts only learners (`spec.syncer.external`) reads the home job's token, and
optionally the CA of the syncer's certificate, from a Secret the user copies in; an exposed
syncer serves TLS with a certificate from a Secret the user (or cert-manager) provides. The
operator checks both before it runs pods that need them, because the failures otherwise
show up far from the cause: a pod whose Secret is missing never starts
(CreateContainerConfigError), and a learner whose token the syncer refuses exits at join and
crash-loops. Instead the job has no such pods and its status names the Secret. Pure: the
handlers read the Secrets and call the syncer.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

from diloco.contract import ALTERNATE
from diloco.operator.render import naming as n
from diloco.spec import DecoupledDiLoCoJob, shard_hosts

Secrets = dict[str, dict[str, Any] | None]  # name -> the Secret as read, None when it does not exist


REASONS = ("SecretMissing", "SecretIncomplete", "SyncerUnauthenticated")


@dataclass(frozen=True)
class Blocker:
    """Why the job runs no pods for now; the reason and message of its Running condition."""

    reason: str  # one of REASONS (CamelCase)
    message: str


def blocked(status: dict[str, Any]) -> bool:
    """Whether the status says a blocker removed the pods (so their deletion is not a loss)."""
    running: dict[str, Any] = next((x for x in status.get("conditions") or [] if x.get("type") == "Running"), {})
    return running.get("status") == "False" and running.get("reason") in REASONS


@dataclass(frozen=True)
class Link:
    """How learners (and the operator) reach the job's syncer and prove they belong to the job."""

    address: str  # host:port the learners dial (one per shard, comma-separated, for a sharded syncer)
    token_secret: str  # the Secret whose `token` key learners present
    ca_secret: str | None = None  # the Secret whose `ca.crt` verifies the syncer; None: plaintext
    # The certificate's name, when it is not the address's host: one for every shard, or one per
    # shard, comma-separated (what the learners pass as --tls-server-name).
    server_name: str | None = None


def referenced(job: DecoupledDiLoCoJob) -> list[tuple[str, tuple[str, ...], str]]:
    """(name, keys it must hold, field that names it) of every Secret the user provides."""
    syncer = job.spec.syncer
    out: list[tuple[str, tuple[str, ...], str]] = []
    if syncer.external is not None:
        out.append((syncer.external.token_secret, (n.TOKEN_KEY,), "spec.syncer.external.tokenSecret"))
    if syncer.token_secret is not None:
        out.append((syncer.token_secret, (n.TOKEN_KEY,), "spec.syncer.tokenSecret"))
    expose = syncer.expose
    if expose is not None and expose.tls.enabled and expose.tls.secret_name:
        out.append((expose.tls.secret_name, (n.TLS_CERT_KEY, n.TLS_KEY_KEY, n.CA_KEY),
                    "spec.syncer.expose.tls.secretName"))
    return out


def value(secret: dict[str, Any] | None, key: str) -> bytes | None:
    """One key of a Secret, decoded; None when absent, empty or not base64."""
    raw = ((secret or {}).get("data") or {}).get(key)
    if not raw:
        return None
    try:
        return base64.b64decode(raw, validate=True) or None
    except (ValueError, binascii.Error):
        return None


def secret_blocker(job: DecoupledDiLoCoJob, secrets: Secrets) -> Blocker | None:
    """The first referenced Secret that is missing or lacks a key, as the job's blocker."""
    for name, keys, field in referenced(job):
        secret = secrets.get(name)
        if secret is None:
            return Blocker("SecretMissing", f"Secret {name} ({field}) does not exist in this namespace; create it "
                                            f"with key(s) {', '.join(keys)}; no pods run until then")
        missing = [k for k in keys if value(secret, k) is None]
        if missing:
            return Blocker("SecretIncomplete", f"Secret {name} ({field}) has no {', '.join(missing)}; add "
                                               f"{'them' if len(missing) > 1 else 'it'}; no pods run until then")
    return None


def link(job: DecoupledDiLoCoJob, namespace: str, secrets: Secrets) -> Link:
    """External: the endpoint, the copied token, TLS if the copy carries a CA. In-cluster: the
    Service (a sharded syncer's pods, or with a standby each shard's Service), the job's own
    token, TLS when exposed with it (checked for
    `expose.host`, a sharded syncer's shard i for `shard-<i>.<host>`)."""
    syncer = job.spec.syncer
    ext = syncer.external
    if ext is not None:
        ca = ext.token_secret if value(secrets.get(ext.token_secret), n.CA_KEY) else None
        return Link(",".join(ext.addresses), ext.token_secret, ca, ext.server_name)
    name = job.metadata.name
    expose = syncer.expose
    tls = expose is not None and expose.tls.enabled
    # A sharded syncer's shards are dialled by their in-cluster names and checked for the names
    # other clusters dial: shard-<i>.<host>, one per shard.
    names = shard_hosts(expose.host, syncer.shards) if expose is not None and tls and expose.host else []
    return Link(paired(job, n.syncer_addresses(name, namespace, syncer.shards, standby=syncer.standby is not None)),
                syncer.token_secret or n.token_secret(name),
                expose.tls.secret_name if expose is not None and tls else None, ",".join(names) or None)


def paired(job: DecoupledDiLoCoJob, addresses: str) -> str:
    """`addresses` (one a shard, comma-separated) with each shard's other syncer where the standby
    pair's other member runs in another cluster (spec.syncer.standby.peers): `here|there`, tried in turn."""
    standby = job.spec.syncer.standby
    if standby is None or not standby.peers:
        return addresses
    return ",".join(f"{a}{ALTERNATE}{p}" for a, p in zip(addresses.split(","), standby.peers, strict=True))


def refused(job: DecoupledDiLoCoJob, to: Link, code: str) -> Blocker | None:
    """A syncer answering UNAUTHENTICATED refuses the token: learners would exit at join."""
    if code != "UNAUTHENTICATED" or job.spec.syncer.external is None:
        return None
    return Blocker("SyncerUnauthenticated",
                   f"the syncer at {to.address} refused the token in Secret {to.token_secret}; copy key "
                   f"`token` of Secret {n.token_secret(job.metadata.name)} from the home cluster; no learners "
                   "run until then")
