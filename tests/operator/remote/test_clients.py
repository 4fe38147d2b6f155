"""Logging in to a remote cluster from a kubeconfig Secret (operator/remote/clients.py), and what
a bad Secret becomes: one line in status.clusters[].message naming the Secret and the fix
(operator/remote/sync.py), with the other clusters' parts untouched."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import urllib3
import yaml

from diloco.operator.kube import ApiError
from diloco.operator.remote import clients, sync
from diloco.spec import KUBECONFIG_KEY, RemoteCluster

CA = b"-----BEGIN CERTIFICATE-----\nnot read until a request is made\n-----END CERTIFICATE-----\n"


def kubeconfig(user: dict[str, Any] | None = None, **over: Any) -> dict[str, Any]:
    """A remote cluster's kubeconfig as `kubectl config view --raw --minify` writes it."""
    return {"apiVersion": "v1", "kind": "Config", "current-context": "eu",
            "clusters": [{"name": "eu", "cluster": {"server": "https://eu.example:6443",
                                                      "certificate-authority-data": base64.b64encode(CA).decode()}}],
            "contexts": [{"name": "eu", "context": {"cluster": "eu", "user": "home", "namespace": "ml"}}],
            "users": [{"name": "home", "user": user if user is not None else {"token": "t0k3n"}}], **over}


def secret(data: bytes | None, version: str = "7") -> dict[str, Any]:
    encoded = {} if data is None else {KUBECONFIG_KEY: base64.b64encode(data).decode()}
    return {"metadata": {"name": "eu-kubeconfig", "resourceVersion": version}, "data": encoded}


def as_secret(config: dict[str, Any], version: str = "7") -> dict[str, Any]:
    return secret(yaml.safe_dump(config).encode(), version)


@pytest.mark.parametrize(("body", "says"), [
    (None, ["Secret eu-kubeconfig", "is missing", f"key {KUBECONFIG_KEY!r}", "docs/MULTI_CLUSTER.md"]),
    (secret(None), [f"has no key {KUBECONFIG_KEY!r}", "put the remote cluster's kubeconfig there"]),
    ({"metadata": {}, "data": {KUBECONFIG_KEY: "%%% not base64"}}, ["is not a kubeconfig"]),
    (secret(b"clusters: [unclosed"), ["is not a kubeconfig"]),
    (secret(b"just a string"), ["is not a kubeconfig (no clusters or users)"]),
    (as_secret(kubeconfig(users=[])), ["is not a kubeconfig (no clusters or users)"]),
    (as_secret(kubeconfig({"exec": {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": "gke-auth"}})),
     ["user 'home'", "exec plugin", "ServiceAccount token or a client certificate"]),
    (as_secret(kubeconfig({"auth-provider": {"name": "gcp"}})), ["auth provider", "client certificate"]),
], ids=["missing", "no-key", "not-base64", "not-yaml", "not-a-mapping", "no-users", "exec", "auth-provider"])
def test_an_unusable_secret_names_itself_and_the_fix(body: dict[str, Any] | None, says: list[str]) -> None:
    with pytest.raises(clients.CredentialsError) as err:
        clients.parse("eu-kubeconfig", body)
    for part in says:
        assert part in str(err.value), str(err.value)


def test_a_kubeconfig_the_client_library_refuses_is_a_credentials_error(tmp_path: Path) -> None:
    # Well formed, but its current context names no context there: refused at login, as one line.
    broken = as_secret(kubeconfig(**{"current-context": "us"}))
    with pytest.raises(clients.CredentialsError, match="Secret eu-kubeconfig: the kubeconfig cannot be used"):
        clients.connect("eu-kubeconfig", broken, "diloco-test", str(tmp_path))


def test_a_token_kubeconfig_logs_in_to_its_server_with_its_ca_and_short_timeouts(tmp_path: Path) -> None:
    kube = clients.connect("eu-kubeconfig", as_secret(kubeconfig()), "diloco-test", str(tmp_path))
    assert kube.host == "https://eu.example:6443"
    assert kube.token() == "t0k3n" and kube.verify
    assert kube.ca_file is not None and Path(kube.ca_file).read_bytes() == CA
    assert kube.pool.connection_pool_kw["timeout"].read_timeout == clients.TIMEOUT  # not the default 30 s


def test_a_client_is_kept_while_its_secret_is_unchanged_and_rebuilt_when_rotated() -> None:
    pool = clients.Clients("diloco-test")
    first = pool.client("diloco-system", "eu-kubeconfig", as_secret(kubeconfig(), version="7"))
    assert pool.client("diloco-system", "eu-kubeconfig", as_secret(kubeconfig(), version="7")) is first
    rotated = pool.client("diloco-system", "eu-kubeconfig", as_secret(kubeconfig({"token": "n3w"}), version="8"))
    assert rotated is not first and rotated.token() == "n3w"
    # A rotation to a Secret that cannot be used raises, and is never cached in place of the good client.
    with pytest.raises(clients.CredentialsError):
        pool.client("diloco-system", "eu-kubeconfig", as_secret(kubeconfig(users=[]), version="9"))
    assert pool.client("diloco-system", "eu-kubeconfig", as_secret(kubeconfig({"token": "n3w"}), "8")).token() == "n3w"


class HomeSecrets:
    """The home API server's Secrets in the operator's namespace, as Kube.get returns them."""

    def __init__(self, secrets: dict[str, dict[str, Any]], refuse: ApiError | None = None) -> None:
        self.secrets, self.refuse = secrets, refuse

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        assert (kind, namespace) == ("Secret", "diloco-system")
        if self.refuse is not None:
            raise self.refuse
        return self.secrets.get(name)


EU = RemoteCluster.model_validate({"name": "eu", "kubeconfigSecret": "eu-kubeconfig"})


@pytest.mark.parametrize(("home", "says", "gone"), [
    (HomeSecrets({}), "Secret eu-kubeconfig (the operator's namespace) is missing", True),
    (HomeSecrets({"eu-kubeconfig": as_secret(kubeconfig({"exec": {"command": "aws"}}))}), "exec plugin", False),
    (HomeSecrets({}, refuse=ApiError(403, "forbidden", "Forbidden", 'secrets "eu-kubeconfig" is forbidden')),
     "bind the Role docs/MULTI_CLUSTER.md lists", False),
], ids=["deleted", "exec", "home-forbidden"])
def test_a_bad_secret_becomes_that_clusters_problem_never_an_exception(home: HomeSecrets, says: str,
                                                                      gone: bool) -> None:
    seen = sync.read_one(home, clients.Clients("diloco-test"), "diloco-system", EU, "ml", "j")  # type: ignore[arg-type]
    assert not seen.reachable and seen.kube is None and says in seen.problem, seen.problem
    # Only a deleted Secret lets the home job give the part up (the user took the cluster's access away).
    assert seen.credentials_gone is gone


def test_without_its_own_namespace_the_operator_says_which_variable_to_set() -> None:
    seen = sync.read_one(HomeSecrets({}), clients.Clients("t"), None, EU, "ml", "j")  # type: ignore[arg-type]
    assert "$DILOCO_OPERATOR_NAMESPACE" in seen.problem and not seen.credentials_gone


@pytest.mark.parametrize(("exc", "says"), [
    (ApiError(401, "Unauthorized"), "renew the token in the kubeconfig Secret"),
    (urllib3.exceptions.MaxRetryError(None, "/", reason=ConnectionRefusedError(111, "refused")),  # type: ignore[arg-type]
     "its API server cannot be reached (ConnectionRefusedError"),
    (TimeoutError("timed out"), "its API server cannot be reached (TimeoutError: timed out)"),
    (ApiError(500, "boom", detail="etcdserver: request timed out"), "HTTP 500: etcdserver: request timed out"),
], ids=["401", "refused", "timeout", "500"])
def test_a_remote_failure_is_one_line_with_the_fix(exc: Exception, says: str) -> None:
    assert says in sync.describe(exc)
