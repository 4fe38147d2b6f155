"""Waiting for capacity, pure: not a failure, a condition and an Event, and the explicit timeout."""

from __future__ import annotations

from typing import Any

from diloco.operator.failures import capacity
from diloco.operator.failures import policy as failures
from diloco.operator.render import naming as n
from diloco.operator.status import conditions
from diloco.operator.status import job as st
from diloco.spec import JobSpec, parse_job

T0 = 1_800_000_000.0
SCHEDULER = "0/3 nodes are available: 3 Insufficient google.com/tpu."


def spec(**run_policy: Any) -> JobSpec:
    return parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "demo"},
                      "spec": {"learnerGroups": [{"name": "us", "replicas": 2}],
                               "runPolicy": {"backoffLimit": 0, **run_policy}}}).spec


def pod(name: str, since: float | None, component: str = n.LEARNER, **meta: Any) -> dict[str, Any]:
    """A pod the scheduler could not place since `since` (None: scheduled and running)."""
    labels = {**n.selector("demo", component, "us" if component == n.LEARNER else None), n.INDEX: name[-1]}
    sched = ({"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": SCHEDULER,
              "lastTransitionTime": st.rfc3339(since)} if since is not None
             else {"type": "PodScheduled", "status": "True", "lastTransitionTime": st.rfc3339(T0)})
    return {"metadata": {"name": name, "uid": f"uid-{name}", "labels": labels, **meta},
            "status": {"phase": "Pending" if since is not None else "Running", "conditions": [sched]}}


def observe(pods: list[dict[str, Any]], now: float) -> st.Observation:
    return st.Observation(now=now, syncer_endpoint="demo-syncer:1", syncer_ready=True,
                          unschedulable=tuple(capacity.waiting(pods, now)))


def test_unschedulable_pods_are_listed_longest_first_with_the_schedulers_message() -> None:
    pods = [pod("demo-us-1", T0 + 60), pod("demo-us-0", T0), pod("demo-syncer-x", None, n.SYNCER),
            pod("demo-us-2", T0, deletionTimestamp=st.rfc3339(T0 + 1))]  # going anyway
    found = capacity.waiting(pods, T0 + 100)
    assert [(w.pod, w.who, w.seconds(T0 + 100)) for w in found] == [("demo-us-0", "learner us-0", 100.0),
                                                                    ("demo-us-1", "learner us-1", 40.0)]
    assert found[0].message == SCHEDULER


def test_a_job_waiting_for_capacity_stays_pending_with_a_condition_and_never_fails_by_default() -> None:
    s = spec()
    pods = [pod("demo-us-0", T0), pod("demo-us-1", T0)]
    status: dict[str, Any] = {}
    for later in (0, 300, 301, 86_400):  # past the old 300 s grace, and a day
        o = observe(pods, T0 + later)
        assert st.ending(s, status, o) is None
        status = st.compute(s, status, o, generation=1)
        patch, fresh = failures.fold(status, pods, T0 + later)
        assert (patch, fresh) == ({}, []) and "failures" not in status  # backoffLimit 0: nothing counted
    assert status["phase"] == "Pending"
    waiting = conditions.find(status["conditions"], conditions.PODS_UNSCHEDULABLE)
    assert waiting is not None and (waiting["status"], waiting["reason"]) == ("True", "Unschedulable")
    assert waiting["lastTransitionTime"] == st.rfc3339(T0)  # one wait, not a flapping condition
    message = waiting["message"]
    assert f"pod demo-us-0 (learner us-0) is waiting for capacity, unschedulable since {st.rfc3339(T0)}" in message
    assert waiting == conditions.find(st.compute(s, status, observe(pods, T0 + 86_410), generation=1)["conditions"],
                                      conditions.PODS_UNSCHEDULABLE)  # the same from pass to pass: no write
    assert SCHEDULER in message and "(and 1 more pods)" in message and "add capacity" in message
    assert "schedulingTimeoutSeconds is unset, so the job waits for capacity" in message


def test_scheduling_timeout_seconds_ends_the_job_failed_naming_the_timeout() -> None:
    s = spec(schedulingTimeoutSeconds=600)
    pods = [pod("demo-us-0", T0), pod("demo-us-1", None)]
    assert st.ending(s, {}, observe(pods, T0 + 599)) is None
    assert "the job fails after spec.runPolicy.schedulingTimeoutSeconds=600" in capacity.message(
        capacity.waiting(pods, T0 + 599), 600)
    ended = st.ending(s, {}, observe(pods, T0 + 600))
    assert ended is not None and (ended.succeeded, ended.reason) == (False, "SchedulingTimeoutExceeded")
    assert ended.message == (f"pod demo-us-0 (learner us-0) could not be scheduled for 600 s, past "
                             f"spec.runPolicy.schedulingTimeoutSeconds=600: {SCHEDULER}")
    done = st.compute(s, {}, observe(pods, T0 + 600), generation=1, ended=ended)
    assert done["phase"] == "Failed"
    assert conditions.find(done["conditions"], conditions.FAILED)["reason"] == "SchedulingTimeoutExceeded"


def test_the_active_deadline_counts_the_wait_too() -> None:
    s = spec(activeDeadlineSeconds=900)
    status = st.compute(s, {}, observe([pod("demo-us-0", T0)], T0), generation=1)  # the clock starts Pending
    ended = st.ending(s, status, observe([pod("demo-us-0", T0)], T0 + 900))
    assert ended is not None and ended.reason == "DeadlineExceeded"


def test_the_condition_clears_once_scheduled_and_is_absent_on_jobs_that_never_waited() -> None:
    s = spec()
    assert conditions.find(st.compute(s, {}, observe([pod("demo-us-0", None)], T0), generation=1)["conditions"],
                           conditions.PODS_UNSCHEDULABLE) is None
    waited = st.compute(s, {}, observe([pod("demo-us-0", T0)], T0 + 10), generation=1)
    placed = st.compute(s, waited, observe([pod("demo-us-0", None)], T0 + 20), generation=1)
    cleared = conditions.find(placed["conditions"], conditions.PODS_UNSCHEDULABLE)
    assert cleared is not None and (cleared["status"], cleared["reason"]) == ("False", "PodsScheduled")


def test_the_event_is_due_once_per_wait() -> None:
    s = spec()
    first = st.compute(s, {}, observe([pod("demo-us-0", T0)], T0), generation=1)
    due = capacity.started_waiting([], first["conditions"])
    assert due is not None and SCHEDULER in due["message"]
    again = st.compute(s, first, observe([pod("demo-us-0", T0)], T0 + 10), generation=1)
    assert capacity.started_waiting(first["conditions"], again["conditions"]) is None  # still the same wait
    longer = st.compute(s, again, observe([pod("demo-us-0", T0), pod("demo-us-1", T0 + 12)], T0 + 15), generation=1)
    assert capacity.started_waiting(again["conditions"], longer["conditions"]) is None  # another pod waits too
    first_placed = st.compute(s, longer, observe([pod("demo-us-0", None), pod("demo-us-1", T0 + 12)], T0 + 18),
                              generation=1)
    due = capacity.started_waiting(longer["conditions"], first_placed["conditions"])  # now us-1 is the wait
    assert due is not None and due["message"].startswith("pod demo-us-1 (learner us-1) is waiting")
    placed = st.compute(s, again, observe([], T0 + 20), generation=1)
    waits_again = st.compute(s, placed, observe([pod("demo-us-1", T0 + 30)], T0 + 30), generation=1)
    assert capacity.started_waiting(placed["conditions"], waits_again["conditions"]) is not None


def test_a_pod_gated_past_the_grace_waits_by_its_gates_name() -> None:
    gated = pod("demo-us-0", T0)
    gated["status"]["conditions"][0].update(reason=capacity.GATED, message="Scheduling is blocked due to non-empty "
                                                                           "scheduling gates")
    gated["spec"] = {"schedulingGates": [{"name": "kueue.x-k8s.io/topology"}, {"name": "example.com/mine"}]}
    assert capacity.waiting([gated], T0 + capacity.GATE_GRACE - 1) == []  # an ungater acts within seconds
    (w,) = capacity.waiting([gated], T0 + capacity.GATE_GRACE + 1)
    assert w.gated and "scheduling gate kueue.x-k8s.io/topology (Kueue's TopologyUngater" in w.message
    assert "scheduling gate example.com/mine (whoever added it must remove it)" in w.message
    text = capacity.message([w], None)
    assert "gated since" in text and capacity.GATE_FIX in text and capacity.FIX not in text
    cond = capacity.condition([], [w], timeout=None, stamp=st.rfc3339(T0), generation=1)
    assert capacity.started_waiting([], cond) is not None  # its Warning Event, as for an Unschedulable pod
