"""The pieces every rendered child shares: its owner, metadata, security and volumes.

Split from operator/render/job.py so the learner renderer (operator/render/learners.py) and the rest of the job's
children (operator/render/job.py) build pods the same way without importing each other. Pure, like both.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from diloco.operator.render import naming as n
from diloco.spec import Resources

RUN_AS = 10001  # the images' non-root user


@dataclass(frozen=True)
class Owner:
    """The job's identity, stamped on every child as labels and an owner reference."""

    name: str
    namespace: str
    uid: str


def meta(owner: Owner, name: str, component: str | None = None, group: str | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": owner.namespace, "labels": n.labels(owner.name, component, group),
            "ownerReferences": [n.owner_reference(owner.name, owner.uid)]}


def digest(data: Any) -> str:
    """A short stable hash of plain data (pod templates carry it: a change restarts the pods)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def resources(res: Resources) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("requests", "limits"):
        values = getattr(res, key)
        if values:
            out[key] = {k: str(v) for k, v in values.items()}
    return out


def security() -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod, container) security contexts: non-root, no privilege, read-only root filesystem."""
    pod = {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
           "seccompProfile": {"type": "RuntimeDefault"}}
    container = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                 "capabilities": {"drop": ["ALL"]}}
    return pod, container


def token_volume(secret: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The job token as a file (`--token-file`), not $DILOCO_TOKEN: an environment variable shows in
    `kubectl describe`-style dumps, crash reports and every child process; a file readable by the
    pod's group alone does not. Only the `token` key: an external syncer's Secret also holds its CA."""
    volume = {"name": "token", "secret": {"secretName": secret, "defaultMode": 0o440,
                                          "items": [{"key": n.TOKEN_KEY, "path": n.TOKEN_KEY}]}}
    return volume, {"name": "token", "mountPath": n.TOKEN_DIR, "readOnly": True}


def tls_volume(secret: str, keys: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Only the keys a container needs, readable by its group alone (the pod's fsGroup)."""
    volume = {"name": "tls", "secret": {"secretName": secret, "defaultMode": 0o440,
                                        "items": [{"key": k, "path": k} for k in keys]}}
    return volume, {"name": "tls", "mountPath": n.TLS_DIR, "readOnly": True}


def common_volumes(owner: Owner, token_secret: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Config, scratch space and the token file (from `token_secret`) every job pod mounts."""
    token, token_mount = token_volume(token_secret)
    volumes: list[dict[str, Any]] = [{"name": "config", "configMap": {"name": n.config_map(owner.name)}},
                                     {"name": "tmp", "emptyDir": {}}, token]
    mounts: list[dict[str, Any]] = [{"name": "config", "mountPath": n.CONFIG_DIR, "readOnly": True},
                                    {"name": "tmp", "mountPath": "/tmp"}, token_mount]
    return volumes, mounts


def pod_basics() -> dict[str, Any]:
    """Pod fields every job pod shares. No service-account token: learners and syncer never call
    the Kubernetes API, so a compromised pod gets no credentials for it."""
    return {"automountServiceAccountToken": False, "enableServiceLinks": False}
