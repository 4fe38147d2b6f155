"""Kueue's Workload webhook, played for the test lanes: what it refuses, it refuses here.

Written from kubernetes-sigs/kueue's pkg/webhooks/workload_webhook.go (main as of 2026-08):
`validate_workload` is its ValidateWorkload, `validate_update` its ValidateWorkloadUpdate
(ValidateCreate and ValidateUpdate call them for `workloads` and `workloads/status`), with the
feature gates at their defaults in that release (pkg/features/kube_features.go):
PartialAdmission on (so its defaulting webhook, which drops minCount only without it, changes
nothing), ElasticJobsViaWorkloadSlices on (a held PodSet's count may fall; a Workload marked
elastic may carry no minCount), TopologyAwareScheduling, WorkloadValidationForPodSetMetadata,
WorkloadValidateResourcesAreNonNegative and TASValidateWorkloadSliceSize on. Left out, because
neither the operator nor the double writes what they check: the admission checks' podSetUpdates
(validateAdmissionChecks, validateImmutablePodSetUpdates), MultiKueue's clusterName
(validateClusterNameUpdate), AdmissionGatedBy's and PriorityBoost's annotations. Each message
is Kueue's field path and words (field.ErrorList's format).

Pure: dicts in, error strings out; tests/realapi/admission.py serves it to the API server.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from diloco.operator.reconcile.drift import quantity

ELASTIC = "kueue.x-k8s.io/elastic-job"  # workloadslicing.EnabledAnnotationKey (constants.ElasticJobAnnotation)
REPLACEMENT_FOR = "kueue.x-k8s.io/workload-slice-replacement-for"
_QUALIFIED = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
ANNOTATIONS_MAX = 256 * 1024


def _conds(wl: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list(((wl.get("status") or {}).get("conditions")) or [])


def has_quota_reservation(wl: Mapping[str, Any] | None) -> bool:
    """workload.HasQuotaReservation: the QuotaReserved condition is True."""
    return wl is not None and any(c.get("type") == "QuotaReserved" and c.get("status") == "True" for c in _conds(wl))


def _elastic(wl: Mapping[str, Any]) -> bool:
    """workloadslicing.Enabled: the gate on and the annotation "true"."""
    return ((wl.get("metadata") or {}).get("annotations") or {}).get(ELASTIC) == "true"


def _qualified_name(key: str, path: str) -> list[str]:
    """metav1validation's IsQualifiedName."""
    parts = key.split("/")
    if len(parts) > 2:
        return [f"{path}: Invalid value: {json.dumps(key)}: a qualified name must consist of alphanumeric characters, "
                "'-', '_' or '.', and must start and end with an alphanumeric character, with an optional DNS "
                "subdomain prefix and '/'"]
    prefix, name = (parts[0], parts[1]) if len(parts) == 2 else ("", parts[0])
    out = []
    if len(parts) == 2 and (not prefix or len(prefix) > 253 or not _PREFIX.match(prefix)):
        out.append(f"{path}: Invalid value: {json.dumps(key)}: prefix part must be a DNS-1123 subdomain")
    if not name or len(name) > 63 or not _QUALIFIED.match(name):
        out.append(f"{path}: Invalid value: {json.dumps(key)}: name part must consist of alphanumeric characters, "
                   "'-', '_' or '.', and must start and end with an alphanumeric character")
    return out


def _labels(labels: Mapping[str, Any] | None, path: str) -> list[str]:
    """metav1validation.ValidateLabels."""
    out = []
    for key, value in (labels or {}).items():
        out += _qualified_name(str(key), path)
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            out.append(f"{path}: Invalid value: {json.dumps(value)}: a valid label must be an empty string or "
                       "consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
                       "alphanumeric character")
    return out


def _annotations(annotations: Mapping[str, Any] | None, path: str) -> list[str]:
    """apivalidation.ValidateAnnotations: keys qualified names, at most 256 KiB in all."""
    out = []
    for key in annotations or {}:
        out += _qualified_name(str(key).lower(), path)
    size = sum(len(str(k)) + len(str(v)) for k, v in (annotations or {}).items())
    if size > ANNOTATIONS_MAX:
        out.append(f"{path}: Too long: may not be more than {ANNOTATIONS_MAX} bytes")
    return out


def _resource_list(resources: Mapping[str, Any] | None, path: str) -> list[str]:
    """validateResourceList: the reserved `pods` key, and negative quantities."""
    out = []
    for name, value in (resources or {}).items():
        if name == "pods":
            out.append(f"{path}[pods]: Invalid value: \"pods\": the key is reserved for internal kueue use")
        amount = quantity(value)
        if amount is not None and amount < 0:
            out.append(f"{path}[{name}]: Invalid value: {json.dumps(str(value))}: must be greater than or equal to 0")
    return out


def _container(container: Mapping[str, Any], path: str) -> list[str]:
    res = container.get("resources") or {}
    return _resource_list(res.get("requests"), f"{path}.resources.requests") + \
        _resource_list(res.get("limits"), f"{path}.resources.limits")


def _tas_slice_size(request: Mapping[str, Any] | None, path: str) -> list[str]:
    """validateTASSliceSize."""
    if not request:
        return []
    out = []
    if request.get("podSetSliceRequiredTopology") is not None:
        size = request.get("podSetSliceSize")
        if size is None:
            out.append(f"{path}.podSetSliceSize: Required value: must be set when podSetSliceRequiredTopology is "
                       "specified")
        elif int(size) <= 0:
            out.append(f"{path}.podSetSliceSize: Invalid value: {size}: must be greater than 0")
    elif request.get("podSetSliceSize") is not None:
        out.append(f"{path}.podSetSliceSize: Forbidden: may not be set when podSetSliceRequiredTopology is not "
                   "specified")
    for i, constraint in enumerate(request.get("podsetSliceRequiredTopologyConstraints") or []):
        if int(constraint.get("size") or 0) <= 0:
            out.append(f"{path}.podsetSliceRequiredTopologyConstraints[{i}].size: Invalid value: "
                       f"{constraint.get('size')}: must be greater than 0")
    return out


def _pod_set(ps: Mapping[str, Any], path: str) -> list[str]:
    """validatePodSet."""
    template = ps.get("template") or {}
    meta, spec = template.get("metadata") or {}, template.get("spec") or {}
    out = _labels(meta.get("labels"), f"{path}.template.metadata.labels")
    out += _annotations(meta.get("annotations"), f"{path}.template.metadata.annotations")
    for key in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(key) or []):
            out += _container(c, f"{path}.template.spec.{key}[{i}]")
    pod_level = spec.get("resources")
    if pod_level:
        out += _resource_list(pod_level.get("requests"), f"{path}.template.spec.resources.requests")
        out += _resource_list(pod_level.get("limits"), f"{path}.template.spec.resources.limits")
    out += _tas_slice_size(ps.get("topologyRequest"), f"{path}.topologyRequest")
    return out


def _conditions(conds: list[dict[str, Any]], path: str) -> list[str]:
    """metav1validation.ValidateConditions (ValidateCondition each, types unique)."""
    out, seen = [], set()
    for i, c in enumerate(conds):
        where = f"{path}[{i}]"
        kind = str(c.get("type") or "")
        if kind in seen:
            out.append(f"{where}.type: Duplicate value: {json.dumps(kind)}")
        seen.add(kind)
        out += _qualified_name(kind, f"{where}.type") if kind else [f"{where}.type: Required value"]
        if c.get("status") not in ("True", "False", "Unknown"):
            out.append(f"{where}.status: Unsupported value: {json.dumps(c.get('status'))}: supported values: "
                       "\"False\", \"True\", \"Unknown\"")
        if int(c.get("observedGeneration") or 0) < 0:
            out.append(f"{where}.observedGeneration: Invalid value: {c.get('observedGeneration')}: must be greater "
                       "than or equal to zero")
        if not c.get("lastTransitionTime"):
            out.append(f"{where}.lastTransitionTime: Required value: must be set")
        reason = str(c.get("reason") or "")
        if not reason:
            out.append(f"{where}.reason: Required value: must be set")
        elif len(reason) > 1024 or not _REASON.match(reason):
            out.append(f"{where}.reason: Invalid value: {json.dumps(reason)}: a condition reason must start with "
                       "alphabetic character, optionally followed by a string of alphanumeric characters or '_,:', "
                       "and must end with an alphanumeric character or '_'")
        if len(str(c.get("message") or "")) > 32768:
            out.append(f"{where}.message: Too long: may not be more than 32768 bytes")
    return out


def _admission(wl: Mapping[str, Any], old: Mapping[str, Any] | None, path: str) -> list[str]:
    """validateAdmission, reached on QuotaReserved True."""
    admission = (wl.get("status") or {}).get("admission")
    if not admission:
        if old is not None and has_quota_reservation(old) and not (old.get("status") or {}).get("admission"):
            return []  # one already like this goes through, so it can converge
        return [f"{path}: Required value: must be set while the QuotaReserved condition is true"]
    names = {p.get("name", "main") for p in (wl.get("spec") or {}).get("podSets") or []}
    out = []
    for i, psa in enumerate(admission.get("podSetAssignments") or []):
        where = f"{path}.podSetAssignments[{i}]"
        if psa.get("name") not in names:
            out.append(f"{where}.name: Not found: {json.dumps(psa.get('name'))}")
        count = int(psa.get("count") or 0)
        if count > 0:
            for resource, value in (psa.get("resourceUsage") or {}).items():
                amount = quantity(value) or Decimal(0)
                scaled = amount * 1000 if resource in ("cpu",) else amount  # resources.ResourceValue: cpu in milli
                if scaled % count != 0:
                    out.append(f"{where}.resourceUsage[{resource}]: Invalid value: {json.dumps(str(value))}: is not "
                               f"a multiple of {count}")
    return out


def _reclaimable(wl: Mapping[str, Any], old: Mapping[str, Any] | None, path: str) -> list[str]:
    """validateReclaimablePods."""
    pods = (wl.get("status") or {}).get("reclaimablePods") or []
    sizes = {p.get("name", "main"): int(p.get("count") or 0) for p in (wl.get("spec") or {}).get("podSets") or []}
    olds = {(r.get("name"), r.get("count")) for r in ((old or {}).get("status") or {}).get("reclaimablePods") or []}
    out = []
    for r in pods:
        where = f"{path}[{r.get('name')}]"
        if r.get("name") not in sizes:
            out.append(f"{where}.name: Unsupported value: {json.dumps(r.get('name'))}")
        elif int(r.get("count") or 0) > sizes[r["name"]] and not (old is not None and _elastic(wl) and
                                                                    (r.get("name"), r.get("count")) in olds):
            out.append(f"{where}.count: Invalid value: {r.get('count')}: should be less or equal to {sizes[r['name']]}")
    return out


def validate_workload(wl: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> list[str]:
    """ValidateWorkload(obj, oldObj): what Kueue refuses in any Workload it is asked to store."""
    out: list[str] = []
    variable = 0
    for i, ps in enumerate((wl.get("spec") or {}).get("podSets") or []):
        out += _pod_set(ps, f"spec.podSets[{i}]")
        if ps.get("minCount") is not None:
            variable += 1
    if variable > 1:
        out.append(f"spec.podSets: Invalid value: {variable}: at most one podSet can use minCount")
    if variable > 0 and _elastic(wl):
        out.append(f"spec.podSets: Invalid value: {variable}: partial admission and elastic job cannot be used "
                   "together")
    if has_quota_reservation(wl):
        out += _admission(wl, old, "status.admission")
    out += _conditions(_conds(wl), "status.conditions")
    out += _reclaimable(wl, old, "status.reclaimablePods")
    return out


def _normal(value: Any) -> Any:
    """A value as Kueue's typed structs hold it: what omitempty drops is absent, quantities by value
    (apiequality.Semantic compares resource.Quantity so)."""
    if isinstance(value, dict):
        out = {k: _normal(v) for k, v in value.items()}
        return {k: v for k, v in out.items() if v not in (None, {}, [], "")}
    if isinstance(value, list):
        return [_normal(v) for v in value]
    if isinstance(value, str) and (q := quantity(value)) is not None and re.match(r"^[0-9.+-]", value):
        return q
    return value


def _immutable_pod_sets(new: list[dict[str, Any]], old: list[dict[str, Any]]) -> list[str]:
    """validateImmutablePodSets: the same PodSets, each equal but for a count that falls."""
    if len(new) != len(old):
        return ["spec.podSets: Invalid value: \"[]PodSet\": field is immutable"]
    out = []
    for i, (n, o) in enumerate(zip(new, old, strict=True)):
        n = dict(n)
        if int(n.get("count") or 0) < int(o.get("count") or 0):  # ElasticJobsViaWorkloadSlices: scale down
            n["count"] = o.get("count")
        if _normal(n) != _normal(o):
            out.append(f"spec.podSets[{i}]: Invalid value: \"PodSet\": field is immutable")
    return out


def _admission_update(new: Mapping[str, Any] | None, old: Mapping[str, Any] | None) -> list[str]:
    """validateAdmissionUpdate: set or unset, never changed (with TAS on, the topology may be set)."""
    if not new or not old:
        return []
    if len(new.get("podSetAssignments") or []) != len(old.get("podSetAssignments") or []):
        return ["status.admission: Invalid value: \"Admission\": field is immutable"]
    topology = ("topologyAssignment", "delayedTopologyRequest")
    strip = [{k: v for k, v in a.items() if k not in topology} for a in new.get("podSetAssignments") or []]
    was = [{k: v for k, v in a.items() if k not in topology} for a in old.get("podSetAssignments") or []]
    if _normal({**new, "podSetAssignments": strip}) != _normal({**old, "podSetAssignments": was}):
        return ["status.admission: Invalid value: \"Admission\": field is immutable"]
    return []


def _scaled_down(wl: Mapping[str, Any]) -> set[str]:
    """scaledDownPodSetNames: an elastic Workload's PodSets now below what was admitted."""
    admission = (wl.get("status") or {}).get("admission")
    if not _elastic(wl) or not admission:
        return set()
    sizes = {p.get("name", "main"): int(p.get("count") or 0) for p in (wl.get("spec") or {}).get("podSets") or []}
    return {a["name"] for a in admission.get("podSetAssignments") or []
            if a.get("count") is not None and int(a["count"]) > sizes.get(a["name"], 0)}


def _reclaimable_update(new: Mapping[str, Any], old: Mapping[str, Any]) -> list[str]:
    """validateReclaimablePodsUpdate: counts never fall while the quota is held."""
    before = {r["name"]: int(r.get("count") or 0) for r in (old.get("status") or {}).get("reclaimablePods") or []}
    if not before:
        return []
    after = {r["name"]: int(r.get("count") or 0) for r in (new.get("status") or {}).get("reclaimablePods") or []}
    down = _scaled_down(new)
    out = [f"status.reclaimablePods[{k}].count: Invalid value: {v}: cannot be less than {before[k]}"
           for k, v in after.items() if k in before and v < before[k] and k not in down]
    out += [f"status.reclaimablePods[{k}]: Required value: cannot be removed" for k in before
            if k not in after and k not in down]
    return out


def validate_update(new: Mapping[str, Any], old: Mapping[str, Any]) -> list[str]:
    """ValidateWorkloadUpdate(newObj, oldObj)."""
    out = validate_workload(new, old)
    if has_quota_reservation(old):
        out += _immutable_pod_sets(list((new.get("spec") or {}).get("podSets") or []),
                                   list((old.get("spec") or {}).get("podSets") or []))
    if has_quota_reservation(new) and has_quota_reservation(old):
        out += _reclaimable_update(new, old)
    out += _admission_update((new.get("status") or {}).get("admission"), (old.get("status") or {}).get("admission"))
    return out


def review(operation: str, new: Mapping[str, Any] | None, old: Mapping[str, Any] | None) -> list[str]:
    """What the webhook answers an AdmissionReview of a Workload with (CREATE or UPDATE)."""
    if new is None or operation not in ("CREATE", "UPDATE"):
        return []
    return validate_update(new, old) if operation == "UPDATE" and old is not None else validate_workload(new)
