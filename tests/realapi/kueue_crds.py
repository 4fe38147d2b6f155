"""Kueue's CRDs for the test lanes, as strict as Kueue's: its Workload schema and CEL rules.

Kueue cannot be downloaded here, so its CRDs are written from its API types
(kubernetes-sigs/kueue, main as of 2026-08: apis/kueue/v1beta2/workload_types.go and
apis/kueue/v1beta1/workload_types.go, whose kubebuilder markers controller-gen turns into
config/components/crd/bases/kueue.x-k8s.io_workloads.yaml). Each constraint below cites the
marker it comes from (`v1beta2:LINE` is a line of v1beta2/workload_types.go). What the schema
holds is what the operator and the Kueue double write, with Kueue's types, bounds, patterns and
required fields; a PodSet's pod template is kept open (Kueue's embeds the whole PodTemplateSpec,
which the API server checks when the pods are created). The kinds Kueue's double reads besides
(ResourceFlavor, WorkloadPriorityClass, LocalQueue) stay open.

Kubernetes 1.20 enforces the OpenAPI part itself (types, bounds, patterns, enums, required) and
drops `x-kubernetes-validations` from the CRDs it stores, so the lane's CEL gate
(tests/realapi/cel_gate.py) evaluates those rules from these same objects.
"""

from __future__ import annotations

import copy
from typing import Any

GROUP = "kueue.x-k8s.io"
DNS_LABEL = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
QUOTA_RESERVED = "self.status.conditions.exists(c, c.type == 'QuotaReserved' && c.status == 'True')"
OLD_QUOTA_RESERVED = QUOTA_RESERVED.replace("self.", "oldSelf.")
OLD_ADMITTED = "oldSelf.status.conditions.exists(c, c.type == 'Admitted' && c.status == 'True')"
NEW_ADMITTED = OLD_ADMITTED.replace("oldSelf.", "self.")


def _string(max_length: int | None = None, pattern: str | None = None, min_length: int | None = None,
            **more: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "string", **more}
    if max_length is not None:
        out["maxLength"] = max_length
    if min_length is not None:
        out["minLength"] = min_length
    if pattern is not None:
        out["pattern"] = pattern
    return out


def _int(minimum: int | None = None) -> dict[str, Any]:
    return {"type": "integer", "format": "int32", **({"minimum": minimum} if minimum is not None else {})}


QUANTITY = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True,
            "pattern": "^(\\+|-)?(([0-9]+(\\.[0-9]*)?)|(\\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\\+|-)?"
                       "(([0-9]+(\\.[0-9]*)?)|(\\.[0-9]+))))?$"}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}

# metav1.Condition as controller-gen renders it (k8s.io/apimachinery/pkg/apis/meta/v1/types.go).
CONDITION = {
    "type": "object", "required": ["lastTransitionTime", "message", "reason", "status", "type"],
    "properties": {
        "lastTransitionTime": {"type": "string", "format": "date-time"},
        "message": _string(32768),
        "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0},
        "reason": _string(1024, "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", 1),
        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
        "type": _string(316, "^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                             "(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"),
    }}

# PodSetTopologyRequest, v1beta2:165-250 (v1beta1 the same fields).
TOPOLOGY_REQUEST = {"type": "object", "properties": {
    "required": _string(63), "preferred": _string(63), "unconstrained": {"type": "boolean"},
    "podIndexLabel": _string(317), "subGroupIndexLabel": _string(317), "subGroupCount": _int(0),
    "podSetGroupName": _string(256), "podSetSliceRequiredTopology": _string(63), "podSetSliceSize": _int(1),
    "podsetSliceRequiredTopologyConstraints": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"topology": _string(63, min_length=1), "size": _int(1)}}},
}}

# PodSet, v1beta2:557-604: name a DNS label defaulting to "main" (PodSetReference, v1beta2:283-285;
# v1beta2:560), count >= 0, minCount >= 1 and at most count (the XValidation at v1beta2:557).
POD_SET = {
    "type": "object", "required": ["count"],
    "properties": {
        "name": _string(63, DNS_LABEL, default="main"),
        "template": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {
            "metadata": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                         "properties": {"labels": STRING_MAP, "annotations": STRING_MAP}},
            "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}},
        "count": _int(0),
        "minCount": _int(1),
        "topologyRequest": TOPOLOGY_REQUEST,
    },
    "x-kubernetes-validations": [{"rule": "has(self.minCount) ? self.minCount <= self.count : true",
                                  "message": "minCount should be positive and less or equal to count"}],
}

# Admission, v1beta2:269-316 (the TAS assignment kept open: the double assigns no topology).
ADMISSION = {
    "type": "object", "required": ["clusterQueue", "podSetAssignments"],
    "properties": {
        "clusterQueue": _string(253, DNS_SUBDOMAIN),
        "podSetAssignments": {"type": "array", "maxItems": 18, "x-kubernetes-list-type": "map",
                              "x-kubernetes-list-map-keys": ["name"], "items": {
            "type": "object", "required": ["name"],
            "properties": {
                "name": _string(63, DNS_LABEL),
                "flavors": {"type": "object", "additionalProperties": _string(253, DNS_SUBDOMAIN)},
                "resourceUsage": {"type": "object", "additionalProperties": QUANTITY},
                "count": _int(0),
                "topologyAssignment": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                "delayedTopologyRequest": {"type": "string", "enum": ["Pending", "Ready"], "maxLength": 7},
            }}},
    }}

# WorkloadStatus, v1beta2:615-728: conditions at most 16 (v1beta2:634), clusterName's two rules (v1beta2:615-616).
STATUS = {
    "type": "object",
    "properties": {
        "conditions": {"type": "array", "maxItems": 16, "items": CONDITION,
                       "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        "admission": ADMISSION,
        "requeueState": {"type": "object", "properties": {
            "count": _int(0), "requeueAt": {"type": "string", "format": "date-time"}}},
        "reclaimablePods": {"type": "array", "maxItems": 18, "items": {
            "type": "object", "required": ["name", "count"],
            "properties": {"name": _string(63, DNS_LABEL), "count": _int(0)}}},
        "admissionChecks": {"type": "array", "maxItems": 8, "items": {
            "type": "object", "x-kubernetes-preserve-unknown-fields": True}},
        "resourceRequests": {"type": "array", "maxItems": 18, "items": {
            "type": "object", "x-kubernetes-preserve-unknown-fields": True}},
        "accumulatedPastExecutionTimeSeconds": _int(),
        "schedulingStats": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        "nominatedClusterNames": {"type": "array", "maxItems": 20, "items": _string(256)},
        "clusterName": _string(256),
        "unhealthyNodes": {"type": "array", "maxItems": 8, "items": {
            "type": "object", "required": ["name"], "properties": {"name": _string(63)}}},
    },
    "x-kubernetes-validations": [
        {"rule": "!has(oldSelf.clusterName) || !has(self.clusterName) || oldSelf.clusterName == self.clusterName",
         "message": "clusterName is immutable once set"},
        {"rule": "!has(self.clusterName) || (!has(self.nominatedClusterNames) || (has(self.nominatedClusterNames) "
                 "&& size(self.nominatedClusterNames) == 0))",
         "message": "clusterName and nominatedClusterNames are mutually exclusive"},
    ]}


def _spec(version: str) -> dict[str, Any]:
    """WorkloadSpec: podSets 1 to 18 (v1beta2:36-37, v1beta1:41), queueName a DNS subdomain
    (LocalQueueName, localqueue_types.go:26-30), maximumExecutionTimeSeconds >= 1 (v1beta2:76),
    and how the priority class is named: v1beta2's priorityClassRef (v1beta2:92-161, with its two
    rules at v1beta2:134-135, and the spec's rule at v1beta2:27), v1beta1's priorityClassName and
    priorityClassSource (v1beta1:32)."""
    props: dict[str, Any] = {
        "podSets": {"type": "array", "minItems": 1, "maxItems": 18, "items": POD_SET,
                    "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        "queueName": _string(253, DNS_SUBDOMAIN),
        "priority": _int(),
        "active": {"type": "boolean"},
        "maximumExecutionTimeSeconds": _int(1),
    }
    if version == "v1beta2":
        props["priorityClassRef"] = {
            "type": "object", "required": ["name"],
            "properties": {"group": {"type": "string", "enum": ["kueue.x-k8s.io", "scheduling.k8s.io"]},
                           "kind": {"type": "string", "enum": ["WorkloadPriorityClass", "PriorityClass"]},
                           "name": _string(253, DNS_SUBDOMAIN, 1)},
            "x-kubernetes-validations": [
                {"rule": "(self.group == 'scheduling.k8s.io') ? self.kind == 'PriorityClass' : true",
                 "message": "only the PriorityClass kind is allowed for the scheduling.k8s.io group"},
                {"rule": "(self.group == 'kueue.x-k8s.io') ? self.kind == 'WorkloadPriorityClass' : true",
                 "message": "only the WorkloadPriorityClass kind is allowed for the kueue.x-k8s.io group"}]}
        rules = [{"rule": "!has(self.priorityClassRef) || has(self.priority)",
                  "message": "priority should not be nil when priorityClassRef is set"}]
    else:
        props["priorityClassName"] = {"type": "string"}
        props["priorityClassSource"] = {"type": "string", "enum": [
            "kueue.x-k8s.io/workloadpriorityclass", "scheduling.k8s.io/priorityclass", ""]}
        rules = [{"rule": "has(self.priorityClassName) ? has(self.priority) : true",
                  "message": "priority should not be nil when priorityClassName is set"}]
    return {"type": "object", "properties": props, "x-kubernetes-validations": rules}


def _held(rule: str) -> str:
    return f"(has(oldSelf.status) && has(oldSelf.status.conditions) && {OLD_QUOTA_RESERVED}{rule}"


def _root_rules(version: str) -> list[dict[str, str]]:
    """The Workload's own rules (v1beta2:1192-1198, v1beta1:790-794), word for word."""
    both_reserved = (f"((has(oldSelf.status) && has(oldSelf.status.conditions) && {OLD_QUOTA_RESERVED}) && "
                     f"(has(self.status) && has(self.status.conditions) && {QUOTA_RESERVED}))")
    rules = [
        {"rule": f"has(self.status) && has(self.status.conditions) && {QUOTA_RESERVED} && has(self.status.admission)"
                 " ? size(self.spec.podSets) == size(self.status.admission.podSetAssignments) : true",
         "message": "podSetAssignments must have the same number of podSets as the spec"},
    ]
    if version == "v1beta2":
        rules += [
            {"rule": _held(") ? (!has(oldSelf.spec.priorityClassRef) && !has(self.spec.priorityClassRef)) || "
                           "(has(oldSelf.spec.priorityClassRef) && has(self.spec.priorityClassRef)) : true"),
             "message": "priorityClassRef is immutable while workload quota reserved"},
            {"rule": _held(" && has(oldSelf.spec.priorityClassRef) && has(self.spec.priorityClassRef)) ? "
                           "oldSelf.spec.priorityClassRef.group == self.spec.priorityClassRef.group : true"),
             "message": "priorityClassRef.group is immutable while workload quota reserved"},
            {"rule": _held(" && has(oldSelf.spec.priorityClassRef) && has(self.spec.priorityClassRef)) ? "
                           "oldSelf.spec.priorityClassRef.kind == self.spec.priorityClassRef.kind : true"),
             "message": "priorityClassRef.kind is immutable while workload quota reserved"},
            {"rule": _held(" && has(oldSelf.spec.priorityClassRef) && has(self.spec.priorityClassRef) && "
                           "self.spec.priorityClassRef.group == 'scheduling.k8s.io' && "
                           "self.spec.priorityClassRef.kind == 'PriorityClass') ? "
                           "oldSelf.spec.priorityClassRef.name == self.spec.priorityClassRef.name : true"),
             "message": "priorityClassRef.name is immutable for scheduling.k8s.io/priorityclass while workload "
                        "quota reserved"},
        ]
    else:
        rules += [
            {"rule": _held(" && has(oldSelf.spec.priorityClassSource) && has(self.spec.priorityClassSource)) ? "
                           "(oldSelf.spec.priorityClassSource == self.spec.priorityClassSource) : true"),
             "message": "priorityClassSource is immutable while workload quota reserved"},
            {"rule": _held(" && has(oldSelf.spec.priorityClassSource) && has(self.spec.priorityClassSource) && "
                           "(self.spec.priorityClassSource != 'kueue.x-k8s.io/workloadpriorityclass') && "
                           "has(oldSelf.spec.priorityClassName) && has(self.spec.priorityClassName)) ? "
                           "(oldSelf.spec.priorityClassName == self.spec.priorityClassName) : true"),
             "message": "priorityClassName is immutable while workload quota reserved and priorityClassSource is not "
                        "equal to kueue.x-k8s.io/workloadpriorityclass"},
        ]
    rules += [
        {"rule": f"{both_reserved} ? ((has(oldSelf.spec.queueName) == has(self.spec.queueName)) && "
                 "(!has(oldSelf.spec.queueName) || oldSelf.spec.queueName == self.spec.queueName)) : true",
         "message": "queueName is immutable while workload quota reserved"},
        {"rule": f"((has(oldSelf.status) && has(oldSelf.status.conditions) && {OLD_ADMITTED}) && "
                 f"(has(self.status) && has(self.status.conditions) && {NEW_ADMITTED}))?"
                 "((has(oldSelf.spec.maximumExecutionTimeSeconds)?oldSelf.spec.maximumExecutionTimeSeconds:0) ==  "
                 "(has(self.spec.maximumExecutionTimeSeconds)?self.spec.maximumExecutionTimeSeconds:0)):true",
         "message": "maximumExecutionTimeSeconds is immutable while workload quota reserved"},
    ]
    return rules


def workload_schema(version: str) -> dict[str, Any]:
    return {"type": "object",
            "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                           "metadata": {"type": "object"}, "spec": _spec(version), "status": copy.deepcopy(STATUS)},
            "x-kubernetes-validations": _root_rules(version)}


def _crd(plural: str, kind: str, version: str, schema: dict[str, Any], *, namespaced: bool,
         status: bool = False, short: list[str] | None = None) -> dict[str, Any]:
    names: dict[str, Any] = {"plural": plural, "singular": kind.lower(), "kind": kind, "listKind": f"{kind}List"}
    if short:
        names["shortNames"] = short
    ver: dict[str, Any] = {"name": version, "served": True, "storage": True, "schema": {"openAPIV3Schema": schema}}
    if status:
        ver["subresources"] = {"status": {}}
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.{GROUP}"},
            "spec": {"group": GROUP, "scope": "Namespaced" if namespaced else "Cluster", "names": names,
                     "versions": [ver]}}


def _open(**props: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                             "metadata": {"type": "object"}, **props}}


def crds(version: str) -> list[dict[str, Any]]:
    """Kueue's CRDs as a release serving `version` only (v1beta1: before 0.15; v1beta2: the
    later ones that drop v1beta1): the Workload strict, the others open."""
    open_spec = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return [
        _crd("workloads", "Workload", version, workload_schema(version), namespaced=True, status=True, short=["wl"]),
        _crd("resourceflavors", "ResourceFlavor", version, _open(spec=open_spec), namespaced=False,
             short=["flavor", "flavors", "rf"]),
        _crd("workloadpriorityclasses", "WorkloadPriorityClass", version,
             _open(value={"type": "integer"}, description={"type": "string"}), namespaced=False),
        _crd("localqueues", "LocalQueue", version, _open(spec=open_spec, status=open_spec), namespaced=True,
             status=True, short=["queue", "queues", "lq"]),
    ]


def _json_schema(node: Any) -> Any:
    """A structural schema as JSON Schema for `jsonschema` (the API server's own check, for pure
    tests): int-or-string as either, the Kubernetes extensions dropped."""
    if isinstance(node, list):
        return [_json_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-") and k != "default"}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("anyOf", None)
        out["type"] = ["integer", "string"]
    if out.get("type") == "integer":
        out.pop("format", None)
    return out


def refusals(new: dict[str, Any], old: dict[str, Any] | None = None, version: str = "v1beta2") -> list[str]:
    """Everything Kueue refuses of this Workload write: its CRD's schema (what the API server
    checks), its CEL rules (tests/realapi/cel.py) and its Workload webhook
    (tests/realapi/kueue_webhook.py); [] when Kueue stores it."""
    import jsonschema

    from tests.realapi import cel, kueue_webhook

    schema = workload_schema(version)
    validator = jsonschema.Draft7Validator(_json_schema(schema))
    out = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(new)]
    out += cel.errors(schema, new, old)
    out += kueue_webhook.review("UPDATE" if old is not None else "CREATE", new, old)
    return out
