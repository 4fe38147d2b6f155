"""The Kueue double can fail: each rule it plays from Kueue's source refuses a hand-made bad
Workload (issue 61). Pure: tests/realapi/kueue_crds.py (the schema and CEL rules, from
apis/kueue/v1beta2 and v1beta1 workload_types.go), tests/realapi/kueue_webhook.py
(pkg/webhooks/workload_webhook.go) and tests/realapi/kueue.py (the controllers: partial
admission, the PodsReady timeout by reason, the requeue backoff). The real server refuses the
same through the lane's webhooks: tests/realapi/test_kueue_v1beta2.py."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.realapi import cel, kueue_crds, kueue_webhook
from tests.realapi import kueue as double

NOW = "2027-01-15T08:00:00Z"


def cond(type_: str, status: bool = True, reason: str = "", when: str = NOW, **more: Any) -> dict[str, Any]:
    return {"type": type_, "status": "True" if status else "False", "reason": reason or type_,
            "message": f"{type_}!", "lastTransitionTime": when, **more}


def pod_set(name: str = "main", count: int = 2, **more: Any) -> dict[str, Any]:
    return {"name": name, "count": count, "template": {"spec": {"containers": [{"name": "c", "image": "x"}]}},
            **more}


def wl(*pod_sets: dict[str, Any], annotations: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
            "metadata": {"name": "w", "namespace": "jobs", **({"annotations": annotations} if annotations else {})},
            "spec": {"queueName": "q", "podSets": list(pod_sets) or [pod_set()], **spec}}


def held(w: dict[str, Any], counts: dict[str, int] | None = None) -> dict[str, Any]:
    out = copy.deepcopy(w)
    given = counts or {p["name"]: p["count"] for p in w["spec"]["podSets"]}
    out["status"] = {"conditions": [cond("QuotaReserved"), cond("Admitted")], "admission": {
        "clusterQueue": "cq", "podSetAssignments": [{"name": k, "count": v, "flavors": {"pods": "f"},
                                                      "resourceUsage": {"pods": str(v)}} for k, v in given.items()]}}
    return out


def edit(w: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {**copy.deepcopy(w), "spec": {**copy.deepcopy(w["spec"]), **spec}}


REF = {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "high"}
V1 = {"apiVersion": "kueue.x-k8s.io/v1beta1"}

# (what, version, new, old, a word of the refusal), one per rule.
CASES: list[tuple[str, str, dict[str, Any], dict[str, Any] | None, str]] = [
    # CEL rules (kueue_crds.py, from the kubebuilder XValidation markers)
    ("minCount over count", "v1beta2", wl(pod_set(count=1, minCount=2)), None,
     "minCount should be positive and less or equal to count"),
    ("priorityClassRef without priority", "v1beta2", wl(priorityClassRef=REF), None,
     "priority should not be nil when priorityClassRef is set"),
    ("scheduling.k8s.io with a WorkloadPriorityClass", "v1beta2",
     wl(priority=1, priorityClassRef={**REF, "group": "scheduling.k8s.io"}), None,
     "only the PriorityClass kind is allowed for the scheduling.k8s.io group"),
    ("kueue.x-k8s.io with a PriorityClass", "v1beta2", wl(priority=1, priorityClassRef={**REF, "kind": "PriorityClass"}),
     None, "only the WorkloadPriorityClass kind is allowed for the kueue.x-k8s.io group"),
    ("fewer assignments than PodSets", "v1beta2", held(wl(pod_set("a"), pod_set("b")), {"a": 2}), None,
     "podSetAssignments must have the same number of podSets as the spec"),
    ("priorityClassRef dropped while held", "v1beta2", edit(held(wl(priority=1, priorityClassRef=REF)),
                                                            priorityClassRef=None) | {},
     held(wl(priority=1, priorityClassRef=REF)), "priorityClassRef is immutable while workload quota reserved"),
    ("priorityClassRef.group changed while held", "v1beta2",
     edit(held(wl(priority=1, priorityClassRef=REF)), priorityClassRef={**REF, "group": "scheduling.k8s.io",
                                                                        "kind": "PriorityClass"}),
     held(wl(priority=1, priorityClassRef=REF)), "priorityClassRef.group is immutable"),
    ("priorityClassRef.kind changed while held", "v1beta2",
     edit(held(wl(priority=1, priorityClassRef=REF)), priorityClassRef={**REF, "kind": "PriorityClass"}),
     held(wl(priority=1, priorityClassRef=REF)), "priorityClassRef.kind is immutable"),
    ("a PriorityClass's name changed while held", "v1beta2",
     edit(held(wl(priority=1, priorityClassRef={"group": "scheduling.k8s.io", "kind": "PriorityClass", "name": "a"})),
          priorityClassRef={"group": "scheduling.k8s.io", "kind": "PriorityClass", "name": "b"}),
     held(wl(priority=1, priorityClassRef={"group": "scheduling.k8s.io", "kind": "PriorityClass", "name": "a"})),
     "priorityClassRef.name is immutable for scheduling.k8s.io/priorityclass"),
    ("queueName changed while held", "v1beta2", edit(held(wl()), queueName="other"), held(wl()),
     "queueName is immutable while workload quota reserved"),
    ("maximumExecutionTimeSeconds changed while admitted", "v1beta2",
     edit(held(wl(maximumExecutionTimeSeconds=60)), maximumExecutionTimeSeconds=120),
     held(wl(maximumExecutionTimeSeconds=60)), "maximumExecutionTimeSeconds is immutable"),
    ("clusterName changed", "v1beta2", held(wl()) | {"status": {**held(wl())["status"], "clusterName": "b"}},
     held(wl()) | {"status": {**held(wl())["status"], "clusterName": "a"}}, "clusterName is immutable once set"),
    ("clusterName beside nominatedClusterNames", "v1beta2",
     wl() | {"status": {"clusterName": "a", "nominatedClusterNames": ["a"]}}, None,
     "clusterName and nominatedClusterNames are mutually exclusive"),
    ("priorityClassName without priority (v1beta1)", "v1beta1", wl(priorityClassName="high") | V1, None,
     "priority should not be nil when priorityClassName is set"),
    ("priorityClassSource changed while held (v1beta1)", "v1beta1",
     edit(held(wl(priority=1, priorityClassName="a", priorityClassSource="scheduling.k8s.io/priorityclass")),
          priorityClassSource="kueue.x-k8s.io/workloadpriorityclass") | V1,
     held(wl(priority=1, priorityClassName="a", priorityClassSource="scheduling.k8s.io/priorityclass")) | V1,
     "priorityClassSource is immutable while workload quota reserved"),
    ("a PriorityClass's name changed while held (v1beta1)", "v1beta1",
     edit(held(wl(priority=1, priorityClassName="a", priorityClassSource="scheduling.k8s.io/priorityclass")),
          priorityClassName="b") | V1,
     held(wl(priority=1, priorityClassName="a", priorityClassSource="scheduling.k8s.io/priorityclass")) | V1,
     "priorityClassName is immutable while workload quota reserved"),
    # the schema (the API server's own check)
    ("a negative count", "v1beta2", wl(pod_set(count=-1)), None, "is less than the minimum of 0"),
    ("minCount 0", "v1beta2", wl(pod_set(minCount=0)), None, "is less than the minimum of 1"),
    ("a PodSet name that is no DNS label", "v1beta2", wl(pod_set("Main_1")), None, "does not match"),
    ("19 PodSets", "v1beta2", wl(*[pod_set(f"p{i}") for i in range(19)]), None, "is too long"),
    ("no PodSet", "v1beta2", wl() | {"spec": {"queueName": "q", "podSets": []}}, None, "should be non-empty"),
    ("a condition without its reason", "v1beta2", wl() | {"status": {"conditions": [
        {"type": "PodsReady", "status": "True", "message": "", "lastTransitionTime": NOW}]}}, None,
     "'reason' is a required property"),
    # the Workload webhook (kueue_webhook.py, ValidateWorkload / ValidateWorkloadUpdate)
    ("two PodSets with minCount", "v1beta2", wl(pod_set("a", minCount=1), pod_set("b", minCount=1)), None,
     "at most one podSet can use minCount"),
    ("minCount on an elastic Workload", "v1beta2",
     wl(pod_set(minCount=1), annotations={"kueue.x-k8s.io/elastic-job": "true"}), None,
     "partial admission and elastic job cannot be used together"),
    ("the reserved pods resource", "v1beta2", wl(pod_set(template={"spec": {"containers": [
        {"name": "c", "resources": {"limits": {"pods": "1"}}}]}})), None, "the key is reserved for internal kueue use"),
    ("a negative request", "v1beta2", wl(pod_set(template={"spec": {"containers": [
        {"name": "c", "resources": {"requests": {"cpu": "-1"}}}]}})), None, "must be greater than or equal to 0"),
    ("a pod-level negative limit", "v1beta2", wl(pod_set(template={"spec": {"resources": {"limits": {"memory": "-1Gi"}}}})),
     None, "must be greater than or equal to 0"),
    ("a template label value Kubernetes refuses", "v1beta2",
     wl(pod_set(template={"metadata": {"labels": {"a": "not valid!"}}, "spec": {}})), None, "a valid label must be"),
    ("a template annotation key Kubernetes refuses", "v1beta2",
     wl(pod_set(template={"metadata": {"annotations": {"no/such/key": "x"}}, "spec": {}})), None,
     "a qualified name must consist of"),
    ("a slice topology without its size", "v1beta2",
     wl(pod_set(topologyRequest={"podSetSliceRequiredTopology": "rack"})), None,
     "must be set when podSetSliceRequiredTopology is specified"),
    ("a slice size without its topology", "v1beta2", wl(pod_set(topologyRequest={"podSetSliceSize": 2})), None,
     "may not be set when podSetSliceRequiredTopology is not specified"),
    ("QuotaReserved without an admission", "v1beta2", wl() | {"status": {"conditions": [cond("QuotaReserved")]}}, None,
     "must be set while the QuotaReserved condition is true"),
    ("an assignment for no PodSet", "v1beta2", held(wl(), {"other": 2}), None, "Not found: \"other\""),
    ("a usage that is no multiple of the count", "v1beta2",
     held(wl()) | {"status": {**held(wl())["status"], "admission": {"clusterQueue": "cq", "podSetAssignments": [
         {"name": "main", "count": 2, "resourceUsage": {"pods": "3"}}]}}}, None, "is not a multiple of 2"),
    ("a condition status that is no status", "v1beta2",
     wl() | {"status": {"conditions": [cond("PodsReady") | {"status": "Maybe"}]}}, None, "Unsupported value"),
    ("two conditions of one type", "v1beta2", wl() | {"status": {"conditions": [cond("PodsReady"), cond("PodsReady")]}},
     None, "Duplicate value"),
    ("a reclaimable count over its PodSet", "v1beta2",
     wl() | {"status": {"reclaimablePods": [{"name": "main", "count": 3}]}}, None, "should be less or equal to 2"),
    ("a held PodSet grown", "v1beta2", edit(held(wl()), podSets=[pod_set(count=3)]), held(wl()), "field is immutable"),
    ("a held PodSet's template changed", "v1beta2",
     edit(held(wl()), podSets=[pod_set(template={"spec": {"containers": [{"name": "c", "image": "y"}]}})]), held(wl()),
     "field is immutable"),
    ("a held PodSet's minCount changed", "v1beta2", edit(held(wl(pod_set(count=4, minCount=1))),
                                                         podSets=[pod_set(count=4, minCount=2)]),
     held(wl(pod_set(count=4, minCount=1))), "field is immutable"),
    ("a PodSet added while held", "v1beta2", edit(held(wl()), podSets=[pod_set(), pod_set("b")]), held(wl()),
     "field is immutable"),
    ("the admission changed", "v1beta2", held(wl()) | {"status": {**held(wl())["status"], "admission": {
        "clusterQueue": "other", "podSetAssignments": held(wl())["status"]["admission"]["podSetAssignments"]}}},
     held(wl()), "field is immutable"),
    ("a reclaimable count lowered while held", "v1beta2",
     held(wl()) | {"status": {**held(wl())["status"], "reclaimablePods": [{"name": "main", "count": 0}]}},
     held(wl()) | {"status": {**held(wl())["status"], "reclaimablePods": [{"name": "main", "count": 1}]}},
     "cannot be less than 1"),
]


@pytest.mark.parametrize(("what", "version", "new", "old", "words"), CASES, ids=[c[0] for c in CASES])
def test_each_rule_refuses_a_hand_made_bad_workload(what: str, version: str, new: dict[str, Any],
                                                    old: dict[str, Any] | None, words: str) -> None:
    new = {**new, "spec": {k: v for k, v in new["spec"].items() if v is not None}}
    got = kueue_crds.refusals(new, old, version)
    assert any(words in g for g in got), got


def test_every_cel_rule_has_its_case() -> None:
    """So a rule added to the CRDs needs a bad object here too."""
    messages = {r["message"] for v in ("v1beta2", "v1beta1") for r in _rules(kueue_crds.workload_schema(v))}
    tested = {c[4] for c in CASES}
    missing = [m for m in messages if not any(t in m for t in tested)]
    assert not missing, missing
    assert cel.rules(kueue_crds.workload_schema("v1beta2")) == 13


def _rules(schema: dict[str, Any]) -> list[dict[str, str]]:
    out = list(schema.get("x-kubernetes-validations") or [])
    for sub in (schema.get("properties") or {}).values():
        out += _rules(sub)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            out += _rules(schema[key])
    return out


def test_what_kueue_allows_passes() -> None:
    """The other side: a count may fall on a held PodSet (ElasticJobsViaWorkloadSlices), an
    elastic Workload without minCount, one minCount, a Workload released (admission unset)."""
    assert kueue_crds.refusals(wl()) == []
    base = held(wl(pod_set(count=4)))
    assert kueue_crds.refusals(edit(base, podSets=[pod_set(count=2)]), base) == []
    assert kueue_crds.refusals(wl(annotations={"kueue.x-k8s.io/elastic-job": "true"})) == []
    assert kueue_crds.refusals(wl(pod_set("a", minCount=1), pod_set("b"))) == []
    released = copy.deepcopy(base)
    released["status"] = {"conditions": [cond("QuotaReserved", False, "PendingEvaluation"),
                                         cond("Admitted", False, "NoReservation")]}
    assert kueue_crds.refusals(released, base) == []
    assert kueue_webhook.validate_update(released, base) == []


# --- the controllers ------------------------------------------------------------------------------

def test_partial_admission_lowers_the_one_pod_set_with_a_min_count() -> None:
    w = wl(pod_set("local", 8, minCount=2), pod_set("syncer", 1))
    assert double.fit(w, 9) == {"local": 8, "syncer": 1}
    assert double.fit(w, 4) == {"local": 3, "syncer": 1}
    assert double.fit(w, 2) is None  # under its minCount
    assert double.fit(wl(pod_set("local", 8), pod_set("syncer", 1)), 4) is None  # all or nothing


def at(seconds: float) -> str:
    return double.stamp(datetime(2027, 1, 15, 8, tzinfo=UTC) + timedelta(seconds=seconds))


@pytest.mark.parametrize(("ready", "timed"), [
    (None, ("WaitForStart", 30)),  # timed from the Admitted condition
    (cond("PodsReady", False, "WaitForStart", at(20)), ("WaitForStart", 30)),
    (cond("PodsReady", False, "PodsReady", at(20)), ("WaitForStart", 30)),  # the old reason
    (cond("PodsReady", False, "WaitForRecovery", at(100)), ("WaitForRecovery", 100 + 50)),
    (cond("PodsReady", True, "Started", at(10)), None),
])
def test_the_pods_ready_timeout_is_per_reason(ready: dict[str, Any] | None, timed: tuple[str, float] | None) -> None:
    """admittedNotReadyWorkload: waitForPodsReady.timeout times WaitForStart from the admission,
    recoveryTimeout times WaitForRecovery from PodsReady's transition, and without a
    recoveryTimeout WaitForRecovery is never timed out."""
    w = held(wl())
    w["status"]["conditions"] = [cond("QuotaReserved", when=at(0)), cond("Admitted", when=at(0)),
                                 *([ready] if ready else [])]
    due = double.not_ready_deadline(w, timeout=30, recovery_timeout=50)
    want = None if timed is None else (timed[0], datetime(2027, 1, 15, 8, tzinfo=UTC) + timedelta(seconds=timed[1]))
    assert due == want
    if ready is not None and ready["reason"] == "WaitForRecovery":
        assert double.not_ready_deadline(w, timeout=30, recovery_timeout=None) is None


def test_the_requeue_backoff_doubles_up_to_its_most() -> None:
    """UpdateRequeueState: base x 2^(n-1), at most the maximum."""
    w = wl()
    now = datetime(2027, 1, 15, 8, tzinfo=UTC)
    waits = []
    for _ in range(5):
        state = double.requeue_state(w, base=10, most=60, now=now)
        waits.append((state["count"], (datetime.strptime(state["requeueAt"], "%Y-%m-%dT%H:%M:%SZ")
                                       .replace(tzinfo=UTC) - now).seconds))
        w = {**w, "status": {"requeueState": state}}
    assert waits == [(1, 10), (2, 20), (3, 40), (4, 60), (5, 60)]


def test_a_slice_lowered_in_place_holds_its_count_now() -> None:
    w = held(wl(pod_set("local", 8)), {"local": 8})
    assert double.held(w) == 8
    assert double.held(edit(w, podSets=[pod_set("local", 4)])) == 4  # totalRequestsFromAdmission
