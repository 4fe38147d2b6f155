"""API clients for remote clusters, from the kubeconfig Secrets a home job names (`spec.clusters`).

Like MultiKueue's worker clusters: a Secret in the operator's namespace holds a kubeconfig whose
user is a token or a client certificate (an exec plugin, such as a cloud's login helper, is not in
the operator's image, so it is refused with a message saying so). A client is rebuilt when its
Secret changes (rotated credentials), and talks with short timeouts: an unreachable cluster must
cost a pass seconds, not the default half minute, while the other regions' parts are kept.
"""

from __future__ import annotations

import base64
import tempfile
import threading
from typing import Any

import yaml

from diloco.operator.kube import Kube, bearer_token
from diloco.spec import KUBECONFIG_KEY

TIMEOUT = 5.0  # seconds a remote request may take; a pass reads every cluster at once (sync.py)


class CredentialsError(ValueError):
    """A kubeconfig Secret the operator cannot log in with; the message names the Secret and the fix."""


def parse(secret_name: str, secret: dict[str, Any] | None) -> dict[str, Any]:
    """The kubeconfig in `secret` as data, or CredentialsError naming what is wrong and the fix."""
    where = f"Secret {secret_name} (the operator's namespace)"
    if secret is None:
        raise CredentialsError(f"{where} is missing; create it with key {KUBECONFIG_KEY!r} holding the remote "
                               "cluster's kubeconfig (docs/MULTI_CLUSTER.md)")
    raw = (secret.get("data") or {}).get(KUBECONFIG_KEY)
    if not raw:
        raise CredentialsError(f"{where} has no key {KUBECONFIG_KEY!r}; put the remote cluster's kubeconfig there")
    try:
        config = yaml.safe_load(base64.b64decode(raw))
    except (ValueError, yaml.YAMLError) as exc:
        raise CredentialsError(f"{where} key {KUBECONFIG_KEY!r} is not a kubeconfig: {exc}") from None
    if not isinstance(config, dict) or not config.get("clusters") or not config.get("users"):
        raise CredentialsError(f"{where} key {KUBECONFIG_KEY!r} is not a kubeconfig (no clusters or users)")
    for user in config["users"]:
        auth = (user or {}).get("user") or {}
        if "exec" in auth or "auth-provider" in auth:
            raise CredentialsError(f"{where}: user {user.get('name')!r} logs in through an exec plugin or auth "
                                   "provider, which the operator's image does not hold; use a ServiceAccount token "
                                   "or a client certificate (docs/MULTI_CLUSTER.md, the remote Role)")
    return config


def connect(secret_name: str, secret: dict[str, Any] | None, user_agent: str, folder: str) -> Kube:
    """A client logged in with the kubeconfig in `secret` (its current context)."""
    import kubernetes.client
    import kubernetes.config

    config = parse(secret_name, secret)
    cfg = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_kube_config_from_dict(config, client_configuration=cfg, persist_config=False,
                                                     temp_file_path=folder)
    except (kubernetes.config.ConfigException, KeyError, TypeError, ValueError) as exc:
        raise CredentialsError(f"Secret {secret_name}: the kubeconfig cannot be used: {exc}") from None
    return Kube(cfg.host, token=lambda: bearer_token(cfg), ca_file=cfg.ssl_ca_cert, cert_file=cfg.cert_file,
                key_file=cfg.key_file, verify=cfg.verify_ssl, timeout=TIMEOUT, user_agent=user_agent)


class Clients:
    """One client per kubeconfig Secret, kept while the Secret's resourceVersion is the same."""

    def __init__(self, user_agent: str) -> None:
        self.user_agent = user_agent
        self._folder = tempfile.mkdtemp(prefix="diloco-remote-")  # the kubeconfigs' CA and key files
        self._clients: dict[tuple[str, str], tuple[str, Kube]] = {}
        self._guard = threading.Lock()

    def client(self, namespace: str, secret_name: str, secret: dict[str, Any] | None) -> Kube:
        version = str(((secret or {}).get("metadata") or {}).get("resourceVersion") or "")
        key = (namespace, secret_name)
        with self._guard:
            cached = self._clients.get(key)
            if cached is not None and cached[0] == version and version:
                return cached[1]
        kube = connect(secret_name, secret, self.user_agent, self._folder)
        with self._guard:
            self._clients[key] = (version, kube)
        return kube
