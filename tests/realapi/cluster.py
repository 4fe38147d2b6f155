"""The whole real-control-plane fixture: API server and controllers, a kubelet, the chart
installed with helm, and the operator running with exactly the chart's ServiceAccount.

The chart's own operator Deployment is installed too (the server validates it), but pinned by
a nodeSelector to no node: the operator instead runs in this process (tests/kube/running.py),
logged in through a kubeconfig that holds the ServiceAccount's token, so every request it makes
is authorised by the chart's RBAC and nothing else, while the test can map Service names to
local ports for it (pods run as local processes).
"""

from __future__ import annotations

import base64
import subprocess
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from diloco.operator.context import Config
from diloco.operator.kube import Kube
from diloco.operator.peering import Peering
from diloco.operator.render import naming as n
from tests.helpers import wait_for
from tests.kube.processes import ProcessRuntime
from tests.kube.running import OperatorThread
from tests.kube.tools import tool
from tests.realapi import admission, kueue_crds, webhook
from tests.realapi.controlplane import ROOT, ControlPlane
from tests.realapi.kubelet import Kubelet

RELEASE, SYSTEM, JOBS = "diloco", "diloco-system", "jobs"
# Our CRD as the chart installs it: `diloco crd`, CEL rules included (the 1.20 server drops them;
# the lane's CEL gate, tests/realapi/admission.py, enforces them from this file).
OUR_CRDS = ROOT / "charts" / "decoupled-diloco" / "crds" / "decoupleddilocojobs.diloco.dev.yaml"
# Kueue's default flavor (no node labels, no tolerations): the stand-in Kueues assign it.
DEFAULT_FLAVOR = "default-flavor"
SERVICE_ACCOUNT = f"system:serviceaccount:{SYSTEM}:{RELEASE}-decoupled-diloco"
PEERING = f"{RELEASE}-decoupled-diloco"  # the chart's peering object (templates/peering.yaml)


@dataclass
class Cluster:
    plane: ControlPlane
    admin: Kube
    admin_config: Path
    runtime: ProcessRuntime
    kubelet: Kubelet
    operator: OperatorThread
    gate: admission.Gate

    def kubectl(self, *args: str, check: bool = True) -> str:
        done = subprocess.run([str(tool("kubectl")), f"--kubeconfig={self.admin_config}", *args],
                              capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {done.stderr}")
        return done.stdout

    def job(self, name: str, namespace: str = JOBS) -> dict[str, Any]:
        return self.admin.get("DecoupledDiLoCoJob", namespace, name) or {}

    def events(self, namespace: str, reason: str) -> list[dict[str, Any]]:
        items = self.admin.request("GET", f"api/v1/namespaces/{namespace}/events").get("items") or []
        return [e for e in items if e.get("reason") == reason]


def helm(cp: ControlPlane, kubeconfig: Path, *args: str) -> str:
    done = subprocess.run([str(tool("helm")), f"--kubeconfig={kubeconfig}", *args], capture_output=True,
                          text=True, timeout=120)
    if done.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)}: {done.stderr}")
    return done.stdout


def service_account_token(admin: Kube) -> str:
    """The token the controller-manager's token controller minted for the chart's ServiceAccount."""
    name = SERVICE_ACCOUNT.rsplit(":", 1)[-1]

    def minted() -> str | None:
        secrets = admin.request("GET", f"api/v1/namespaces/{SYSTEM}/secrets").get("items") or []
        for s in secrets:
            if (s.get("type") == "kubernetes.io/service-account-token" and s.get("data", {}).get("token")
                    and (s["metadata"].get("annotations") or {}).get("kubernetes.io/service-account.name") == name):
                return base64.b64decode(s["data"]["token"]).decode()
        return None

    return wait_for(minted, timeout=30, what=f"a token for ServiceAccount {name}")


def install_crd(admin: Kube, crds: list[dict[str, Any]]) -> None:
    """CRDs, served before anything uses them."""
    for crd in crds:
        admin.request("POST", "apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)

        def established(name: str = crd["metadata"]["name"]) -> bool:
            got = admin.request("GET", f"apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
            return any(c.get("type") == "Established" and c.get("status") == "True"
                       for c in (got.get("status") or {}).get("conditions") or [])

        wait_for(established, timeout=30, what=f"CRD {crd['metadata']['name']} established")


@contextmanager
def real_cluster(folder: Path, kueue: bool | str = False, watch: tuple[str, ...] = (),
                 namespaces: tuple[str, ...] = (), operator_kube: Callable[[ControlPlane, str], Kube] | None = None,
                 identity: str = "operator-0", mutators: dict[str, tuple[str, list[str], admission.Mutator]] | None = None,
                 chart_values: dict[str, Any] | None = None, first_cpu: int = 0, **config: Any) -> Iterator[Cluster]:
    """`kueue`: with stand-ins for Kueue's CRDs serving that version only (True: v1beta1) and its
    default flavor, the chart's kueue.enabled and Config.kueue;
    `watch`: the chart's watchNamespaces (a Role in each, no ClusterRole) and the operator's
    --namespace list; `namespaces`: more namespaces to create besides JOBS (before the install:
    a Role needs its namespace); `operator_kube`: the operator's client from the plane and the
    ServiceAccount's token (default: $KUBECONFIG, as in a pod), `identity` its peering identity
    (a pod's name); `mutators`: defaulting webhooks the lane plays (tests/realapi/admission.py);
    `chart_values`: more of the chart's values (multiCluster's: tests/realapi/test_multicluster.py),
    `first_cpu` the CPU its first learner is pinned to (clusters sharing this machine alternate);
    `config`: other operator settings (Config's fields). The operator peers through the chart's
    peering object, as the chart's replicas do. The lane's admission webhooks (the CEL gate, and
    with `kueue` Kueue's Workload webhook) run on every cluster."""
    with ExitStack() as stack, pytest.MonkeyPatch.context() as mp:
        plane = stack.enter_context(ControlPlane(folder / "control-plane"))
        admin = Kube(plane.url, token=plane.admin_token, ca_file=str(plane.ca_file), user_agent="diloco-tests")
        admin_config = plane.kubeconfig(folder / "admin.kubeconfig", plane.admin_token)
        for namespace in dict.fromkeys((JOBS, *watch, *namespaces)):
            # Labelled with its name, as servers from 1.21 on label every namespace (the chart's
            # webhook selects the watched namespaces by it).
            admin.request("POST", "api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {
                "name": namespace, "labels": {"kubernetes.io/metadata.name": namespace}}})
        schemas = admission.crd_schemas(admission.crd_file(OUR_CRDS))
        if kueue:
            version = "v1beta1" if kueue is True else str(kueue)
            install_crd(admin, kueue_crds.crds(version))
            schemas.update(admission.crd_schemas(kueue_crds.crds(version)))
            admin.request("POST", f"apis/kueue.x-k8s.io/{version}/resourceflavors", {
                "apiVersion": f"kueue.x-k8s.io/{version}", "kind": "ResourceFlavor",
                "metadata": {"name": DEFAULT_FLAVOR}, "spec": {}})
        gate = stack.enter_context(admission.serving(admin, plane.folder, schemas=schemas, kueue=bool(kueue),
                                                     mutators=mutators))
        values = folder / "values.yaml"
        values.write_text(yaml.safe_dump({"nodeSelector": {"diloco.dev/operator-runs": "in-the-test-process"},
                                          **({"kueue": {"enabled": True}} if kueue else {}),
                                          **({"watchNamespaces": list(watch)} if watch else {}),
                                          **(chart_values or {})}))
        helm(plane, admin_config, "install", RELEASE, str(ROOT / "charts" / "decoupled-diloco"),
             "--namespace", SYSTEM, "--create-namespace", "-f", str(values))
        token = service_account_token(admin)
        mp.setenv("KUBECONFIG", str(plane.kubeconfig(folder / "operator.kubeconfig", token, "operator")))
        mp.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        runtime = ProcessRuntime(admin, JOBS, folder / "node", first_cpu=first_cpu)
        kubelet = stack.enter_context(Kubelet(admin, runtime, volumes=str(folder / "node" / "volumes"),
                                                   namespaces=frozenset({JOBS})))
        # The chart's admission webhook, served by the operator in this process (tests/realapi/webhook.py).
        hook = webhook.route(admin, webhook.chart_options(admin, SYSTEM, f"{RELEASE}-decoupled-diloco"),
                             str(folder / "webhook"))
        config = Config(**{"status_interval": 1.0, "chaos_interval": 0.5, "stuck_timeout": 10.0, **config},
                        syncer_address=lambda job, ns: runtime.local(n.syncer_address(job, ns)), kueue=bool(kueue),
                        webhook=hook)
        kube = operator_kube(plane, token) if operator_kube is not None else None
        operator = stack.enter_context(OperatorThread(config, kube=kube, namespaces=watch,
                                                      peering=Peering.start(PEERING, identity)))
        webhook.wait_served(hook)  # a job applied before would be refused: failurePolicy Fail
        yield Cluster(plane, admin, admin_config, runtime, kubelet, operator, gate)
        dead = plane.alive()
        assert not dead, f"control-plane components exited during the tests: {dead}"
        # Kueue's checks and the CEL rules never refuse what the operator writes (tests that send a
        # bad object on purpose send it as the admin).
        mine = [r for r in gate.refused if r.user == SERVICE_ACCOUNT]
        assert not mine, f"the CEL gate or Kueue's webhook refused the operator's writes: {mine}"
