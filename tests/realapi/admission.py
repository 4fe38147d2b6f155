"""The test harness's admission webhooks on the real API server: what a modern server and Kueue
would refuse, refused on the 1.20 lane too.

One HTTPS server in the test process (the API server dials it at https://127.0.0.1:PORT, trusting
the control plane's own CA: the server certificate the API server serves with names 127.0.0.1)
answers AdmissionReview v1 on:

- `/cel`: the CEL gate. A 1.20 API server drops `x-kubernetes-validations` from the CRDs it
  stores, so the gate reads them from the CRD objects the lane installs (ours from the chart's
  `crds/` file, which is `diloco crd` with CEL; Kueue's from tests/realapi/kueue_crds.py) and
  evaluates them on every create and update of those kinds (tests/realapi/cel.py: `self`,
  `oldSelf`, transition rules as Kubernetes runs them). Registered for
  `decoupleddilocojobs` (its rules are all on `spec`, which its status subresource never
  changes) and Kueue's `workloads` and `workloads/status`.
- `/kueue/validate-workload`: Kueue's Workload webhook (tests/realapi/kueue_webhook.py), for
  `workloads` and `workloads/status`, create and update, as Kueue registers it
  (pkg/webhooks/workload_webhook.go's kubebuilder marker).
- `/kueue/mutate-statefulset`, `/kueue/mutate-deployment`: Kueue's statefulset and deployment
  integrations' defaulting (tests/realapi/kueue_defaults.py), when the lane plays them.

Every refusal is recorded with who asked (`Gate.refused`), so a lane can assert that nothing the
operator or the Kueue double wrote was refused.
"""

from __future__ import annotations

import base64
import json
import ssl
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from diloco.operator.kube import Kube
from tests.realapi import cel, kueue_webhook

Mutator = Callable[[dict[str, Any]], list[dict[str, Any]]]  # an AdmissionRequest -> JSON patch operations


@dataclass
class Refusal:
    path: str
    user: str
    operation: str
    kind: str
    name: str
    reasons: list[str]


@dataclass
class Gate:
    schemas: dict[tuple[str, str], dict[str, Any]]  # (group, plural) -> the openAPIV3Schema with its rules
    mutators: dict[str, Mutator] = field(default_factory=dict)  # path -> a defaulting webhook
    refused: list[Refusal] = field(default_factory=list)
    seen: int = 0  # requests answered
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, path: str, review: dict[str, Any]) -> dict[str, Any]:
        req = review["request"]
        with self.lock:
            self.seen += 1
        if path in self.mutators:
            ops = self.mutators[path](req)
            out: dict[str, Any] = {"uid": req["uid"], "allowed": True}
            if ops:
                out.update(patchType="JSONPatch", patch=base64.b64encode(json.dumps(ops).encode()).decode())
            return out
        new, old = req.get("object"), req.get("oldObject")
        if path == "/cel":
            resource = req["resource"]
            schema = self.schemas.get((resource["group"], resource["resource"]))
            reasons = cel.errors(schema, new, old if req["operation"] == "UPDATE" else None) \
                if schema is not None and new is not None else []
        elif path == "/kueue/validate-workload":
            reasons = kueue_webhook.review(req["operation"], new, old)
        else:
            reasons = [f"no webhook at {path}"]
        if not reasons:
            return {"uid": req["uid"], "allowed": True}
        meta = (new or old or {}).get("metadata") or {}
        with self.lock:
            self.refused.append(Refusal(path, (req.get("userInfo") or {}).get("username", ""), req["operation"],
                                        req["kind"]["kind"], meta.get("name", ""), reasons))
        return {"uid": req["uid"], "allowed": False,
                "status": {"code": 422, "reason": "Invalid", "message": "; ".join(reasons)}}


def _handler(gate: Gate) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            try:
                response = gate.answer(self.path.split("?")[0], body)
            except Exception as exc:  # answered, so the API server names the harness's failure
                response = {"uid": body["request"]["uid"], "allowed": False,
                            "status": {"code": 500, "message": f"the test's admission webhook failed: {exc!r}"}}
            data = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                               "response": response}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


def crd_schemas(crds: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """(group, plural) -> the served version's openAPIV3Schema, of CRD objects."""
    out = {}
    for crd in crds:
        spec = crd["spec"]
        for version in spec["versions"]:
            if version.get("served", True):
                out[(spec["group"], spec["names"]["plural"])] = version["schema"]["openAPIV3Schema"]
    return out


def crd_file(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "CustomResourceDefinition"]


def _hook(name: str, url: str, ca: str, rules: list[dict[str, Any]], *, mutating: bool = False) -> dict[str, Any]:
    out = {"name": name, "clientConfig": {"url": url, "caBundle": ca}, "rules": rules,
           "failurePolicy": "Fail", "sideEffects": "None", "admissionReviewVersions": ["v1"], "timeoutSeconds": 10,
           "matchPolicy": "Equivalent"}
    if mutating:
        out["reinvocationPolicy"] = "Never"
    return out


def _rule(group: str, resources: list[str], versions: str = "*") -> dict[str, Any]:
    return {"apiGroups": [group], "apiVersions": [versions], "operations": ["CREATE", "UPDATE"],
            "resources": resources, "scope": "*"}


@contextmanager
def serving(admin: Kube, folder: Path, *, schemas: dict[tuple[str, str], dict[str, Any]], kueue: bool,
            mutators: dict[str, tuple[str, list[str], Mutator]] | None = None) -> Iterator[Gate]:
    """The harness's webhooks served and registered (`mutators`: path -> (group, resources,
    the defaulting function)); unregistered at the end."""
    gate = Gate(schemas, {path: m for path, (_, _, m) in (mutators or {}).items()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(gate))
    server.daemon_threads = True
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(folder / "server.crt"), str(folder / "server.key"))
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, name="admission", daemon=True)
    thread.start()
    base = f"https://127.0.0.1:{server.server_address[1]}"
    ca = base64.b64encode((folder / "ca.crt").read_bytes()).decode()
    groups: dict[str, list[str]] = {}
    for group, plural in schemas:
        groups.setdefault(group, []).append(plural)
    cel_rules = [_rule(group, [r for p in plurals for r in ([p, f"{p}/status"] if group == "kueue.x-k8s.io" else [p])])
                 for group, plurals in groups.items()]
    hooks = [_hook("cel.tests.diloco.dev", f"{base}/cel", ca, cel_rules)]
    if kueue:
        hooks.append(_hook("vworkload.kueue.x-k8s.io", f"{base}/kueue/validate-workload", ca,
                           [_rule("kueue.x-k8s.io", ["workloads", "workloads/status"])]))
    validating = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
                  "metadata": {"name": "lane-cel-gate-and-kueue"}, "webhooks": hooks}
    admin.request("POST", "apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations", validating)
    if mutators:
        mutating = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
                    "metadata": {"name": "lane-kueue-defaulting"},
                    "webhooks": [_hook(f"m{path.rsplit('-', 1)[-1]}.kueue.x-k8s.io", f"{base}{path}", ca,
                                       [_rule(group, resources, "v1")], mutating=True)
                                 for path, (group, resources, _) in mutators.items()]}
        admin.request("POST", "apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations", mutating)
    try:
        yield gate
    finally:
        for kind, name in (("validatingwebhookconfigurations", "lane-cel-gate-and-kueue"),
                           ("mutatingwebhookconfigurations", "lane-kueue-defaulting")):
            try:
                admin.request("DELETE", f"apis/admissionregistration.k8s.io/v1/{kind}/{name}")
            except Exception:  # the control plane may be gone already
                pass
        server.shutdown()
