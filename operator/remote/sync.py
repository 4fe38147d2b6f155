"""The remote clusters' I/O for one home job: read every cluster's part at once, write what the
plan says (operator/remote/health.py), and delete every part when the home job goes.

Reads run in parallel with short timeouts (operator/remote/clients.py), so a cluster whose API
server is down costs a pass a few seconds and never holds up the others. Every failure becomes
a `Seen.problem` naming the cluster and what to do, never an exception out of the pass.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import urllib3

from diloco.operator.kube import ApiError, Kube
from diloco.operator.remote import parts
from diloco.operator.remote.clients import Clients, CredentialsError
from diloco.operator.remote.health import Seen, Write, removals
from diloco.spec import KIND, RemoteCluster

log = logging.getLogger("diloco.operator")
NO_NAMESPACE = ("the operator does not know its own namespace, where kubeconfig Secrets live: set "
                "$DILOCO_OPERATOR_NAMESPACE (the chart sets it)")


def describe(exc: Exception) -> str:
    """A remote failure in a line: what happened and, where there is one, the fix."""
    if isinstance(exc, CredentialsError):
        return str(exc)
    if isinstance(exc, ApiError):
        if exc.status == 401:
            return "its API server refused the credentials (HTTP 401); renew the token in the kubeconfig Secret"
        if exc.status == 403:
            return (f"forbidden (HTTP 403): {exc.detail}; bind the Role docs/MULTI_CLUSTER.md lists to the "
                    "kubeconfig's user in that namespace")
        return f"HTTP {exc.status}: {exc.detail}"
    if isinstance(exc, urllib3.exceptions.HTTPError | OSError):
        reason = getattr(exc, "reason", None) or exc
        return f"its API server cannot be reached ({type(reason).__name__}: {str(reason)[:200]})"
    return f"{type(exc).__name__}: {exc}"


def read_one(home_api: Kube, clients: Clients, operator_namespace: str | None, cluster: RemoteCluster,
             namespace: str, name: str) -> Seen:
    """One cluster's part as it is there now."""
    if operator_namespace is None:
        return Seen(cluster, namespace, problem=NO_NAMESPACE)
    try:
        secret = home_api.get("Secret", operator_namespace, cluster.kubeconfig_secret)
        kube = clients.client(operator_namespace, cluster.kubeconfig_secret, secret)
    except (CredentialsError, ApiError) as exc:
        return Seen(cluster, namespace, problem=describe(exc), credentials_gone=not isinstance(exc, ApiError) and
                    secret is None)
    try:
        return Seen(cluster, namespace, kube, job=kube.get(KIND, namespace, name),
                    secret=kube.get("Secret", namespace, parts.secret_name(name)))
    except Exception as exc:  # every failure of a remote cluster is that cluster's problem
        return Seen(cluster, namespace, kube, problem=describe(exc))


def read(home_api: Kube, clients: Clients, operator_namespace: str | None,
         wanted: Iterable[tuple[RemoteCluster, str]], name: str) -> list[Seen]:
    """Every (cluster, namespace) in `wanted`, read at once."""
    wanted = list(wanted)
    if not wanted:
        return []
    with ThreadPoolExecutor(max_workers=min(len(wanted), 8), thread_name_prefix="diloco-remote") as pool:
        return list(pool.map(lambda w: read_one(home_api, clients, operator_namespace, w[0], w[1], name), wanted))


def write(w: Write) -> str:
    """Carry out one write; returns what was done, for the Event. Raises what the server said."""
    kube: Kube = w.kube
    if w.verb == "delete":
        kube.delete(w.kind, w.namespace, w.name)
    elif w.verb == "create":
        assert w.body is not None
        kube.create(w.body)
    else:
        assert w.body is not None
        kube.request("PUT", kube.path(w.kind, w.namespace, w.name), w.body)
    return f"{w.verb}d {w.kind} {w.namespace}/{w.name}"


def carry_out(writes: Sequence[Write]) -> tuple[list[str], list[str]]:
    """Every write, each cluster's in order; (done, failed) as lines naming the cluster. A failed
    write is tried again on the next pass."""
    done, failed = [], []
    for w in writes:
        try:
            done.append(f"cluster {w.cluster}: {write(w)}")
        except Exception as exc:  # a failed write is that cluster's problem, tried again next pass
            failed.append(f"cluster {w.cluster}: {w.verb} {w.kind} {w.namespace}/{w.name}: {describe(exc)}")
    return done, failed


def recorded(status: dict[str, Any]) -> list[tuple[RemoteCluster, str]]:
    """The clusters the status says hold a part (`status.clusters`), to find them again once the
    spec no longer names them."""
    out = []
    for x in status.get("clusters") or []:
        try:
            out.append((RemoteCluster(name=x["name"], kubeconfig_secret=x["kubeconfigSecret"]), str(x["namespace"])))
        except (KeyError, ValueError):
            log.warning("status.clusters entry %r unreadable; ignored", x)
    return out


def release(home_api: Kube, clients: Clients, operator_namespace: str | None, body: dict[str, Any],
            wanted: Iterable[tuple[RemoteCluster, str]]) -> tuple[list[str], list[str]]:
    """A home job being deleted: every remote part it holds deleted. Returns (what was done, what
    still holds the deletion back): a cluster that cannot be reached keeps the home job (and its
    finalizer) until it answers, or until its kubeconfig Secret is deleted, which gives its part up."""
    meta = body["metadata"]
    done, waiting = [], []
    for seen in read(home_api, clients, operator_namespace, wanted, meta["name"]):
        if seen.credentials_gone:
            done.append(f"cluster {seen.cluster.name}: its kubeconfig Secret is gone; its part is left as it is")
        elif not seen.reachable:
            waiting.append(f"cluster {seen.cluster.name}: {seen.problem}")
        else:
            ok, failed = carry_out(removals(meta["name"], meta["uid"], seen))
            done += ok
            waiting += failed
    return done, waiting
