"""The validating admission webhook's decisions (operator/admission/webhook.py) and its certificate
(operator/admission/certificates.py), without a cluster; tests/realapi/test_operator.py runs it behind a
real API server with `kubectl apply`."""

from __future__ import annotations

import base64
import copy
import datetime
import socket
import ssl
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from diloco.operator import handlers
from diloco.operator.admission import checks as spec_checks
from diloco.operator.admission import webhook
from diloco.operator.admission.certificates import (
    RENEW_BEFORE,
    WebhookOptions,
    ca_patch,
    dns_names,
    make,
    prepare,
    unfit,
)
from diloco.operator.context import Config
from diloco.operator.kube import ApiError
from diloco.operator.reconcile import passes
from diloco.operator.render import naming as n
from diloco.spec import parse_job
from tests.kube.tools import tool

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "decoupled-diloco"
NOW = datetime.datetime(2026, 12, 6, tzinfo=datetime.UTC)


def example(name: str, namespace: str = "jobs") -> dict[str, Any]:
    job = yaml.safe_load((ROOT / "examples" / name).read_text())
    job["metadata"]["namespace"] = namespace  # the API server fills it in before it asks
    return job


def image_in_template() -> dict[str, Any]:
    job = example("k8s-cpu-kind.yaml")
    job["spec"]["learnerGroups"][0]["template"] = {"spec": {"containers": [{"name": "learner", "image": "mine:1"}]}}
    return job


def wrong_hosts() -> dict[str, Any]:
    job = example("k8s-tpu.yaml")
    job["spec"]["learnerGroups"][0]["hostsPerLearner"] = 2
    return job


# -- what is refused: the operator's own checks, word for word ------------------------------


@pytest.mark.parametrize("manifest", [image_in_template, wrong_hosts], ids=["image-in-template", "hosts-per-learner"])
def test_a_create_is_refused_with_what_reconcile_and_validate_say(manifest: Any) -> None:
    job = manifest()
    refused = webhook.refusal("CREATE", None, job, Config(kueue=True))
    _, operator_says = passes.load(job)  # the job's InvalidSpec condition, had it been stored
    validate_says = spec_checks.problems(parse_job(job), gateway_api=False, kueue_enabled=True)  # `diloco validate`
    assert operator_says and refused == "; ".join(operator_says) == "; ".join(validate_says)
    assert refused.startswith(("spec.learnerGroups[0].template.spec.containers[0].image: the operator's learner",
                               "spec.learnerGroups[0].hostsPerLearner: a 4x4 TPU slice")), refused
    assert refused.endswith(("set by spec.learnerGroups[0].image", "set hostsPerLearner to 4")), refused


@pytest.mark.parametrize("name", ["k8s-cpu-kind.yaml", "k8s-gpu.yaml", "k8s-tpu.yaml", "sharded.yaml",
                                  "multicluster-home.yaml", "multicluster-remote-eu.yaml"])
def test_every_cluster_example_is_admitted(name: str) -> None:
    assert webhook.refusal("CREATE", None, example(name), Config(kueue=True)) is None


def test_install_checks_follow_the_operators_settings() -> None:
    """What this installation cannot run is refused as the operator would fail it: the chart's
    syncerExposure.gatewayAPI and kueue.enabled (a queue-labelled job checked as Kueue sees it)."""
    routed = example("k8s-tpu.yaml")
    routed["spec"]["syncer"]["expose"] = {"type": "GRPCRoute", "gateway": {"name": "wan"}, "host": "s.example.com",
                                          "tls": {"secretName": "syncer-tls"}}
    assert (webhook.refusal("CREATE", None, routed, Config()) or "").startswith(
        "spec.syncer.expose.type: GRPCRoute needs the Gateway API")
    assert webhook.refusal("CREATE", None, routed, Config(gateway_api=True)) is None
    crowded = example("k8s-tpu.yaml")
    crowded["spec"]["learnerGroups"] = [{**crowded["spec"]["learnerGroups"][0], "name": f"g{i}"} for i in range(8)]
    assert "a Kueue Workload holds at most 8 PodSets" in (webhook.refusal("CREATE", None, crowded,
                                                                          Config(kueue=True)) or "")
    assert webhook.refusal("CREATE", None, crowded, Config(kueue=False)) is None


def test_an_update_is_refused_only_when_it_adds_a_problem() -> None:
    good, bad = example("k8s-tpu.yaml"), wrong_hosts()
    config = Config(kueue=True)
    assert webhook.refusal("UPDATE", good, bad, config) == webhook.refusal("CREATE", None, bad, config)
    assert webhook.refusal("UPDATE", bad, good, config) is None  # the fix
    # kopf's finalizer and annotations on a job stored invalid (no webhook then, or Ignore): its
    # problems are the old object's, so the operator's own writes and its deletion go through.
    annotated = copy.deepcopy(bad)
    annotated["metadata"]["annotations"] = {"diloco.dev/last-handled-configuration": "{}"}
    annotated["metadata"]["finalizers"] = ["diloco.dev/finalizer"]
    assert webhook.refusal("UPDATE", bad, annotated, config) is None
    both = copy.deepcopy(bad)
    both["spec"]["learnerGroups"][0]["template"] = {"spec": {"containers": [{"name": "learner", "image": "x:1"}]}}
    assert "containers[0].image" in (webhook.refusal("UPDATE", bad, both, config) or "")  # a second problem
    assert webhook.refusal("UPDATE", both, bad, config) is None  # one of two fixed: no new problem
    going = copy.deepcopy(both)
    going["metadata"]["deletionTimestamp"] = "2026-12-06T00:00:00Z"
    assert webhook.refusal("UPDATE", good, going, config) is None


def test_the_handler_is_registered_only_with_a_webhook_and_at_the_charts_path() -> None:
    """kopf serves a handler at /<its id>: the path in the chart's webhook configuration."""
    assert not handlers.build_registry(Config())._webhooks.get_all_handlers()
    (handler,) = handlers.build_registry(Config(webhook=WebhookOptions()))._webhooks.get_all_handlers()
    out = subprocess.run([str(tool("helm")), "template", "diloco", str(CHART), "--namespace", "diloco-system"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    (configuration,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "ValidatingWebhookConfiguration"]
    assert configuration["webhooks"][0]["clientConfig"]["service"]["path"] == f"/{handler.id}"
    assert set(handler.operations or []) == set(configuration["webhooks"][0]["rules"][0]["operations"])


# -- the certificate ------------------------------------------------------------------------


def test_a_made_certificate_serves_the_service_name_the_api_server_dials(tmp_path: Path) -> None:
    """The API server dials <service>.<namespace>.svc and checks the chain against caBundle."""
    names = dns_names("diloco-webhook", "diloco-system")
    files = make(names, NOW - datetime.timedelta(days=1))
    for key, value in files.items():
        (tmp_path / key).write_bytes(value)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(tmp_path / n.TLS_CERT_KEY, tmp_path / n.TLS_KEY_KEY)
    client = ssl.create_default_context(cadata=files[n.CA_KEY].decode())
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def accept() -> None:
        conn, _ = listener.accept()
        with server.wrap_socket(conn, server_side=True) as tls:
            tls.sendall(b"ok")

    threading.Thread(target=accept, daemon=True).start()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            client.wrap_socket(raw, server_hostname="diloco-webhook.diloco-system.svc") as tls:
        assert tls.recv(2) == b"ok"
    listener.close()
    assert unfit(files, names, NOW) is None


def test_a_stored_certificate_that_no_longer_fits_is_named() -> None:
    names = dns_names("diloco-webhook", "diloco-system")
    files = make(names, NOW)
    assert "is not for other.diloco-system.svc" in (unfit(files, dns_names("other", "diloco-system"), NOW) or "")
    assert "expires at" in (unfit(files, names, NOW + datetime.timedelta(days=3650) - RENEW_BEFORE / 2) or "")
    assert "lacks tls.key" in (unfit({k: v for k, v in files.items() if k != n.TLS_KEY_KEY}, names, NOW) or "")


class Secrets:
    """The API server's create and get of Secrets, as far as prepare uses them: a create of a
    name that exists is a 409 (AlreadyExists). `hidden` gets answer 404 once each, as two
    replicas that both looked before either created see it."""

    def __init__(self, hidden: int = 0):
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.hidden = hidden
        self.requests: list[tuple[str, str]] = []
        self.configuration: dict[str, Any] = {"webhooks": [{"name": "decoupleddilocojobs.diloco.dev",
                                                            "clientConfig": {"service": {"name": "s"}}}]}

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.requests.append(("get", kind))
        if self.hidden:
            self.hidden -= 1
            return None
        return copy.deepcopy(self.objects.get((namespace, name)))

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.requests.append(("create", obj["kind"]))
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        if key in self.objects:
            raise ApiError(409, "AlreadyExists", "AlreadyExists")
        self.objects[key] = copy.deepcopy(obj)
        return obj

    def request(self, method: str, path: str, body: Any = None, **_: Any) -> dict[str, Any]:
        self.requests.append((method, path.rsplit("/", 1)[-1]))
        if method == "PATCH":  # a strategic merge of webhooks by name
            for patch in body["webhooks"]:
                (hook,) = [w for w in self.configuration["webhooks"] if w["name"] == patch["name"]]
                hook["clientConfig"].update(patch["clientConfig"])
        return copy.deepcopy(self.configuration)


def options(folder: Path) -> WebhookOptions:
    return WebhookOptions(cert_dir=str(folder), namespace="diloco-system", service="diloco-webhook",
                          secret="diloco-webhook-tls", configuration="diloco")


def test_replicas_share_one_stored_certificate_and_the_ca_is_written_once(tmp_path: Path) -> None:
    api = Secrets(hidden=2)  # the second replica looked before the first created: its create is a 409
    prepare(api, options(tmp_path / "a"), NOW)  # type: ignore[arg-type]
    prepare(api, options(tmp_path / "b"), NOW)  # type: ignore[arg-type]
    assert [r for r in api.requests if r[0] == "create"] == [("create", "Secret"), ("create", "Secret")]
    assert len(api.objects) == 1
    for key in (n.TLS_CERT_KEY, n.TLS_KEY_KEY, n.CA_KEY):
        assert (tmp_path / "a" / key).read_bytes() == (tmp_path / "b" / key).read_bytes()
    ca = (tmp_path / "a" / n.CA_KEY).read_bytes()
    assert api.configuration["webhooks"][0]["clientConfig"]["caBundle"] == base64.b64encode(ca).decode()
    assert [r for r in api.requests if r[0] == "PATCH"] == [("PATCH", "diloco")]  # the second found it written
    assert ca_patch(api.configuration, ca) is None


def test_a_stale_stored_certificate_stops_the_operator_with_the_fix(tmp_path: Path) -> None:
    api = Secrets()
    files = make(dns_names("renamed", "diloco-system"), NOW)
    api.objects[("diloco-system", "diloco-webhook-tls")] = {
        "data": {k: base64.b64encode(v).decode() for k, v in files.items()}}
    with pytest.raises(RuntimeError, match=r"Secret diloco-system/diloco-webhook-tls cannot serve .* is not for "
                                           r"diloco-webhook.diloco-system.svc .*kubectl -n diloco-system delete secret"):
        prepare(api, options(tmp_path), NOW)  # type: ignore[arg-type]


def test_with_cert_manager_the_mounted_files_must_be_there(tmp_path: Path) -> None:
    mounted = WebhookOptions(cert_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match=r"webhook\.certManager\.enabled"):
        prepare(Secrets(), mounted, NOW)  # type: ignore[arg-type]
    for key, value in make(["s.ns.svc"], NOW).items():
        (tmp_path / key).write_bytes(value)
    api = Secrets()
    prepare(api, mounted, NOW)  # type: ignore[arg-type]
    assert api.requests == []  # nothing made, nothing patched: cert-manager's CA injector writes the bundle


# -- the chart's values reach the operator ---------------------------------------------------


@pytest.mark.parametrize("cert_manager", [False, True], ids=["operator-made", "cert-manager"])
def test_the_charts_webhook_objects_and_the_operators_settings_agree(cert_manager: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    out = subprocess.run([str(tool("helm")), "template", "diloco", str(CHART), "--namespace", "diloco-system",
                          "--set", f"webhook.certManager.enabled={str(cert_manager).lower()}"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    (c,) = deploy["spec"]["template"]["spec"]["containers"]
    for item in c["env"]:
        monkeypatch.setenv(item["name"], item.get("value", "from-a-field"))
    got = Config.from_env().webhook
    assert got is not None
    (configuration,) = [d for d in docs if d["kind"] == "ValidatingWebhookConfiguration"]
    hook = configuration["webhooks"][0]
    (service,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == got.service]
    assert hook["clientConfig"]["service"]["name"] == got.service and got.namespace == "diloco-system"
    assert service["spec"]["ports"][0]["targetPort"] == "webhook"
    assert {"name": "webhook", "containerPort": got.port} in c["ports"]
    assert c["readinessProbe"] == {"tcpSocket": {"port": "webhook"}, "periodSeconds": 5}
    assert hook["sideEffects"] == "None" and hook["admissionReviewVersions"] == ["v1"] and hook["timeoutSeconds"] == 5
    assert hook["failurePolicy"] == "Fail"
    if cert_manager:
        (certificate,) = [d for d in docs if d["kind"] == "Certificate"]
        assert got.secret == "" and got.configuration == ""
        assert f"{got.service}.diloco-system.svc" in certificate["spec"]["dnsNames"]
        assert configuration["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == \
            f"diloco-system/{certificate['metadata']['name']}"
        (volume,) = [v for v in deploy["spec"]["template"]["spec"]["volumes"] if v["name"] == "webhook-tls"]
        assert volume["secret"]["secretName"] == certificate["spec"]["secretName"]
        assert {"name": "webhook-tls", "mountPath": got.cert_dir, "readOnly": True} in c["volumeMounts"]
    else:
        assert got.configuration == configuration["metadata"]["name"] and got.secret
        assert not [d for d in docs if d["kind"] in ("Certificate", "Issuer")]
        (role,) = [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-webhook")]
        assert role["rules"] == [{"apiGroups": ["admissionregistration.k8s.io"],
                                  "resources": ["validatingwebhookconfigurations"],
                                  "resourceNames": [got.configuration], "verbs": ["get", "patch"]}]


def test_with_watched_namespaces_the_webhook_asks_about_those_only() -> None:
    out = subprocess.run([str(tool("helm")), "template", "diloco", str(CHART), "--namespace", "diloco-system",
                          "--set", "watchNamespaces={ml,research}"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    (configuration,) = [d for d in docs if d["kind"] == "ValidatingWebhookConfiguration"]
    assert configuration["webhooks"][0]["namespaceSelector"] == {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["ml", "research"]}]}
    # The certificate's Secret lives in the release's namespace, which no watched namespace's Role covers.
    (role,) = [d for d in docs if d["kind"] == "Role" and d["metadata"]["namespace"] == "diloco-system"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
                             {"apiGroups": [""], "resources": ["secrets"],
                              "resourceNames": ["diloco-decoupled-diloco-webhook-tls"], "verbs": ["get"]}]
