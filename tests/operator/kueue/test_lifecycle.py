"""What the operator writes on a Workload after Kueue decides (operator/kueue/lifecycle.py), and the
elastic admission's slices (operator/kueue/slices.py): pure, no cluster."""

from __future__ import annotations

from typing import Any

import pytest

from diloco.operator.kueue import integration as kueue
from diloco.operator.kueue import lifecycle, queueing, slices
from diloco.operator.render import job as render
from diloco.operator.render import naming as n
from diloco.operator.status.conditions import find
from diloco.spec import SpecError, parse_job

OWNER = render.Owner("demo", "jobs", "uid-1")
NOW = "2026-12-06T08:00:00Z"


def job(replicas: int = 8, min_replicas: int | None = 2, **group: Any) -> Any:
    g = {"name": "local", "replicas": replicas, **({"minReplicas": min_replicas} if min_replicas else {}), **group}
    return parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob",
                      "metadata": {"name": "demo", "namespace": "jobs"},
                      "spec": {"learnerGroups": [g], "syncer": {"fragments": 2}}})


def cond(type_: str, status: bool, reason: str = "") -> dict[str, Any]:
    return {"type": type_, "status": "True" if status else "False", "reason": reason or type_, "message": f"{type_}!"}


def live(desired: dict[str, Any], *conds: dict[str, Any], counts: dict[str, int] | None = None, name: str = "",
         created: str = "2026-12-06T07:00:00Z", annotations: dict[str, str] | None = None) -> dict[str, Any]:
    md = {**desired["metadata"], "name": name or desired["metadata"]["name"], "creationTimestamp": created,
          "resourceVersion": "7", "generation": 1,
          "annotations": {**(desired["metadata"].get("annotations") or {}), **(annotations or {})}}
    status: dict[str, Any] = {"conditions": list(conds)}
    if counts is not None:
        status["admission"] = {"clusterQueue": "cq", "podSetAssignments": [
            {"name": k, "count": v, "flavors": {"cpu": "default"}} for k, v in counts.items()]}
    return {**desired, "metadata": md, "status": status}


HELD = (cond("QuotaReserved", True), cond("Admitted", True))


# --- eviction: the reservation given back once the pods are gone --------------------------------

@pytest.mark.parametrize(("reason", "requeued"), [("Preempted", True), ("NodeFailures", True),
                                                  ("PodsReadyTimeout", False), ("Deactivated", False)])
def test_release_clears_the_admission_as_kueues_jobframework_does(reason: str, requeued: bool) -> None:
    desired = kueue.workload(job(), OWNER, "training")
    wl = live(desired, *HELD, cond("Evicted", True, reason), counts={"local": 8, "syncer": 1})
    out = lifecycle.release(wl, NOW)
    assert out is not None and out["admission"] is None
    conds = out["conditions"]
    assert find(conds, "Requeued")["status"] == ("True" if requeued else "False")
    assert find(conds, "Requeued")["reason"] == reason
    assert (find(conds, "QuotaReserved")["status"], find(conds, "QuotaReserved")["reason"]) == ("False",
                                                                                               "PendingEvaluation")
    assert (find(conds, "Admitted")["status"], find(conds, "Admitted")["reason"]) == ("False", "NoReservation")
    assert find(conds, "Evicted")["status"] == "True"  # Kueue's: it resets it when it admits again
    released = {**wl, "status": out}
    assert not kueue.holds_quota(released) and lifecycle.release(released, NOW) is None
    assert lifecycle.release(live(desired, *HELD, counts={"local": 8}), NOW) is None  # not evicted


def pod(component: str, group: str | None, ready: bool, name: str = "p") -> dict[str, Any]:
    labels = {n.COMPONENT: component, **({n.GROUP: group} if group else {})}
    return {"metadata": {"name": name, "labels": labels},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


@pytest.mark.parametrize("shards", [1, 2])
def test_a_standby_syncer_reserves_its_quota_and_is_not_waited_for(shards: int) -> None:
    standby = parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob",
                         "metadata": {"name": "demo", "namespace": "jobs"},
                         "spec": {"learnerGroups": [{"name": "local", "replicas": 2}],
                                  "syncer": {"fragments": 2, "shards": shards, "standby": {},
                                             "checkpoints": {"url": "s3://ckpt/demo"}}}})
    desired = kueue.workload(standby, OWNER, "training")
    # Each shard's lease holder and its standby both hold a node's worth of requests: Kueue reserves both.
    syncer = next(p for p in desired["spec"]["podSets"] if p["name"] == kueue.SYNCER_POD_SET)
    assert syncer["count"] == 2 * shards and kueue.whole(standby)[kueue.SYNCER_POD_SET] == 2 * shards
    wl = live(desired, *HELD, counts={"local": 2, "syncer": 2 * shards})
    q = queueing.Queued(standby, kueue.gate(wl, "w", "training"), current=wl, admitted=slices.given(wl))
    learners = [pod(n.LEARNER, "local", True, f"l{i}") for i in range(2)]
    holders = [pod(n.SYNCER, None, True, f"s{i}") for i in range(shards)]
    standbys = [pod(n.SYNCER, None, False, f"s{i}-standby") for i in range(shards)]

    def pods_ready(pods: list[dict[str, Any]]) -> str:
        (write,) = queueing.settle(q, pods, finished=False, now=NOW)
        return find(write.status["conditions"], lifecycle.PODS_READY)["status"]

    # A standby is never Ready (its gRPC port opens when it takes the lease): PodsReady waits for the holders.
    assert pods_ready(learners + holders + standbys) == "True"
    assert pods_ready(learners + holders[1:] + standbys) == "False"  # a shard with no lease holder Ready


def test_pods_ready_follows_kueues_reasons_through_a_loss_and_a_recovery() -> None:
    desired = kueue.workload(job(3, None), OWNER, "training")
    wl = live(desired, *HELD, counts={"local": 3, "syncer": 1})
    admitted = slices.given(wl)
    pods = [pod(n.LEARNER, "local", True, f"l{i}") for i in range(3)] + [pod(n.SYNCER, None, True)]
    assert not lifecycle.all_ready(admitted, pods[:2] + pods[3:])
    assert lifecycle.all_ready(admitted, pods)
    steps = []
    for ready in (False, True, True, False, False, True):
        out = lifecycle.pods_ready(wl, ready, NOW)
        if out is not None:
            wl = {**wl, "status": {**wl["status"], **out}}
        got = find(wl["status"]["conditions"], "PodsReady")
        steps.append((got["status"], got["reason"], out is not None))
    assert steps == [("False", "WaitForStart", True), ("True", "Started", True), ("True", "Started", False),
                     ("False", "WaitForRecovery", True), ("False", "WaitForRecovery", False),
                     ("True", "Recovered", True)]
    waiting = live(desired)
    assert find(lifecycle.pods_ready(waiting, True, NOW)["conditions"], "PodsReady")["reason"] == "WaitForStart"


# generatePodsReadyCondition (pkg/controller/jobframework/reconciler.go), case by case: whether the
# Workload is admitted, whether every admitted pod is Ready, the PodsReady condition it has
# (status, reason; None: none) -> the one Kueue writes.
PODS_READY_TABLE = [
    (False, False, None, ("False", "WaitForStart")),
    (False, True, None, ("False", "WaitForStart")),  # not admitted: WaitForStart whatever the pods say
    (False, False, ("True", "Started"), ("False", "WaitForStart")),  # evicted and released
    (False, False, ("False", "WaitForRecovery"), ("False", "WaitForStart")),
    (True, True, None, ("True", "Started")),
    (True, True, ("False", "WaitForStart"), ("True", "Started")),
    (True, True, ("False", "WaitForRecovery"), ("True", "Recovered")),
    (True, True, ("True", "Recovered"), ("True", "Recovered")),
    (True, False, None, ("False", "WaitForStart")),
    (True, False, ("True", "Started"), ("False", "WaitForRecovery")),
    (True, False, ("True", "Recovered"), ("False", "WaitForRecovery")),
    (True, False, ("False", "WaitForRecovery"), ("False", "WaitForRecovery")),
    (True, False, ("False", "WaitForStart"), ("False", "WaitForStart")),
    (True, False, ("False", "PodsReady"), ("False", "WaitForStart")),  # the old reason
]


@pytest.mark.parametrize(("admitted", "ready", "old", "want"), PODS_READY_TABLE)
def test_pods_ready_is_generate_pods_ready_condition(admitted: bool, ready: bool, old: tuple[str, str] | None,
                                                     want: tuple[str, str]) -> None:
    desired = kueue.workload(job(3, None), OWNER, "training")
    conds = [*HELD] if admitted else [cond("QuotaReserved", False, "PendingEvaluation"),
                                      cond("Admitted", False, "NoReservation")]
    if old is not None:
        conds.append(cond("PodsReady", old[0] == "True", old[1]))
    wl = live(desired, *conds, counts={"local": 3, "syncer": 1} if admitted else None)
    out = lifecycle.pods_ready(wl, ready, NOW)
    got = find((out or wl["status"])["conditions"], "PodsReady")
    assert (got["status"], got["reason"]) == want
    assert (out is None) == (old == want)  # written only when it changes


def test_a_preempted_job_admitted_again_waits_for_start_then_starts() -> None:
    """Issue 61, fix 1: PodsReady is written while the Workload is evicted, so a job admitted
    again goes WaitForStart (which waitForPodsReady.timeout times), then Started, not WaitForRecovery."""
    desired = kueue.workload(job(2, None), OWNER, "training")
    pods = [pod(n.LEARNER, "local", True, f"l{i}") for i in range(2)] + [pod(n.SYNCER, None, True)]
    wl = live(desired, *HELD, cond("PodsReady", True, "Started"), counts={"local": 2, "syncer": 1})
    evicted = {**wl, "status": {**wl["status"], "conditions": [*wl["status"]["conditions"],
                                                               cond("Evicted", True, "Preempted")]}}

    def settle(w: dict[str, Any], job_pods: list[dict[str, Any]], admitted: dict[str, int]) -> dict[str, Any]:
        q = queueing.Queued(job(2, None), kueue.Gate(True, False, "Evicted", ""), current=w, admitted=admitted)
        for write in queueing.settle(q, job_pods, finished=False, now=NOW):
            w = {**w, "status": {**w["status"], **write.status}}
        return w

    def ready_of(w: dict[str, Any]) -> tuple[str, str]:
        got = find(w["status"]["conditions"], "PodsReady")
        return got["status"], got["reason"]

    going = settle(evicted, pods[1:], {})  # a learner gone, quota still held: the pods are not all ready
    assert ready_of(going) == ("False", "WaitForRecovery") and going["status"].get("admission")
    released = settle(going, [], {})
    assert released["status"]["admission"] is None and ready_of(released) == ("False", "WaitForStart")
    again = {**released, "status": {"conditions": [*[x for x in released["status"]["conditions"]
                                                     if x["type"] not in ("QuotaReserved", "Admitted", "Evicted")],
                                                   *HELD, cond("Evicted", False, "QuotaReserved")],
                                    "admission": {"clusterQueue": "cq", "podSetAssignments": [
                                        {"name": "local", "count": 2}, {"name": "syncer", "count": 1}]}}}
    admitted = {"local": 2, "syncer": 1}
    assert ready_of(settle(again, [], admitted)) == ("False", "WaitForStart")
    assert ready_of(settle(again, pods, admitted)) == ("True", "Started")


def test_stopped_only_when_no_pod_of_the_job_is_left() -> None:
    assert lifecycle.stopped([])
    terminating = pod(n.LEARNER, "local", False)
    terminating["metadata"]["deletionTimestamp"] = NOW
    assert not lifecycle.stopped([terminating])  # it still holds its node
    assert not lifecycle.stopped([pod(n.SYNCER, None, True)])


# --- elastic admission ------------------------------------------------------------------------------

def test_the_first_workload_takes_partial_admission_on_one_pod_set_and_is_not_marked_elastic() -> None:
    wl = kueue.workload(job(8, 2), OWNER, "training")
    local, syncer = wl["spec"]["podSets"]
    assert (local["count"], local["minCount"]) == (8, 2) and "minCount" not in syncer
    # Kueue refuses minCount beside the elastic annotation (workload_webhook.go, ValidateWorkload).
    assert kueue.ELASTIC not in (wl["metadata"].get("annotations") or {})
    assert wl["metadata"]["finalizers"] == [kueue.FINALIZER] and wl["metadata"]["labels"][kueue.JOB_UID_LABEL] == "uid-1"
    plain = kueue.workload(job(8, None), OWNER, "training")
    assert "minCount" not in plain["spec"]["podSets"][0]
    assert "minCount" not in kueue.workload(job(8, 8), OWNER, "training")["spec"]["podSets"][0]


def test_two_groups_with_min_replicas_one_min_count_the_other_starts_at_its_least() -> None:
    two = parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob",
                     "metadata": {"name": "demo", "namespace": "jobs"},
                     "spec": {"learnerGroups": [{"name": "a", "replicas": 4, "minReplicas": 1},
                                                {"name": "b", "replicas": 6, "minReplicas": 2}],
                              "syncer": {"fragments": 2}}})
    a, b, _ = kueue.workload(two, OWNER, "training")["spec"]["podSets"]
    assert (a["count"], a["minCount"]) == (4, 1) and (b["count"], "minCount" in b) == (6 - 4, False)
    assert kueue.whole(two) == {"a": 4, "b": 6, "syncer": 1}


@pytest.mark.parametrize(("group", "field"), [({"replicas": 2, "minReplicas": 3}, "minReplicas: 3 exceeds"),
                                              ({"replicas": 2, "minReplicas": 1, "hostsPerLearner": 2},
                                               "multi-host")])
def test_min_replicas_refused_where_it_cannot_hold(group: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError, match=field):
        parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "d"},
                   "spec": {"learnerGroups": [{"name": "g", **group}]}})


def test_a_partial_admission_runs_what_was_given_and_queues_a_slice_for_the_rest() -> None:
    desired = kueue.workload(job(8, 2), OWNER, "training")
    held = live(desired, *HELD, counts={"local": 3, "syncer": 1})
    plan = slices.plan(desired, [held], generation=1, whole=kueue.whole(job(8, 2)))
    assert plan.held is held and plan.admitted == {"local": 3, "syncer": 1}
    first, grow = plan.workloads
    assert first["metadata"]["name"] == held["metadata"]["name"]
    assert (first["spec"]["podSets"][0]["count"], first["spec"]["podSets"][0]["minCount"]) == (8, 2)  # unchanged
    assert kueue.ELASTIC not in (first["metadata"].get("annotations") or {})
    assert grow["metadata"]["name"] == f"{desired['metadata']['name']}-1"
    ann = grow["metadata"]["annotations"]
    assert ann[slices.REPLACEMENT_FOR] == f"jobs/{held['metadata']['name']}"
    assert ann[slices.SLICE_NAME] == held["metadata"]["name"] and ann[kueue.ELASTIC] == "true"
    assert [(p["count"], "minCount" in p) for p in grow["spec"]["podSets"]] == [(8, False), (1, False)]
    running = slices.running(job(8, 2), plan.admitted)
    assert running.spec.learner_groups[0].replicas == 3
    whole = slices.running(job(8, 2), {"local": 8, "syncer": 1})
    # The same shards either way: learner i of a partial job reads what it would in the whole one.
    assert [running.spec.shard_of("local", i) for i in range(3)] == [whole.spec.shard_of("local", i) for i in range(3)]
    assert running.spec.learner_inputs("local") == whole.spec.learner_inputs("local")


def test_once_kueue_admits_the_slice_and_finishes_the_old_one_the_job_runs_whole() -> None:
    desired = kueue.workload(job(8, 2), OWNER, "training")
    old = live(desired, *HELD, counts={"local": 3, "syncer": 1})
    name = f"{desired['metadata']['name']}-1"
    grown = live(slices.plan(desired, [old], generation=1).workloads[1], *HELD, name=name,
                 counts={"local": 8, "syncer": 1}, created="2026-12-06T07:05:00Z")
    both = slices.plan(desired, [old, grown], generation=1)  # admitted, the old not finished yet
    assert both.held is grown and both.admitted["local"] == 8
    old_done = {**old, "status": {**old["status"], "conditions": [*HELD, cond("Finished", True,
                                                                               "WorkloadSliceReplaced")]}}
    plan = slices.plan(desired, [old_done, grown], generation=1)
    assert plan.held is grown and [w["metadata"]["name"] for w in plan.workloads] == [name]  # the old one goes
    kept = plan.workloads[0]
    assert kept["metadata"]["annotations"][slices.REPLACEMENT_FOR].endswith(old["metadata"]["name"])
    assert kept["metadata"]["annotations"][kueue.ELASTIC] == "true" and "minCount" not in kept["spec"]["podSets"][0]


def test_a_held_slice_shrinks_in_place_and_growing_again_queues_another() -> None:
    desired8 = kueue.workload(job(8, 2), OWNER, "training")
    held = live({**desired8, "spec": {**desired8["spec"], "podSets": [
        {k: v for k, v in p.items() if k != "minCount"} for p in desired8["spec"]["podSets"]]}},
        *HELD, counts={"local": 8, "syncer": 1}, annotations={kueue.ELASTIC: "true"})
    desired5 = kueue.workload(job(5, 2), OWNER, "training")
    assert not slices.stale(held, desired5, whole=kueue.whole(job(5, 2)), elastic=True)  # only counts differ
    plan = slices.plan(desired5, [held], generation=2, whole=kueue.whole(job(5, 2)))
    assert [w["spec"]["podSets"][0]["count"] for w in plan.workloads] == [5] and plan.admitted["local"] == 5
    assert "minCount" not in plan.workloads[0]["spec"]["podSets"][0]
    grow = slices.plan(kueue.workload(job(10, 2), OWNER, "training"), [held], generation=3,
                       whole=kueue.whole(job(10, 2)))
    assert [w["spec"]["podSets"][0]["count"] for w in grow.workloads] == [8, 10] and grow.admitted["local"] == 8
    other = kueue.workload(job(8, 2, resources={"requests": {"cpu": "2"}}), OWNER, "training")
    assert slices.stale(held, other, elastic=True)  # anything but a count still replaces it


def test_the_held_first_workload_is_never_changed_and_asking_below_what_it_was_given_replaces_it() -> None:
    desired8 = kueue.workload(job(8, 2), OWNER, "training")
    held = live(desired8, *HELD, counts={"local": 3, "syncer": 1})
    fewer = kueue.workload(job(5, 2), OWNER, "training")
    assert not slices.stale(held, fewer, whole=kueue.whole(job(5, 2)), elastic=True)
    plan = slices.plan(fewer, [held], generation=2, whole=kueue.whole(job(5, 2)))
    assert plan.workloads[0]["spec"]["podSets"][0]["count"] == 8  # as it was admitted
    assert plan.workloads[1]["spec"]["podSets"][0]["count"] == 5  # the slice asks for the new whole
    assert slices.stale(held, kueue.workload(job(2, 1), OWNER, "training"), whole=kueue.whole(job(2, 1)),
                        elastic=True)  # two learners are fewer than the three it runs on
    assert kueue.stale(held, fewer)  # a job that is not elastic would be replaced


def test_nothing_held_queues_the_first_workload_under_the_name_it_has() -> None:
    desired = kueue.workload(job(8, 2), OWNER, "training")
    assert [w["metadata"]["name"] for w in slices.plan(desired, [], generation=1).workloads] == \
        [desired["metadata"]["name"]]
    requeued = live(desired, cond("QuotaReserved", False), cond("Evicted", True, "Preempted"), name="x-1",
                    annotations={kueue.ELASTIC: "true", slices.REPLACEMENT_FOR: "jobs/gone"})
    plan = slices.plan(desired, [requeued], generation=1)
    assert plan.held is None and plan.waiting is requeued and plan.admitted == {}
    (again,) = plan.workloads
    assert again["metadata"]["name"] == "x-1" and again["spec"]["podSets"][0]["minCount"] == 2  # partial again
    assert not set(again["metadata"].get("annotations") or {}) & {kueue.ELASTIC, slices.REPLACEMENT_FOR}
