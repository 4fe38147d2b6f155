"""The Helm chart: lints strictly, renders manifests the Kubernetes API accepts (two minor
versions a year apart), grants the operator exactly what it uses, and ships a dashboard
whose queries name metrics that exist. The operator's own children are validated too."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from diloco.operator.metrics import OperatorMetrics
from diloco.operator.render import job as render
from diloco.spec import load_job
from diloco.syncer.metrics import SyncerMetrics
from diloco.trainer.metrics import LearnerMetrics
from tests.kube.tools import tool

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "decoupled-diloco"
ALL_ON = ROOT / "tests" / "kube" / "values-all-on.yaml"
VERSIONS = ["1.30.0", "1.33.0"]  # April 2024 and April 2025
PROMETHEUS_OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor"}  # CRDs: no schema in kubernetes-validate
FULLNAME = "diloco-decoupled-diloco"  # the operator's (Cluster)Role; <fullname>-webhook is its webhook's
PEERING_KINDS = {"ClusterKopfPeering", "KopfPeering"}  # kopf's, from the chart's crds/: no schema either


def helm(*args: str) -> str:
    done = subprocess.run([str(tool("helm")), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr + done.stdout
    return done.stdout


def rendered(values: Path | None) -> list[dict[str, Any]]:
    extra = ["-f", str(values)] if values else []
    out = helm("template", "diloco", str(CHART), "--namespace", "diloco-system", "--include-crds", *extra)
    return [d for d in yaml.safe_load_all(out) if d]


def validate(doc: dict[str, Any], version: str) -> None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        assert doc["kind"] in PROMETHEUS_OPERATOR_KINDS | PEERING_KINDS, doc["kind"]


@pytest.mark.parametrize("values", [None, ALL_ON], ids=["default", "all-on"])
def test_helm_lint_strict(values: Path | None) -> None:
    helm("lint", "--strict", str(CHART), *(["-f", str(values)] if values else []))


@pytest.mark.parametrize("values", [None, ALL_ON], ids=["default", "all-on"])
@pytest.mark.slow
def test_rendered_chart_validates(values: Path | None) -> None:
    docs = rendered(values)
    kinds = {d["kind"] for d in docs}
    assert {"CustomResourceDefinition", "Deployment", "ServiceAccount", "Service", "ConfigMap"} <= kinds
    assert ({"Role", "RoleBinding", "ServiceMonitor", "PodMonitor"} <= kinds) == (values is not None)
    for version in VERSIONS:
        for doc in docs:
            validate(doc, version)
    if values is not None:  # the monitors point at what exists
        by_kind = {d["kind"]: d for d in docs}
        (service,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-metrics")]
        selected = by_kind["ServiceMonitor"]["spec"]["selector"]["matchLabels"]
        assert selected.items() <= service["metadata"]["labels"].items()
        assert by_kind["ServiceMonitor"]["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
        assert by_kind["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


def test_operator_deployment_is_locked_down() -> None:
    (deploy,) = [d for d in rendered(None) if d["kind"] == "Deployment"]
    spec = deploy["spec"]
    pod = spec["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] and c["securityContext"]["readOnlyRootFilesystem"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" and c["resources"]["requests"]


def test_operator_runs_two_peered_replicas_spread_over_nodes_with_a_disruption_budget() -> None:
    """Two replicas, one active through kopf's peering (no --standalone): the peering CRDs and
    object, RBAC for exactly kopf's use of it, the pod's name for its identity, anti-affinity,
    and a PodDisruptionBudget that keeps one through a drain; all valid for both versions."""
    docs = rendered(None)
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    spec, pod = deploy["spec"], deploy["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert spec["replicas"] == 2
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert c["command"] == ["diloco", "operator"] and "--standalone" not in c.get("args", [])
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["DILOCO_PEERING_LIFETIME_SECONDS"]["value"] == "10"
    (peering,) = [d for d in docs if d["kind"] == "ClusterKopfPeering"]
    assert peering["apiVersion"] == "kopf.dev/v1" and env["DILOCO_PEERING_NAME"]["value"] == peering["metadata"]["name"]
    crds = {d["metadata"]["name"]: d for d in docs if d["kind"] == "CustomResourceDefinition"}
    for name, scope in (("clusterkopfpeerings.kopf.dev", "Cluster"), ("kopfpeerings.kopf.dev", "Namespaced")):
        (version,) = crds[name]["spec"]["versions"]
        assert crds[name]["spec"]["scope"] == scope and version["name"] == "v1" and "subresources" not in version
        assert version["schema"]["openAPIV3Schema"]["properties"]["status"]["x-kubernetes-preserve-unknown-fields"]
    labels = pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    (term,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= pod_labels.items()
    (pdb,) = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for version in VERSIONS:
        for doc in (deploy, pdb):
            kubernetes_validate.validate(doc, version, strict=True)
    (role,) = [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "diloco-decoupled-diloco"]
    kopf_rules = [r for r in role["rules"] if r["apiGroups"] == ["kopf.dev"]]
    assert sorted((r["resources"], r["verbs"], r.get("resourceNames")) for r in kopf_rules) == [
        (["clusterkopfpeerings"], ["list", "watch"], None),
        (["clusterkopfpeerings"], ["patch"], [peering["metadata"]["name"]])]


def test_watched_namespaces_peer_in_each_and_one_replica_has_no_disruption_budget() -> None:
    out = helm("template", "diloco", str(CHART), "--namespace", "diloco-system", "--set", "watchNamespaces={ml,eu}",
               "--set", "replicas=1")
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert not [d for d in docs if d["kind"] in {"PodDisruptionBudget", "ClusterKopfPeering"}]
    assert sorted(d["metadata"]["namespace"] for d in docs if d["kind"] == "KopfPeering") == ["eu", "ml"]
    roles = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "diloco-decoupled-diloco"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["eu", "ml"]
    for role in roles:
        assert {r for rule in role["rules"] if rule["apiGroups"] == ["kopf.dev"] for r in rule["resources"]} == \
            {"kopfpeerings"}
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    assert deploy["spec"]["replicas"] == 1


@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_operator_children_validate(example: Path) -> None:
    """What the operator creates for every example is valid for both Kubernetes versions."""
    job = load_job(str(example))
    owner = render.Owner(job.metadata.name, "research", "0f5a1f4e-0000-4000-8000-000000000000")
    for doc in render.children(job, owner, "t" * 43, started=True, finished=False):
        for version in VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_rbac_grants_what_the_operator_uses_and_no_wildcards() -> None:
    (role,) = [d for d in rendered(None) if d["kind"] == "ClusterRole" and d["metadata"]["name"] == FULLNAME]
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    assert not [x for x in granted if "*" in x]
    needed = {("diloco.dev", "decoupleddilocojobs", v) for v in ("get", "list", "watch", "patch", "delete")}
    needed |= {("diloco.dev", "decoupleddilocojobs/status", "patch"), ("", "events", "create"),
               ("", "pods", "watch"), ("", "pods", "delete"), ("", "pods", "patch")}
    for group, plural in (("apps", "statefulsets"), ("apps", "deployments"), ("", "services"),
                          ("policy", "poddisruptionbudgets")):
        needed |= {(group, plural, v) for v in ("list", "create", "patch", "delete")}
    for group, plural in (("", "configmaps"), ("", "persistentvolumeclaims"), ("networking.k8s.io", "networkpolicies")):
        needed |= {(group, plural, v) for v in ("list", "create", "patch")}
    needed |= {("", "secrets", v) for v in ("get", "create", "patch")}
    assert needed <= granted, needed - granted
    # Secrets are read by name only: a list would hand the operator every Secret in the namespace.
    assert not {v for g, r, v in granted if r == "secrets"} & {"list", "watch"}
    # Every kind the operator manages is granted (children.sync lists, applies and deletes them).
    from diloco.operator.kube import KINDS
    from diloco.operator.reconcile.children import GATEWAY_KINDS, MANAGED_KINDS

    plurals = {r for _, r, _ in granted}
    assert {KINDS[k][1] for k in MANAGED_KINDS} <= plurals and not {KINDS[k][1] for k in GATEWAY_KINDS} & plurals
    assert not {x for x in granted if x[1] in {"namespaces", "customresourcedefinitions", "nodes"}}


def with_sets(*sets: str) -> list[dict[str, Any]]:
    out = helm("template", "diloco", str(CHART), "--namespace", "diloco-system", *[a for x in sets for a in ("--set", x)])
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.mark.parametrize(("sets", "watched"), [
    (["watchNamespaces={ml,research}"], ["ml", "research"]),
    (["watchNamespaces={ml}", "watchNamespace=research"], ["ml", "research"]),  # the older key adds up
    (["watchNamespaces={research,ml}", "watchNamespace=ml"], ["research", "ml"]),  # once each
    (["watchNamespace=research"], ["research"]),
], ids=["list", "list-and-one", "repeated", "one"])
@pytest.mark.slow
def test_watched_namespaces_get_a_role_each_and_no_cluster_role(sets: list[str], watched: list[str]) -> None:
    """Namespaced RBAC: the operator's rules as a Role and RoleBinding in each watched namespace,
    nothing cluster-wide, and the operator told the same namespaces."""
    from diloco.operator.main import namespaces

    (cluster_role,) = [d for d in rendered(None) if d["kind"] == "ClusterRole" and d["metadata"]["name"] == FULLNAME]
    cluster_wide = cluster_role["rules"]
    docs = with_sets(*sets, "metrics.podMonitor.enabled=true")
    # Cluster-wide only the admission webhook's configuration, by name (tests/operator/admission/test_webhook.py).
    assert [d["metadata"]["name"] for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")] == \
        [f"{FULLNAME}-webhook"] * 2
    roles = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == FULLNAME}
    bindings = {d["metadata"]["namespace"]: d for d in docs
                if d["kind"] == "RoleBinding" and d["metadata"]["name"] == FULLNAME}
    assert set(roles) == set(bindings) == set(watched)
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    sa = deploy["spec"]["template"]["spec"]["serviceAccountName"]
    for ns in watched:
        # The same rules, held in that namespace only; kopf's peering object is the namespace's
        # KopfPeering there instead of the ClusterKopfPeering.
        peering = [r for r in roles[ns]["rules"] if r["apiGroups"] == ["kopf.dev"]]
        assert [r for r in roles[ns]["rules"] if r not in peering] == [r for r in cluster_wide
                                                                         if r["apiGroups"] != ["kopf.dev"]]
        assert [r["resources"] for r in peering] == [["kopfpeerings"]] * 2
        assert bindings[ns]["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                           "name": roles[ns]["metadata"]["name"]}
        assert bindings[ns]["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": "diloco-system"}]
    (c,) = deploy["spec"]["template"]["spec"]["containers"]
    assert c["args"] == [a for ns in watched for a in ("--namespace", ns)]
    assert namespaces(c["args"][1::2]) == watched  # what the operator makes of them
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": watched}  # scrapes where jobs run
    for version in VERSIONS:
        for doc in docs:
            validate(doc, version)


def test_the_whole_cluster_is_one_cluster_role_and_no_namespace_flag() -> None:
    docs = with_sets("metrics.podMonitor.enabled=true")
    assert {d["kind"] for d in docs if "Role" in d["kind"]} == {"ClusterRole", "ClusterRoleBinding"}
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    assert "args" not in deploy["spec"]["template"]["spec"]["containers"][0]
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    assert monitor["spec"]["namespaceSelector"] == {"any": True}


def test_the_operator_refuses_a_namespace_pattern_naming_the_flag() -> None:
    from diloco.operator.main import namespaces

    assert namespaces(None) == [] and namespaces(["ml", "ml", "eu"]) == ["ml", "eu"]
    with pytest.raises(ValueError, match=r"--namespace 'team-\*' is not a namespace name.*no patterns"):
        namespaces(["ml", "team-*"])


def notes(tmp_path: Path, *sets: str) -> str:
    """NOTES.txt as `helm install` prints it (`helm template` skips it, and `install --dry-run`
    needs a cluster): a copy of the chart renders it as a named template inside a ConfigMap."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    text = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "_notes.tpl").write_text('{{- define "notes" -}}\n' + text + "{{- end -}}\n")
    (chart / "templates" / "notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\ndata:\n  notes: {{ include \"notes\" . | toJson }}\n")
    out = helm("template", "diloco", str(chart), "--namespace", "diloco-system", "--show-only", "templates/notes.yaml",
               *[a for x in sets for a in ("--set", x)])
    return str(yaml.safe_load(out)["data"]["notes"])


@pytest.mark.parametrize(("sets", "namespace", "flags"), [
    ([], "default", " --no-kueue"),
    (["watchNamespaces={ml,research}", "kueue.enabled=true", "syncerExposure.gatewayAPI=true"], "ml", " --gateway-api"),
], ids=["default", "namespaced"])
def test_notes_start_a_job_a_chart_user_can_apply(tmp_path: Path, sets: list[str], namespace: str, flags: str) -> None:
    """NOTES.txt points at nothing outside the chart: its inline job passes the operator's
    admission checks (and the CRD's schema), in a namespace the operator watches."""
    from diloco.operator.admission import checks as spec_checks
    from diloco.spec import parse_job
    from tests.operator.test_crd import validator

    text = notes(tmp_path, *sets)
    assert "examples/" not in text
    assert f"kubectl apply -n {namespace} -f - <<'EOF'" in text and f"kubectl get ddj -n {namespace} -w" in text
    manifest = yaml.safe_load(re.search(r"<<'EOF'\n(.*?)\n\s*EOF\n", text, re.S).group(1))  # type: ignore[union-attr]
    job = parse_job(manifest)
    assert spec_checks.problems(job, gateway_api=False, kueue_enabled=True) == []
    assert job.spec.training.steps is not None  # it ends by itself (Succeeded/StepsReached)
    validator().validate(manifest)  # as `kubectl apply --validate=strict` checks it
    assert f"-- diloco validate /dev/stdin{flags} < job.yaml" in text
    assert "deploy/diloco-decoupled-diloco" in text


def known_metrics() -> set[str]:
    names: set[str] = set()
    for registry in (SyncerMetrics().registry, LearnerMetrics("l", "r", None).registry,
                     OperatorMetrics().registry):
        for family in registry.collect():
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
            names |= {family.name + s for s in suffixes}
    return names


def dashboard_exprs() -> list[str]:
    board = json.loads((CHART / "files" / "dashboard.json").read_text())
    return [t["expr"] for p in board["panels"] for t in p["targets"]]


def test_alert_rules_name_metrics_that_exist() -> None:
    """Every series an alert or recording rule reads is one our code exports (or Prometheus's
    `up`): a metric renamed in the code fails here, not as an alert that never fires."""
    groups = yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text())["groups"]
    exprs = [r["expr"] for g in groups for r in g["rules"]]
    labels = {"diloco_job", "diloco_namespace", "diloco_component", "diloco_group"}  # in `by (...)`
    used = {m for e in exprs for m in re.findall(r"\bdiloco_[a-z_]+(?=[{\[)])", e)} - labels
    assert {"diloco_job_phase", "diloco_job_unschedulable_seconds", "diloco_operator_reconciles_total",
            "diloco_operator_child_writes_refused_total"} <= used
    assert used <= known_metrics(), used - known_metrics()


def test_the_service_monitor_labels_the_operator_as_operator_down_selects_it() -> None:
    groups = yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text())["groups"]
    (down,) = [r["expr"] for g in groups for r in g["rules"] if r.get("alert") == "OperatorDown"]
    assert ('sum by (namespace) (up{diloco_component="operator"}) == 0' in down
            and 'absent(up{diloco_component="operator"})' in down)
    (monitor,) = [d for d in with_sets("metrics.serviceMonitor.enabled=true") if d["kind"] == "ServiceMonitor"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert {"targetLabel": "diloco_component", "replacement": "operator"} in endpoint["relabelings"]


def test_dashboard_queries_name_metrics_that_exist() -> None:
    exprs = dashboard_exprs()
    used = {m for e in exprs for m in re.findall(r"\bdiloco_[a-z_]+(?=[{\[( ])", e)}
    assert used and used <= known_metrics(), used - known_metrics()
    text = " ".join(exprs)
    for panel_metric in ("goodput", "active_learners", "merges_total", "quorum_size", "grace_wait",
                         "bytes_total", "learner_loss", "staleness"):
        assert panel_metric in text, panel_metric
    (dash,) = [d for d in rendered(None) if d["kind"] == "ConfigMap"]
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dash["data"]["decoupled-diloco.json"])["uid"] == "decoupled-diloco"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus) not installed")
def test_dashboard_queries_parse_as_promql(tmp_path: Path) -> None:
    rules = [{"record": f"diloco:panel_{i}", "expr": e.replace("$namespace", ".*").replace("$job", ".*")}
             for i, e in enumerate(dashboard_exprs())]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_syncer_exposure_values_reach_the_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chart's syncerExposure becomes the operator's Config, and RBAC for GRPCRoutes only when asked."""
    from diloco.operator.context import Config

    for values, gateway in ((None, False), (ALL_ON, True)):
        docs = rendered(values)
        (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
        for item in deploy["spec"]["template"]["spec"]["containers"][0]["env"]:
            if "value" in item:  # not POD_NAME's valueFrom (the downward API)
                monkeypatch.setenv(item["name"], item["value"])
        config = Config.from_env()
        assert config.gateway_api is gateway and ("GRPCRoute" in config.managed_kinds) is gateway
        assert config.expose_annotations == yaml.safe_load(ALL_ON.read_text())["syncerExposure"]["annotations"] \
            if gateway else config.expose_annotations == {}
        (role,) = [d for d in docs if d["kind"] in ("Role", "ClusterRole") and not d["metadata"]["name"].endswith(
            ("-kueue", "-webhook"))]
        assert any("grpcroutes" in rule["resources"] for rule in role["rules"]) is gateway


def test_the_operators_whereabouts_reach_each_jobs_network_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The syncer's NetworkPolicy admits the operator's pod as the chart labels it, in its namespace."""
    from diloco.operator.context import Config
    from diloco.operator.render.policies import operator_peer

    for values in (None, ALL_ON):
        docs = rendered(values)
        (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
        for item in deploy["spec"]["template"]["spec"]["containers"][0]["env"]:
            if "value" in item:  # not POD_NAME's valueFrom (the downward API)
                monkeypatch.setenv(item["name"], item["value"])
        peers = Config.from_env().peers
        peer = operator_peer(peers)
        assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "diloco-system"}}
        assert peer["podSelector"]["matchLabels"].items() <= deploy["spec"]["template"]["metadata"]["labels"].items()
        assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "diloco"
        expected = (yaml.safe_load(ALL_ON.read_text())["jobNetworkPolicy"]["metricsFrom"] if values
                    else [{"namespaceSelector": {}}])
        assert list(peers.metrics_from) == expected


def test_extra_env_reaches_the_operator_after_the_charts_own_and_cannot_replace_it(tmp_path: Path) -> None:
    values = tmp_path / "env.yaml"
    extra = [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"},
             {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    values.write_text(yaml.safe_dump({"extraEnv": extra}))
    (deploy,) = [d for d in rendered(values) if d["kind"] == "Deployment"]
    env = deploy["spec"]["template"]["spec"]["containers"][0]["env"]
    assert env[-2:] == extra and {e["name"] for e in env[:-2]} >= {"DILOCO_KUEUE", "HOME"}
    for version in VERSIONS:
        validate(deploy, version)
    values.write_text(yaml.safe_dump({"extraEnv": [{"name": "DILOCO_KUEUE", "value": "true"}]}))
    done = subprocess.run([str(tool("helm")), "template", "diloco", str(CHART), "-f", str(values)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and "extraEnv[0].name: DILOCO_KUEUE is set by the chart" in done.stderr


def test_kueue_gets_a_cluster_role_that_reads_flavors_and_priority_classes_whatever_is_watched() -> None:
    for sets in ([], ["watchNamespaces={ml,research}"]):
        docs = with_sets("kueue.enabled=true", *sets)
        (reader,) = [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-kueue")]
        assert {(g, r, v) for rule in reader["rules"] for g in rule["apiGroups"] for r in rule["resources"]
                for v in rule["verbs"]} == {("kueue.x-k8s.io", "resourceflavors", "get"),
                                             ("kueue.x-k8s.io", "workloadpriorityclasses", "get"),
                                             ("scheduling.k8s.io", "priorityclasses", "get")}
        (binding,) = [d for d in docs if d["kind"] == "ClusterRoleBinding" and d["roleRef"]["name"] ==
                      reader["metadata"]["name"]]
        assert binding["subjects"][0]["namespace"] == "diloco-system"
        others = [d for d in docs if d["kind"] in ("Role", "ClusterRole") and d is not reader
                  and not d["metadata"]["name"].endswith("-webhook")]
        assert [d["kind"] for d in others] == (["ClusterRole"] if not sets else ["Role", "Role"])
    assert not [d for d in with_sets() if d["metadata"]["name"].endswith("-kueue")]
