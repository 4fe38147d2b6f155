"""The chart's extras (issue 13): values.schema.json, the PrometheusRule, the opt-in CRD-upgrade
hook with `diloco crd --apply`, and the `helm test` pod.

The schema is checked both ways: helm refuses bad and misspelt values naming the key, and the
schema and values.yaml describe the same keys (so they cannot drift). The PrometheusRule holds
exactly the groups of files/prometheus-rules.yaml. The CRD-upgrade hook's RBAC is shown to be
enough, and no more, on a real 1.20 API server (the `realapi` test at the end).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from diloco.operator import crd
from tests.kube.tools import tool

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "decoupled-diloco"
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
ALL_ON = ROOT / "tests" / "kube" / "values-all-on.yaml"
RULES = CHART / "files" / "prometheus-rules.yaml"
VERSIONS = ["1.30.0", "1.33.0"]  # as tests/charts/test_chart.py
HOOK = "pre-install,pre-upgrade"


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(tool("helm")), *args], capture_output=True, text=True, timeout=120)
    if check:
        assert done.returncode == 0, done.stderr + done.stdout
    return done


def rendered(*sets: str) -> list[dict[str, Any]]:
    args = [a for s in sets for a in ("--set", s)]
    out = helm("template", "diloco", str(CHART), "--namespace", "diloco-system", *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def one(docs: list[dict[str, Any]], kind: str, suffix: str = "") -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    return doc


# ---------------------------------------------------------------------------------------
# values.schema.json
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("sets", [[], ["crds.upgrade=true", "metrics.prometheusRule.enabled=true",
                                       "metrics.prometheusRule.labels.release=kube-prometheus-stack"],
                                  ["watchNamespaces={ml,research}", "metrics.podMonitor.enabled=true"]],
                         ids=["default", "extras-on", "namespaced"])
def test_helm_lint_strict_passes(sets: list[str]) -> None:
    helm("lint", "--strict", str(CHART), *[a for s in sets for a in ("--set", s)])


@pytest.mark.parametrize(("value", "named"), [
    ("operator.statusIntervalSeconds=abc", "/operator/statusIntervalSeconds"),
    ("operator.statusIntervalSeconds=0", "/operator/statusIntervalSeconds"),
    ("operator.logLevel=info", "/operator/logLevel"),
    ("image.pullPolicy=always", "/image/pullPolicy"),
    ("ports.metrics=70000", "/ports/metrics"),
    ("metrics.serviceMonitor.interval=30", "/metrics/serviceMonitor/interval"),
    ("crds.upgrade=yes", "/crds/upgrade"),
    ("watchNamespace=Research", "/watchNamespace"),
    ("watchNamespaces={ml,Research}", "/watchNamespaces/1"),
    ("podAnnotations.team=true", "/podAnnotations/team"),
    ("jobNetworkPolicy.metricsFrom[0].namespaceselector.x=y", "namespaceselector"),
    ("operator.statusIntervalSecond=5", "statusIntervalSecond"),  # misspelt keys
    ("metrics.prometheusRule.enable=true", "enable"),
    ("crd.upgrade=true", "crd"),
], ids=lambda v: v if "=" in v else "")
def test_helm_refuses_bad_values_naming_the_key(value: str, named: str) -> None:
    done = helm("template", "diloco", str(CHART), "--set", value, check=False)
    assert done.returncode != 0, f"--set {value} rendered"
    assert "values don't meet the specifications of the schema" in done.stderr, done.stderr
    assert named in done.stderr, done.stderr


def test_helm_accepts_what_values_yaml_documents() -> None:
    """The all-on values tests/charts/test_chart.py uses, and what `--set` makes of values.yaml's examples
    (2.5 and 1 arrive as a string and an integer)."""
    helm("template", "diloco", str(CHART), "-f", str(ALL_ON), "--set", "operator.statusIntervalSeconds=2.5",
         "--set", "dashboard.labelValue=1", "--set", "image.tag=0.2.0", "--set", "imagePullSecrets[0].name=regcred",
         "--set-json", "jobNetworkPolicy.metricsFrom=[]", "--set", "metrics.podMonitor.namespaces={research,eu}")


def schema_keys(node: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    for key, sub in node.get("properties", {}).items():
        yield prefix + key, sub
        yield from schema_keys(sub, f"{prefix}{key}.")


def values_keys(node: Any, schema: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """Keys of values.yaml, descending into maps the schema names key by key (not free maps like labels)."""
    for key, sub in node.items():
        yield prefix + key
        inner = schema.get("properties", {}).get(key, {})
        if isinstance(sub, dict) and "properties" in inner:
            yield from values_keys(sub, inner, f"{prefix}{key}.")


def test_schema_and_values_yaml_describe_the_same_keys() -> None:
    described = dict(schema_keys(SCHEMA))
    in_values = set(values_keys(VALUES, SCHEMA))
    assert in_values - described.keys() == set(), "keys of values.yaml missing from values.schema.json"
    assert described.keys() - in_values - {"global"} == set(), "keys of values.schema.json that values.yaml lacks"
    undocumented = [k for k in in_values if not described[k].get("description")]
    assert not undocumented, undocumented
    closed = [k for k, v in described.items() if "properties" in v and v.get("additionalProperties") is not False
              and k in in_values]
    assert not closed, f"objects that would let a misspelt key through: {closed}"
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    validator = jsonschema.Draft7Validator(SCHEMA)
    for values in (VALUES, yaml.safe_load(ALL_ON.read_text())):
        assert not list(validator.iter_errors(values))


# ---------------------------------------------------------------------------------------
# The PrometheusRule
# ---------------------------------------------------------------------------------------


def test_prometheus_rule_holds_the_rule_file(tmp_path: Path) -> None:
    assert not [d for d in rendered() if d["kind"] == "PrometheusRule"], "on by default"
    rule = one(rendered("metrics.prometheusRule.enabled=true", "metrics.prometheusRule.labels.release=kps"),
               "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "diloco-system" and rule["metadata"]["labels"]["release"] == "kps"
    source = yaml.safe_load(RULES.read_text())
    assert rule["spec"] == {"groups": source["groups"]}
    template = (CHART / "templates" / "prometheusrule.yaml").read_text()
    assert '.Files.Get "files/prometheus-rules.yaml"' in template and "expr:" not in template  # read, not copied
    annotations = [r["annotations"] for g in rule["spec"]["groups"] for r in g["rules"] if "annotations" in r]
    assert any("{{ $labels.diloco_job }}" in a["summary"] for a in annotations)  # not eaten by Helm
    if shutil.which("promtool"):  # what Prometheus will load (the Operator writes spec as a rule file)
        path = tmp_path / "rules.yaml"
        path.write_text(yaml.safe_dump(rule["spec"]))
        done = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


# ---------------------------------------------------------------------------------------
# The CRD-upgrade hook and `diloco crd --apply`
# ---------------------------------------------------------------------------------------


def test_crd_upgrade_hook_is_off_by_default() -> None:
    docs = rendered()
    assert not [d for d in docs if "crd-upgrade" in d["metadata"]["name"] or d["kind"] == "Job"]
    assert "customresourcedefinitions" not in json.dumps([d for d in docs if d["kind"].endswith("Role")])


@pytest.mark.parametrize("watch", ["", "research"], ids=["cluster", "one-namespace"])
def test_crd_upgrade_hook_holds_only_its_own_rights(watch: str) -> None:
    docs = rendered("crds.upgrade=true", f"watchNamespace={watch}")
    sa, role, binding, job = (one(docs, k, "-crd-upgrade") for k in
                              ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Job"))
    for doc in (sa, role, binding, job):
        notes = doc["metadata"]["annotations"]
        assert notes["helm.sh/hook"] == HOOK
        assert set(notes["helm.sh/hook-delete-policy"].split(",")) == {"before-hook-creation", "hook-succeeded"}
        for version in VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
    weight = {d["kind"]: int(d["metadata"]["annotations"]["helm.sh/hook-weight"]) for d in (sa, role, binding, job)}
    assert max(weight["ServiceAccount"], weight["ClusterRole"]) < weight["ClusterRoleBinding"] < weight["Job"]
    assert role["rules"] == [{"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
                              "resourceNames": [crd.CRD_NAME], "verbs": ["create", "patch"]}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": "diloco-system"}]
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"] and c["command"] == ["diloco", "crd", "--apply"]
    assert c["image"] == one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
    assert pod["securityContext"]["runAsNonRoot"] and c["securityContext"]["readOnlyRootFilesystem"]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    # The operator's own ServiceAccount gains nothing, and its Service does not select the hook's pod.
    operator_sa = one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    operator_roles = [d for d in docs if d["kind"].endswith("Role") and "crd-upgrade" not in d["metadata"]["name"]]
    assert operator_roles and "customresourcedefinitions" not in json.dumps(operator_roles)
    assert operator_sa != sa["metadata"]["name"]
    assert sorted(b["roleRef"]["name"] for b in docs if b["kind"].endswith("Binding")
                  and any(s["name"] == operator_sa for s in b["subjects"])) == \
        sorted(r["metadata"]["name"] for r in operator_roles)  # its own rules and its webhook's
    selector = one(docs, "Service", "-metrics")["spec"]["selector"]
    assert not selector.items() <= job["spec"]["template"]["metadata"]["labels"].items()


def test_helm_show_crds_gives_the_crd_docs_kubernetes_md_applies() -> None:
    """The manual path (docs/KUBERNETES.md, "Install"): `helm show crds` prints the chart's CRD, the
    generated one, and kopf's two peering CRDs the operator's replicas share."""
    shown = [d for d in yaml.safe_load_all(helm("show", "crds", str(CHART)).stdout) if d]
    assert [d for d in shown if d["spec"]["group"] != "kopf.dev"] == [crd.crd()]
    assert sorted(d["metadata"]["name"] for d in shown if d["spec"]["group"] == "kopf.dev") == [
        "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"]


class FakeKube:
    def __init__(self, minor: str):
        self.minor, self.calls = minor, []

    def request(self, method: str, path: str, body: Any = None, params: Any = None, content_type: str = "") -> Any:
        self.calls.append((method, path, body, params, content_type))
        if path == "version":
            return {"major": "1", "minor": self.minor}
        return {"metadata": {"resourceVersion": "7"}}


@pytest.mark.parametrize(("minor", "no_cel", "cel"), [("20", False, False), ("22", False, False), ("23", False, True),
                                                      ("28+", False, True), ("30", True, False)])
def test_crd_apply_is_a_forced_server_side_apply(minor: str, no_cel: bool, cel: bool,
                                                 monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from diloco.operator import kube

    fake = FakeKube(minor)
    monkeypatch.setattr(kube.Kube, "connect", classmethod(lambda cls: fake))
    from diloco.apps.cli import main as cli

    assert cli(["crd", "--apply", *(["--no-cel"] if no_cel else [])]) == 0
    method, path, body, params, ctype = fake.calls[-1]
    assert (method, path) == ("PATCH", f"apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd.CRD_NAME}")
    assert params == {"fieldManager": "diloco-crd", "force": "true"} and ctype == kube.APPLY_PATCH
    assert body == crd.crd(cel=cel)
    assert f"CEL rules {'on' if cel else 'off'}" in capsys.readouterr().out


def test_crd_apply_reports_a_refusal(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from diloco.operator import kube

    class Refusing(FakeKube):
        def request(self, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
            if method == "PATCH":
                raise kube.ApiError(403, f"{method} {path}: forbidden")
            return super().request(method, path, *args, **kwargs)

    monkeypatch.setattr(kube.Kube, "connect", classmethod(lambda cls: Refusing("30")))
    from diloco.apps.cli import main as cli

    assert cli(["crd", "--apply"]) == 1
    assert "HTTP 403" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# `helm test`
# ---------------------------------------------------------------------------------------


def test_connection_pod_is_a_locked_down_test_hook() -> None:
    docs = rendered()
    pod = one(docs, "Pod", "-test-connection")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    for version in VERSIONS:
        kubernetes_validate.validate(pod, version, strict=True)
    spec = pod["spec"]
    (c,) = spec["containers"]
    assert spec["automountServiceAccountToken"] is False and "serviceAccountName" not in spec
    assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] != 0
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert c["image"] == one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
    service = one(docs, "Service", "-metrics")
    url = c["args"][1]
    port = service["spec"]["ports"][0]["port"]
    assert url == f"http://{service['metadata']['name']}.diloco-system.svc:{port}/metrics"
    assert not service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()


class _Metrics(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize("operator", [True, False], ids=["operator-metrics", "other-metrics"])
@pytest.mark.slow
def test_connection_pod_script_passes_on_operator_metrics_only(operator: bool) -> None:
    """The pod's own script, run here against a server with the operator's metrics (or others)."""
    from prometheus_client import generate_latest

    from diloco.operator.metrics import OperatorMetrics

    (c,) = one(rendered(), "Pod", "-test-connection")["spec"]["containers"]
    handler = type("H", (_Metrics,), {"body": generate_latest(OperatorMetrics().registry) if operator
                                      else b"# TYPE up gauge\nup 1\n"})
    server = HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        done = subprocess.run([sys.executable, "-P", *c["command"][1:], c["args"][0], url, "1"],
                              capture_output=True, text=True, timeout=30)
    finally:
        server.shutdown()
        server.server_close()
    assert (done.returncode == 0) is operator, done.stdout + done.stderr
    assert ("the operator serves its metrics" in done.stdout) is operator


# ---------------------------------------------------------------------------------------
# The hook's RBAC against a real API server
# ---------------------------------------------------------------------------------------


@pytest.mark.realapi
@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_crd_upgrade_hook_rbac_on_a_real_api_server(tmp_path: Path) -> None:
    """The hook's ServiceAccount, as the chart renders it, runs `diloco crd --apply` on a real 1.20
    API server: it creates the CRD when missing and upgrades it when stale (a server before 1.23,
    so without CEL rules), and may do nothing else."""
    import base64

    from diloco.operator.kube import MERGE_PATCH, ApiError, Kube
    from tests.helpers import wait_for
    from tests.realapi.controlplane import ControlPlane

    docs = rendered("crds.upgrade=true")
    rbac = [d for d in docs if "crd-upgrade" in d["metadata"]["name"] and d["kind"] != "Job"]
    sa_name = one(docs, "ServiceAccount", "-crd-upgrade")["metadata"]["name"]
    with ControlPlane(tmp_path / "control-plane") as plane:
        admin = Kube(plane.url, token=plane.admin_token, ca_file=str(plane.ca_file), user_agent="diloco-tests")
        admin.request("POST", "api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                    "metadata": {"name": "diloco-system"}})
        for doc in rbac:
            doc["metadata"].pop("annotations")  # helm's hook annotations mean nothing to the server
            group = doc["apiVersion"]
            prefix = f"apis/{group}" if "/" in group else f"api/{group}"
            plural = {"ServiceAccount": "serviceaccounts", "ClusterRole": "clusterroles",
                      "ClusterRoleBinding": "clusterrolebindings"}[doc["kind"]]
            ns = f"namespaces/{doc['metadata']['namespace']}/" if "namespace" in doc["metadata"] else ""
            admin.request("POST", f"{prefix}/{ns}{plural}", doc)

        def minted() -> str | None:
            for s in admin.request("GET", "api/v1/namespaces/diloco-system/secrets").get("items") or []:
                if (s.get("type") == "kubernetes.io/service-account-token" and s.get("data", {}).get("token")
                        and s["metadata"]["annotations"].get("kubernetes.io/service-account.name") == sa_name):
                    return base64.b64decode(s["data"]["token"]).decode()
            return None

        token = wait_for(minted, timeout=30, what="the hook ServiceAccount's token")
        env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
        env["KUBECONFIG"] = str(plane.kubeconfig(tmp_path / "hook.kubeconfig", token, "hook"))

        def diloco_crd_apply() -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-P", "-m", "diloco.apps.cli", "crd", "--apply"], capture_output=True,
                                  text=True, timeout=60, cwd=ROOT / "tests", env=env)

        path = f"apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd.CRD_NAME}"
        assert admin.request("GET", "apis/apiextensions.k8s.io/v1/customresourcedefinitions")["items"] == []
        done = diloco_crd_apply()  # missing: an apply that creates
        assert done.returncode == 0, done.stderr
        assert "CEL rules off" in done.stdout
        created = admin.request("GET", path)
        assert created["spec"]["names"]["shortNames"] == crd.SHORT_NAMES

        # Stale, as an older chart's crds/ left it (written by another manager, as Helm does).
        stale = copy.deepcopy(crd.crd(cel=False))  # crd() shares PRINTER_COLUMNS
        stale["spec"]["names"]["shortNames"] = ["old"]
        del stale["spec"]["versions"][0]["additionalPrinterColumns"][-1]

        def make_stale() -> None:
            """Write `stale` over the CRD as Helm does: a merge patch, which carries no
            resourceVersion. (A PUT must carry one, and the API server's own CRD controllers
            write the CRD's status and finalizers on their own schedule after every change:
            CI once lost that race with a 409. There is no version here to go stale.)"""
            admin.request("PATCH", path, {"spec": {"names": stale["spec"]["names"], "versions": stale["spec"]["versions"]}},
                          params={"fieldManager": "helm"}, content_type=MERGE_PATCH)
            assert admin.request("GET", path)["spec"]["names"]["shortNames"] == ["old"]

        make_stale()
        done = diloco_crd_apply()
        assert done.returncode == 0, done.stderr
        upgraded = admin.request("GET", path)
        assert upgraded["spec"]["names"]["shortNames"] == crd.SHORT_NAMES
        columns = upgraded["spec"]["versions"][0]["additionalPrinterColumns"]
        assert [c["name"] for c in columns] == [c["name"] for c in crd.PRINTER_COLUMNS]

        # The manual path for servers before 1.23 (docs/KUBERNETES.md), over a stale CRD.
        make_stale()
        admin_env = {**env, "KUBECONFIG": str(plane.kubeconfig(tmp_path / "admin.kubeconfig", plane.admin_token))}
        printed = subprocess.run([sys.executable, "-P", "-m", "diloco.apps.cli", "crd", "--no-cel"], capture_output=True,
                                 text=True, timeout=60, cwd=ROOT / "tests", check=True).stdout
        done = subprocess.run([str(tool("kubectl")), "apply", "--server-side", "--force-conflicts", "-f", "-"],
                              input=printed, capture_output=True, text=True, timeout=60, env=admin_env)
        assert done.returncode == 0, done.stderr
        assert admin.request("GET", path)["spec"]["names"]["shortNames"] == crd.SHORT_NAMES

        # Nothing else: not another CRD, not a read, not the operator's objects.
        hook = Kube(plane.url, token=token, ca_file=str(plane.ca_file), user_agent="diloco-tests")
        other = copy.deepcopy(crd.crd(cel=False))
        other["metadata"]["name"] = "others.diloco.dev"
        other["spec"]["names"] = {"plural": "others", "singular": "other", "kind": "Other", "listKind": "OtherList"}
        for method, where, body in (("POST", "apis/apiextensions.k8s.io/v1/customresourcedefinitions", other),
                                    ("GET", path, None), ("DELETE", path, None),
                                    ("GET", "apis/apiextensions.k8s.io/v1/customresourcedefinitions", None),
                                    ("GET", "api/v1/namespaces/diloco-system/secrets", None)):
            with pytest.raises(ApiError) as refused:
                hook.request(method, where, body)
            assert refused.value.status == 403, (method, where)
