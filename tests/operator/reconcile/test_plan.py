"""The reconcile's plan as tables: what one pass observed -> what it decides (operator/reconcile/plan.py).

No cluster, no client, no clock: each row builds an Observed as observe.observe would
have read it and checks the Plan (children, status, Events and counts, pod deletions, Kueue's
writes) through the main phases of a job: new, running, a learner lost and back, queued,
admitted and evicted by Kueue, finished, failed, past its TTL.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, cast

import pytest

from diloco.contract import Finished, LearnerId
from diloco.operator.context import Config, Context
from diloco.operator.failures import capacity, gangs, pod_refusals, pods, readmission, refusals
from diloco.operator.kueue import integration as kueue
from diloco.operator.kueue import queueing
from diloco.operator.reconcile import children, passes
from diloco.operator.reconcile.actions import Count, Event, PodDelete
from diloco.operator.reconcile.loading import effective
from diloco.operator.reconcile.observe import Observed
from diloco.operator.reconcile.plan import (
    Failing,
    Plan,
    Slots,
    blocker_events,
    desired_children,
    force_deletes,
    invalid,
    job_status,
    learner_slots,
    link_and_blocker,
    plan,
    pod_failures,
    readmit_ready,
    settle,
    settle_gang,
    settle_gangs,
    status_events,
    through_kueue,
    workload_writes,
)
from diloco.operator.render import access
from diloco.operator.render import naming as n
from diloco.operator.status import conditions as c
from diloco.operator.status import job as st
from diloco.spec import KIND

T0 = 1_800_000_000.0
TOKEN = "t" * 43
PLAIN, QUEUED = Config(), Config(kueue=True)  # the operator without Kueue, and its Kueue integration on


def body(status: dict[str, Any] | None = None, labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob",
            "metadata": {"name": "demo", "namespace": "ml", "uid": "uid-1", "generation": 1, "labels": labels or {}},
            "spec": {"learnerGroups": [{"name": "us", "replicas": 2}], "training": {"steps": 100}, **spec},
            **({"status": status} if status is not None else {})}


def observed(b: dict[str, Any], *, config: Config = PLAIN, now: float = T0, **read: Any) -> Observed:
    job, problems, refused = effective(b)
    return Observed(b, config, now, job, problems, refused, kueue.queue(config.kueue, b["metadata"]["labels"]),
                    token=TOKEN, **read)


def applied(p: Plan) -> dict[children.Key, Any]:
    """The children the plan writes, as the API server would then hold them: the syncer ready,
    every learner pod there."""
    out = {}
    for obj in p.children.apply:
        obj = copy.deepcopy(obj)
        obj["metadata"] = {**obj["metadata"], "uid": f"uid-{obj['metadata']['name']}"}
        if obj["kind"] in ("Deployment", "StatefulSet"):
            want = (obj.get("spec") or {}).get("replicas", 1)
            obj["status"] = {"replicas": want, "readyReplicas": want}
        out[children.key(obj)] = obj
    return out


def learner(index: int, ready: bool = True, state: dict[str, Any] | None = None, **meta: Any) -> dict[str, Any]:
    cs = {"name": n.LEARNER, "restartCount": 0, "state": state or {"running": {"startedAt": st.rfc3339(T0)}}}
    return {"metadata": {"name": f"demo-us-{index}", "uid": f"pod-{index}",
                         "labels": {**n.selector("demo", n.LEARNER, "us"), n.INDEX: str(index)}, **meta},
            "status": {"phase": "Running", "containerStatuses": [cs],
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def syncer_pod() -> dict[str, Any]:
    return {"metadata": {"name": "demo-syncer-0", "uid": "pod-s", "labels": n.selector("demo", n.SYNCER)},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}


def view(active: int = 2) -> st.SyncerView:
    return st.SyncerView(incarnation="i1", outer_version=3, tokens_merged=1000, active_learners=active, readmissions=0)


def done(index: int) -> dict[str, Any]:
    """Learner us-`index`'s pod once it reached spec.training.steps and exited 0."""
    return learner(index, ready=False, state={"terminated": {"exitCode": 0, "reason": "Completed",
                                                             "message": Finished(f"us-{index}", 100, 100).line()}})


def reasons(p: Plan) -> list[str]:
    return [e.reason for e in (*p.early, *p.events) if isinstance(e, Event)]


def kinds(objs: list[dict[str, Any]] | None) -> set[children.Key]:
    return {children.key(o) for o in objs or []}


def condition(p: Plan, type_: str) -> tuple[str, str]:
    found = c.find(p.status.get("conditions") or [], type_) or {}
    return found.get("status", ""), found.get("reason", "")


# --- the job's own phases -------------------------------------------------------------------------

NEW = plan(observed(body()), T0)
RUNNING_LIVE = applied(NEW)
RUNNING_PODS = [learner(0), learner(1), syncer_pod()]


def running(status: dict[str, Any] | None = None, pods_: list[dict[str, Any]] | None = None,
            **spec: Any) -> Observed:
    return observed(body(NEW.status if status is None else status, **spec), live=RUNNING_LIVE,
                    pods=RUNNING_PODS if pods_ is None else pods_, syncer=(view(), ""))


def lost(index: int) -> dict[str, Any]:
    """The running status with learner us-`index` counted lost (as the pod-event pass counts it)."""
    before = plan(running(), T0).status
    patch = pods.record_loss(before, LearnerId("us", index), lost=pods.Loss("Deleted", "pod deleted"),
                             pod_uid=f"pod-{index}", now=T0)
    assert patch is not None
    return {**before, **patch}


def test_a_new_job_creates_its_children_and_shows_pending() -> None:
    assert NEW.outcome == "ok" and NEW.status["phase"] == "Pending"
    assert {("Deployment", "demo-syncer"), ("StatefulSet", "demo-us"), ("Secret", "demo-token"),
            ("ConfigMap", "demo-config")} <= kinds(NEW.children.apply)
    assert NEW.children.delete == [] and reasons(NEW) == [] and NEW.pod_deletes == ()
    assert NEW.suspend is None and NEW.workload_writes == () and NEW.delete_job is None
    assert condition(NEW, c.RUNNING) == ("False", "NotRunning")


# Each row: name, what was observed, then what the plan must hold.
ROWS: list[tuple[str, Callable[[], Observed], dict[str, Any]]] = [
    ("running: nothing to write, the status says so", lambda: running(),
     {"phase": "Running", "learners": "2/2", "apply": set(), "delete": set(), "events": []}),
    ("a learner lost, its pod not back yet: still counted lost",
     lambda: running(lost(1), [learner(0), learner(1, ready=False), syncer_pod()]),
     {"learners": "1/2", "lost": ["us-1"], "apply": set(), "events": [], "counts": []}),
    ("a lost learner's pod ready again: re-admitted, once",
     lambda: running(lost(1)),
     {"learners": "2/2", "lost": [], "events": ["LearnerReadmitted"],
      "counts": [Count("readmissions", ("ml", "demo", "us"))]}),
    ("suspended: the learners' and the syncer's pods go with what serves them, the state stays",
     lambda: running(suspend=True, pods_=[]),
     {"phase": "Suspended", "apply": {("ConfigMap", "demo-config")}, "delete": {("StatefulSet", "demo-us"), ("Service", "demo-us"),
                                                       ("Deployment", "demo-syncer"),
                                                       ("PodDisruptionBudget", "demo-syncer")}}),
    ("every learner reached spec.training.steps: Succeeded, and its pods go with one sync",
     lambda: running(pods_=[done(0), done(1), syncer_pod()]),
     {"phase": "Succeeded", "events": ["StepsReached"], "delete_kinds": {"StatefulSet", "Deployment", "Service", "PodDisruptionBudget"}}),
]


@pytest.mark.parametrize(("row", "seen", "want"), ROWS, ids=[r[0] for r in ROWS])
def test_the_jobs_phases(row: str, seen: Callable[[], Observed], want: dict[str, Any]) -> None:
    p = plan(seen(), T0 + 10)
    assert p.outcome == "ok"
    checks = {
        "phase": lambda: p.status["phase"],
        "learners": lambda: p.status["learners"],
        "lost": lambda: [x["slot"] for x in pods.open_losses(p.status)],
        "apply": lambda: kinds(p.children.apply),
        "delete": lambda: kinds(p.children.delete),
        "delete_kinds": lambda: {k for k, _ in kinds(p.children.delete)},
        "events": lambda: reasons(p),
        "counts": lambda: [e for e in p.events if isinstance(e, Count)],
    }
    for key, expected in want.items():
        assert checks[key]() == expected, key


def test_a_finished_job_is_left_alone_then_deleted_past_its_ttl() -> None:
    ended = plan(running(pods_=[done(0), done(1), syncer_pod()]), T0 + 10).status
    again = plan(running(ended, [], runPolicy={"ttlSecondsAfterFinished": 60}), T0 + 20)
    assert again.status["phase"] == "Succeeded" and reasons(again) == [] and again.delete_job is None
    gone = plan(running(ended, [], runPolicy={"ttlSecondsAfterFinished": 60}), T0 + 100)
    assert gone.delete_job is not None and gone.delete_job.reason == "TTLExpired"


def test_an_invalid_spec_fails_the_job_once_and_touches_no_child() -> None:
    bad = body(learnerGroups=[{"name": "us", "replicas": 2, "hostsPerLearner": 0}])
    p = plan(observed(bad), T0)
    assert p.outcome == "invalid" and p.desired is None and p.children.apply == []
    assert p.status["phase"] == "Failed" and condition(p, c.FAILED) == ("True", "InvalidSpec")
    assert reasons(p) == ["InvalidSpec"]
    assert settle(p, [], None).patch["phase"] == "Failed"
    told = plan(observed({**bad, "status": p.status}), T0 + 5)
    assert reasons(told) == [] and settle(told, [], None).patch == {}  # said once


def test_a_pod_stuck_terminating_is_force_deleted_and_told_only_once_deleted() -> None:
    stuck = learner(1, deletionTimestamp=st.rfc3339(T0 - 1000))
    p = plan(running(pods_=[learner(0), stuck, syncer_pod()]), T0)
    (delete,) = p.pod_deletes
    assert delete == PodDelete("demo-us-1", "pod-1", grace_seconds=0, then=(
        Count("forced_deletions", ("ml", "demo")),
        Event("PodForceDeleted", "pod demo-us-1 was Terminating past its grace period by over 120 s", warning=True)))


def test_refused_child_writes_show_on_the_status_once_known() -> None:
    p = plan(observed(body()), T0)
    refusal = refusals.Refusal("StatefulSet", "demo-us", "create", refusals.QUOTA, "exceeded quota: pods")
    done_ = settle(p, [refusal], None)
    assert c.is_true(done_.status["conditions"], "ChildrenRefused")
    assert Count("refused_writes", ("StatefulSet", refusals.QUOTA)) in done_.events
    assert [e.reason for e in done_.events if isinstance(e, Event)] == [refusals.QUOTA]
    assert settle(p, [], None).status == p.status  # nothing refused: the plan's status as it is


def test_a_pod_the_kubelet_will_not_start_shows_with_the_refusals_read_after_the_writes() -> None:
    p = plan(running(), T0)
    assert p.pods == RUNNING_PODS  # read for refusals once the children are written
    stuck = learner(1, ready=False, state={"waiting": {"reason": pod_refusals.CONFIG_WAITING,
                                                       "message": 'secret "s3" not found'}})
    done_ = settle(p, [], pod_refusals.Observed([], [learner(0), stuck]))
    assert c.is_true(done_.status["conditions"], "ChildrenRefused")
    assert [e.reason for e in done_.events if isinstance(e, Event)] == [refusals.CONFIG]
    ended = plan(running(plan(running(pods_=[done(0), done(1), syncer_pod()]), T0 + 10).status, []), T0 + 20)
    assert ended.pods is None  # a finished job's pods are not read for refusals


# --- Kueue -------------------------------------------------------------------------------------------

QUEUE = {kueue.QUEUE_LABEL: "training"}
SERVED = queueing.Seen("v1beta2")


def workload(*conds: tuple[str, bool, str], admission: bool = True) -> dict[str, Any]:
    """The job's Workload as Kueue holds it, with `conds` (type, status, reason)."""
    p = plan(observed(body(labels=QUEUE), config=QUEUED, kueue=SERVED), T0)
    (wl,) = [o for o in p.children.apply if o["kind"] == kueue.KIND]
    status: dict[str, Any] = {"conditions": [{"type": t, "status": "True" if s else "False", "reason": r,
                                              "message": f"{r}!"} for t, s, r in conds]}
    if admission:
        status["admission"] = {"clusterQueue": "cq", "podSetAssignments": [
            {"name": ps["name"], "count": ps["count"], "flavors": {}} for ps in wl["spec"]["podSets"]]}
    return {**wl, "metadata": {**wl["metadata"], "uid": "wl-uid", "resourceVersion": "7", "generation": 1,
                               "creationTimestamp": "2026-12-06T07:00:00Z"}, "status": status}


ADMITTED = workload(("QuotaReserved", True, "QuotaReserved"), ("Admitted", True, "Admitted"))
EVICTED = workload(("QuotaReserved", True, "QuotaReserved"), ("Admitted", True, "Admitted"),
                   ("Evicted", True, "Preempted"))


def queued(wl: dict[str, Any] | None, *, suspend: bool, pods_: list[dict[str, Any]] | None = None,
           status: dict[str, Any] | None = None, seen: queueing.Seen = SERVED) -> Observed:
    live = {**RUNNING_LIVE, **({children.key(wl): wl} if wl is not None else {})}
    return observed(body(status or {}, labels=QUEUE, suspend=suspend), config=QUEUED, live=live,
                    pods=pods_ or [], kueue=seen, syncer=(view(), ""))


def test_queued_the_job_waits_suspended_with_its_workload_written() -> None:
    p = plan(observed(body(labels=QUEUE), config=QUEUED, kueue=SERVED), T0)
    assert p.suspend is True and reasons(p) == ["WaitingForAdmission"]
    assert ("Workload", kueue.workload_name("demo", "uid-1")) in kinds(p.children.apply)
    assert ("StatefulSet", "demo-us") not in kinds(p.desired)  # no learner before Kueue admits
    assert condition(p, kueue.JOB_ADMITTED) == ("False", "WaitingForAdmission")
    waiting = plan(queued(None, suspend=True), T0)
    assert waiting.suspend is None and reasons(waiting) == []  # suspended already: nothing to flip or tell


def test_admitted_the_job_is_resumed_and_its_learners_rendered() -> None:
    p = plan(queued(ADMITTED, suspend=True), T0)
    assert p.suspend is False and reasons(p) == ["Admitted"]
    assert ("StatefulSet", "demo-us") in kinds(p.desired)
    assert condition(p, kueue.JOB_ADMITTED) == ("True", "Admitted")
    (ready,) = p.workload_writes  # PodsReady: not yet, no pod is
    assert c.find(ready.status["conditions"], "PodsReady")["reason"] == "WaitForStart" and ready.event is None


def test_evicted_the_job_stops_and_gives_its_quota_back_once_its_pods_are_gone() -> None:
    stopping = plan(queued(EVICTED, suspend=False, pods_=[learner(0)]), T0)
    assert stopping.suspend is True and reasons(stopping) == ["Evicted"]
    (ready,) = stopping.workload_writes  # PodsReady as Kueue writes it before it handles the eviction
    assert ready.event is None and "admission" not in ready.status
    assert {(x["type"], x["status"], x["reason"]) for x in ready.status["conditions"]} >= {
        ("PodsReady", "False", "WaitForStart")}
    assert ("StatefulSet", "demo-us") in kinds(stopping.children.delete)
    gone = plan(queued(EVICTED, suspend=True), T0)
    (release,) = gone.workload_writes
    assert release.status["admission"] is None and release.event is not None
    assert release.event.reason == "QuotaReleased" and "Preempted" in release.event.message
    # Not admitted any more: PodsReady False/WaitForStart (generatePodsReadyCondition), in the same write.
    assert {(x["type"], x["status"], x["reason"]) for x in release.status["conditions"]} >= {
        ("PodsReady", "False", "WaitForStart"), ("Admitted", "False", "NoReservation")}


def test_a_finished_queued_job_marks_its_workload_finished() -> None:
    p = plan(queued(ADMITTED, suspend=False, pods_=[done(0), done(1), syncer_pod()],
                    status=plan(running(), T0).status), T0 + 10)
    assert p.status["phase"] == "Succeeded"
    (finish,) = p.workload_writes
    marked = c.find(finish.status["conditions"], kueue.FINISHED) or {}
    assert (marked.get("status"), marked.get("reason")) == ("True", "Succeeded") and finish.event is None


def test_kueue_not_served_suspends_the_job_and_says_so_once() -> None:
    p = plan(queued(None, suspend=False, seen=queueing.Seen(None, "the server could not find the resource")), T0)
    assert p.suspend is True and reasons(p) == ["KueueNotServed"]
    assert condition(p, kueue.JOB_ADMITTED) == ("False", "KueueNotServed")
    again = plan(queued(None, suspend=True, seen=queueing.Seen(None, "gone"), status=p.status), T0 + 5)
    assert reasons(again) == []


def test_a_held_workload_for_an_older_shape_is_replaced() -> None:
    grown = body({}, labels=QUEUE, learnerGroups=[{"name": "us", "replicas": 3}], training={"steps": 100})
    p = plan(observed(grown, config=QUEUED, live={**RUNNING_LIVE, children.key(ADMITTED): ADMITTED}, kueue=SERVED,
                      syncer=(view(), "")), T0)
    assert p.replace is ADMITTED and p.suspend is True
    assert reasons(p) == ["WorkloadReplaced", "WaitingForAdmission"]
    assert children.key(ADMITTED) not in p.live  # the sync leaves the one being deleted alone


# --- the plan is a function -------------------------------------------------------------------------

def test_the_plan_is_pure_the_same_input_the_same_plan_and_the_input_untouched() -> None:
    seen = queued(EVICTED, suspend=False, pods_=[learner(0)])
    before = copy.deepcopy(seen)
    assert plan(seen, T0) == plan(seen, T0)
    assert seen == before


# --- plan()'s sub-plans, each on its own ---------------------------------------------------------------

REF = n.job_reference("demo", "ml", "uid-1")
US0, US1, TPU1 = LearnerId("us", 0), LearnerId("us", 1), LearnerId("tpu", 1)
STAMP = st.rfc3339(T0)
TLS = {"expose": {"host": "syncer.example", "tls": {"enabled": True, "secretName": "tls"}}}
ENDED = st.Ending(True, "StepsReached", "every learner reached spec.training.steps")


def test_invalid_fails_the_job_told_once_and_is_the_plan_of_an_invalid_spec() -> None:
    bad = observed(body(learnerGroups=[{"name": "us", "replicas": 2, "hostsPerLearner": 0}]))
    p = invalid(bad, REF, 1, T0)
    assert p == plan(bad, T0)
    assert p.outcome == "invalid" and p.status["phase"] == "Failed" and p.desired is None
    assert p.events == (Event("InvalidSpec", "; ".join(bad.problems), warning=True),)
    assert invalid(replace(bad, body={**bad.body, "status": p.status}), REF, 1, T0 + 5).events == ()


def test_link_and_blocker_block_on_a_missing_secret_only() -> None:
    o = observed(body())
    assert o.job is not None and link_and_blocker(o, o.job)[1] is None
    tls = observed(body(syncer=TLS))
    assert tls.job is not None
    _, blocker = link_and_blocker(tls, tls.job)
    assert blocker is not None and blocker.reason == "SecretMissing" and "Secret tls" in blocker.message


def test_through_kueue_leaves_a_job_not_queued_as_it_is_and_admits_a_queued_one() -> None:
    o = running()
    assert o.job is not None
    link, _ = link_and_blocker(o, o.job)
    plain = through_kueue(o, o.job, link, finished=False, generation=1)
    assert (plain.job, plain.queued, plain.gate, plain.workloads, plain.placed) == (o.job, None, None, [], {})
    assert plain.live == o.live and plain.live is not o.live  # a copy: the plan leaves what it read alone
    q = queued(ADMITTED, suspend=True)
    assert q.job is not None
    admitted = through_kueue(q, q.job, link, finished=False, generation=1)
    assert admitted.queued is not None and admitted.gate is not None and admitted.gate.admitted
    assert admitted.job.spec.suspend is False and admitted.live == q.live
    assert [children.key(w) for w in admitted.workloads] == [children.key(ADMITTED)]
    grown = observed(body({}, labels=QUEUE, learnerGroups=[{"name": "us", "replicas": 3}]), config=QUEUED,
                     live={**RUNNING_LIVE, children.key(ADMITTED): ADMITTED}, kueue=SERVED)
    assert grown.job is not None
    replaced = through_kueue(grown, grown.job, link, finished=False, generation=1)
    assert replaced.queued is not None and replaced.queued.replace is ADMITTED
    assert children.key(ADMITTED) not in replaced.live and children.key(ADMITTED) in grown.live


def test_pod_failures_count_a_new_failure_once_and_none_once_the_job_finished() -> None:
    bad = learner(1, ready=False, state={"waiting": {"reason": "ErrImagePull", "message": "no such image"}})
    o = running(pods_=[learner(0), bad, syncer_pod()])
    assert o.job is not None
    found = pod_failures(o.status, o.job, o.pods, finished=False, now=T0)
    assert bad in found.mine and set(found.counted) == {"failures"}
    assert [(e.reason, e.warning) for e in found.events] == [("ImagePullFailed", True)]
    again = pod_failures({**o.status, **found.counted}, o.job, o.pods, finished=False, now=T0 + 5)
    assert again.events == ()  # told once
    assert pod_failures(o.status, o.job, o.pods, finished=True, now=T0) == Failing()


def test_job_status_computes_the_status_with_kueues_condition() -> None:
    o = running()
    assert o.job is not None
    obs = st.Observation(now=T0, ready={"us": 2}, syncer_ready=True, syncer=view())
    plain = job_status(o, o.job, o.status, obs, ended=None, gate=None, stamp=STAMP, generation=1)
    assert plain["phase"] == "Running" and c.find(plain["conditions"], kueue.JOB_ADMITTED) is None
    gate = kueue.Gate(True, False, "KueueNotServed", "suspended: Kueue is not served")
    gated = job_status(o, o.job, o.status, obs, ended=None, gate=gate, stamp=STAMP, generation=1)
    found = c.find(gated["conditions"], kueue.JOB_ADMITTED) or {}
    assert (found.get("status"), found.get("reason")) == ("False", "KueueNotServed")
    assert list(gated) == list(plain)  # the conditions replaced in place, nothing else moved
    ended = job_status(o, o.job, o.status, obs, ended=ENDED, gate=None, stamp=STAMP, generation=1)
    assert ended["phase"] == "Succeeded"


def waiting_condition(pod: str) -> dict[str, Any]:
    return {"type": c.PODS_UNSCHEDULABLE, "status": "True", "reason": capacity.WAITING,
            "message": f"pod {pod} (learner {pod}) is waiting for capacity, unschedulable since {STAMP}"}


TROUBLE = kueue.Gate(True, False, "KueueNotServed", "suspended: not served")
SAID = {"conditions": [{"type": kueue.JOB_ADMITTED, "status": "False", "reason": "KueueNotServed"}]}
# Each row: name, the status read, the new status's conditions, the gate, the refusals, the ending -> the Events.
STATUS_EVENTS: list[tuple[str, dict[str, Any], list[dict[str, Any]], kueue.Gate | None, list[str],
                          st.Ending | None, list[Event]]] = [
    ("nothing new", {}, [], None, [], None, []),
    ("Kueue's trouble, new", {}, [], TROUBLE, [], None, [Event("KueueNotServed", "suspended: not served", True)]),
    ("Kueue's trouble, already shown", SAID, [], TROUBLE, [], None, []),
    ("an admission is no trouble", {}, [], kueue.Gate(False, True, "Admitted", "admitted"), [], None, []),
    ("an edit to an immutable field refused", {}, [], None, ["spec.a", "spec.b"], None,
     [Event("SpecImmutable", "spec.a; spec.b", True)]),
    ("the job succeeded", {}, [], None, [], ENDED, [Event("StepsReached", ENDED.message)]),
    ("the job failed", {}, [], None, [], st.Ending(False, "BackoffLimitExceeded", "too many"),
     [Event("BackoffLimitExceeded", "too many", True)]),
    ("a pod starts waiting for capacity", {}, [waiting_condition("demo-us-0")], None, [], None,
     [Event(capacity.WAITING, waiting_condition("demo-us-0")["message"], True)]),
    ("the same pod still waiting", {"conditions": [waiting_condition("demo-us-0")]}, [waiting_condition("demo-us-0")],
     None, [], None, []),
    ("all at once, in order", {}, [waiting_condition("demo-us-1")], TROUBLE, ["spec.a"], ENDED,
     [Event("KueueNotServed", "suspended: not served", True), Event("SpecImmutable", "spec.a", True),
      Event("StepsReached", ENDED.message), Event(capacity.WAITING, waiting_condition("demo-us-1")["message"], True)]),
]


@pytest.mark.parametrize(("row", "old", "conds", "gate", "refused", "ended", "want"), STATUS_EVENTS,
                         ids=[r[0] for r in STATUS_EVENTS])
def test_status_events_tell_the_statuss_news_once_in_order(row: str, old: dict[str, Any], conds: list[dict[str, Any]],
                                                           gate: kueue.Gate | None, refused: list[str],
                                                           ended: st.Ending | None, want: list[Event]) -> None:
    assert list(status_events(old, {"conditions": conds}, gate=gate, refused=refused, ended=ended)) == want


def test_a_standby_syncers_takeover_is_told_once() -> None:
    """status.syncer counts a takeover (operator/status/job.py): the pass that first sees it posts
    SyncerTakeover; the next pass, reading the same count, posts nothing."""
    before = {"conditions": [], "syncer": {"active": "demo-syncer-a", "leaseEpoch": 1, "takeovers": 0}}
    after = {"conditions": [], "syncer": {"active": "demo-syncer-b", "leaseEpoch": 2, "takeovers": 1}}
    [event] = status_events(before, after, gate=None, refused=[], ended=None)
    assert event.reason == "SyncerTakeover" and event.warning
    assert "demo-syncer-b" in event.message and "epoch 2" in event.message and "demo-syncer-a" in event.message
    assert status_events(after, after, gate=None, refused=[], ended=None) == ()
    # A sharded standby: the Event names the shard whose lease changed hands.
    before = {"conditions": [], "syncer": {"active": "s0-a,s1-a", "leaseEpoch": 2, "leaseEpochs": [1, 1],
                                           "takeovers": 0}}
    after = {"conditions": [], "syncer": {"active": "s0-a,s1-b", "leaseEpoch": 3, "leaseEpochs": [1, 2],
                                          "takeovers": 1}}
    [event] = status_events(before, after, gate=None, refused=[], ended=None)
    assert event.reason == "SyncerTakeover" and event.message.startswith(
        "shard 1: syncer s1-b took over the lease (epoch 2) from s1-a;")


def test_desired_children_render_the_running_job_and_what_stays_once_it_ended() -> None:
    o = running()
    assert o.job is not None
    link, _ = link_and_blocker(o, o.job)
    runs = kinds(desired_children(o, o.job, link=link, blocker=None, new=o.status, ended=None, placed={}))
    assert {("StatefulSet", "demo-us"), ("Deployment", "demo-syncer"), ("Secret", "demo-token")} <= runs
    finished = plan(running(pods_=[done(0), done(1), syncer_pod()]), T0 + 10).status
    stays = kinds(desired_children(o, o.job, link=link, blocker=None, new=finished, ended=ENDED, placed={}))
    assert ("StatefulSet", "demo-us") not in stays and ("Deployment", "demo-syncer") not in stays
    assert {("Secret", "demo-token"), ("ConfigMap", "demo-config")} <= stays


def test_slots_compose_in_order() -> None:
    first = Slots({"a": 1, "b": [1]}, (Event("A", "a"),), (PodDelete("p", "u"),))
    then = Slots({"b": [2], "c": 3}, (Count("readmissions", ("x",)),), (PodDelete("q", None),))
    assert first + then == Slots({"a": 1, "b": [2], "c": 3}, (Event("A", "a"), Count("readmissions", ("x",))),
                                 (PodDelete("p", "u"), PodDelete("q", None)))
    assert Slots() + first == first == first + Slots()


def lose(status: dict[str, Any], *learners_: LearnerId) -> dict[str, Any]:
    for lid in learners_:
        status = {**status, **(pods.record_loss(status, lid, lost=pods.Loss("Deleted", "pod deleted"),
                                                pod_uid="gone", now=T0) or {})}
    return status


def test_readmit_ready_readmits_each_lost_one_host_slot_whose_pod_is_ready_in_turn() -> None:
    both = lose(lost(1), US0)
    s = readmit_ready(both, RUNNING_PODS, REF)
    assert s.patch["lostLearners"] == [] and s.patch["learnerGroups"][0]["readmitted"] == 2 and s.deletes == ()
    assert s.events == (Count("readmissions", ("ml", "demo", "us")),
                        Event("LearnerReadmitted", "learner us-0 is back: pod demo-us-0 is ready"),
                        Count("readmissions", ("ml", "demo", "us")),
                        Event("LearnerReadmitted", "learner us-1 is back: pod demo-us-1 is ready"))
    assert readmit_ready(lost(1), [learner(0), learner(1, ready=False), syncer_pod()], REF) == Slots()
    assert readmit_ready(running().status, RUNNING_PODS, REF) == Slots()  # nobody lost


# A job with a multi-host group: tpu, 2 learners of 2 hosts each.
GANGED = [{"name": "us", "replicas": 2}, {"name": "tpu", "replicas": 2, "hostsPerLearner": 2}]


def host(i: int, h: int, uid: str | None = None, ready: bool = True) -> dict[str, Any]:
    """Host `h` of learner tpu-`i` (gang demo-tpu-`i`)."""
    cs = {"name": n.LEARNER, "ready": ready, "restartCount": 0, "state": {"running": {}}}
    return {"metadata": {"name": f"demo-tpu-{i}-{h}", "uid": uid or f"t{i}-{h}", "namespace": "ml",
                         "labels": {**n.selector("demo", n.LEARNER, "tpu"), n.GANG: f"demo-tpu-{i}",
                                    n.LEARNER_INDEX: str(i), n.INDEX: str(h)}},
            "status": {"phase": "Running", "containerStatuses": [cs],
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


GANG_NEW = plan(observed(body(learnerGroups=GANGED)), T0)
GANG_LIVE = applied(GANG_NEW)
GANG_PODS = [learner(0), learner(1), host(0, 0), host(0, 1), host(1, 0), host(1, 1), syncer_pod()]


def ganged(status: dict[str, Any], pods_: list[dict[str, Any]] = GANG_PODS) -> Observed:
    return observed(body(status, learnerGroups=GANGED), live=GANG_LIVE, pods=pods_, syncer=(view(4), ""))


GANG_RUNNING = plan(ganged(GANG_NEW.status), T0).status  # every gang's run recorded


def test_the_gangs_runs_are_recorded_once_all_their_hosts_run() -> None:
    assert GANG_NEW.status.get(gangs.RUNS) is None
    assert gangs.run_of(GANG_RUNNING, "tpu-0") == ("t0-0/0", "t0-1/0")
    assert gangs.run_of(GANG_RUNNING, "tpu-1") == ("t1-0/0", "t1-1/0")


def test_settle_gang_restarts_a_gang_that_lost_a_host_then_readmits_it_once_all_its_hosts_are_back() -> None:
    restart = settle_gang(GANG_RUNNING, REF, TPU1, 2, [host(1, 0)], now=T0)
    assert restart.deletes == (PodDelete("demo-tpu-1-0", "t1-0"),)
    assert restart.events == (Count("losses", ("ml", "demo", "tpu", "Deleted")), Count("restarts", ("ml", "demo", "tpu")),
                              Event("LearnerRestarting", "learner tpu-1 restarting as a whole: host 1 of 2 lost "
                                                         "(pod demo-tpu-1-1 deleted); the other learners keep training",
                                    warning=True))
    assert [x["slot"] for x in pods.open_losses(restart.patch)] == ["tpu-1"]
    restarted = {**GANG_RUNNING, **restart.patch}
    fresh = [host(1, 0, uid="n0"), host(1, 1, uid="n1")]
    back = settle_gang(restarted, REF, TPU1, 2, fresh, now=T0 + 30)
    assert back.deletes == () and gangs.run_of(back.patch, "tpu-1") == ("n0/0", "n1/0")
    assert back.events == (Count("readmissions", ("ml", "demo", "tpu")),
                           Event("LearnerReadmitted", "learner tpu-1 is back: all 2 hosts are ready"))
    assert pods.open_losses(back.patch) == []
    assert settle_gang({**restarted, **back.patch}, REF, TPU1, 2, fresh, now=T0 + 40) == Slots()  # settled


def test_settle_gangs_settles_each_multi_host_learner_in_turn_but_not_one_that_finished() -> None:
    o = ganged(GANG_RUNNING)
    assert o.job is not None
    missing = [p for p in GANG_PODS if p["metadata"]["name"] not in ("demo-tpu-0-1", "demo-tpu-1-1")]
    both = settle_gangs(o.job, GANG_RUNNING, missing, REF, now=T0, finished=set())
    assert both.deletes == (PodDelete("demo-tpu-0-0", "t0-0"), PodDelete("demo-tpu-1-0", "t1-0"))
    assert [x["slot"] for x in pods.open_losses(both.patch)] == ["tpu-0", "tpu-1"]
    assert [g["restarts"] for g in both.patch["learnerGroups"] if g["name"] == "tpu"] == [2]
    one = settle_gangs(o.job, GANG_RUNNING, missing, REF, now=T0, finished={"tpu-0"})
    assert one.deletes == (PodDelete("demo-tpu-1-0", "t1-0"),)


def test_learner_slots_settle_the_gangs_only_while_the_job_runs_its_pods() -> None:
    o = ganged(GANG_RUNNING)
    assert o.job is not None
    status = lose(GANG_RUNNING, US1)
    missing = [p for p in GANG_PODS if p["metadata"]["name"] != "demo-tpu-1-1"]
    ready = readmit_ready(status, missing, REF)
    assert learner_slots(o.job, status, missing, REF, now=T0, finished=set(), gangs=False) == ready
    both = learner_slots(o.job, status, missing, REF, now=T0, finished=set(), gangs=True)
    assert both == ready + settle_gangs(o.job, {**status, **ready.patch}, missing, REF, now=T0, finished=set())
    assert [e.reason for e in both.events if isinstance(e, Event)] == ["LearnerReadmitted", "LearnerRestarting"]


def test_blocker_events_tell_a_blocker_when_it_becomes_the_running_reason() -> None:
    blocker = access.Blocker("SecretMissing", "Secret tls does not exist")
    assert blocker_events({}, blocker) == (Event("SecretMissing", "Secret tls does not exist", warning=True),)
    shown = {"conditions": [{"type": c.RUNNING, "status": "False", "reason": "SecretMissing"}]}
    assert blocker_events(shown, blocker) == () and blocker_events({}, None) == ()


def test_force_deletes_only_pods_terminating_past_the_timeout() -> None:
    late = learner(1, deletionTimestamp=st.rfc3339(T0 - 1000))
    recent = learner(0, deletionTimestamp=st.rfc3339(T0 - 10))
    (forced,) = force_deletes([recent, late, syncer_pod()], REF, now=T0, timeout=120)
    assert (forced.name, forced.uid, forced.grace_seconds) == ("demo-us-1", "pod-1", 0)
    assert [type(x) for x in forced.then] == [Count, Event]  # counted and told once the pod is deleted
    assert force_deletes(RUNNING_PODS, REF, now=T0, timeout=120) == ()


def test_workload_writes_finish_a_finished_queued_jobs_workload_else_settle_it() -> None:
    assert workload_writes(None, plan(running(), T0).status, RUNNING_PODS, finished=False, stamp=STAMP) == ()
    o = queued(ADMITTED, suspend=False, pods_=RUNNING_PODS)
    assert o.job is not None
    q = through_kueue(o, o.job, link_and_blocker(o, o.job)[0], finished=False, generation=1).queued
    assert q is not None
    ended = plan(running(pods_=[done(0), done(1), syncer_pod()]), T0 + 10).status
    (finish,) = workload_writes(q, ended, [], finished=False, stamp=STAMP)
    marked = c.find(finish.status["conditions"], kueue.FINISHED) or {}
    assert (marked.get("status"), marked.get("reason")) == ("True", "Succeeded")
    runs = plan(running(), T0).status
    assert workload_writes(q, runs, RUNNING_PODS, finished=False, stamp=STAMP) == \
        tuple(queueing.settle(q, RUNNING_PODS, finished=False, now=STAMP))


# --- re-admission: the pod-event pass and the plan take the one decision ---------------------------------

class Api:
    """The API server as the pod-event pass uses it: the job and its pods read, the status writes recorded."""

    def __init__(self, job: dict[str, Any], pods_: list[dict[str, Any]]) -> None:
        self.job, self.pods = job, pods_
        self.patches: list[dict[str, Any]] = []

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.job if (kind, namespace, name) == (KIND, "ml", "demo") else None

    def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        return [p for p in self.pods if labels.items() <= (p["metadata"].get("labels") or {}).items()]

    def patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any], sub: str | None = None) -> None:
        self.patches.append(patch)


class Metrics:
    """The operator's counters, as the Counts they were incremented by."""

    def __init__(self) -> None:
        self.counted: list[Count] = []

    def __getattr__(self, metric: str) -> Any:
        return SimpleNamespace(labels=lambda *labels: SimpleNamespace(
            inc=lambda: self.counted.append(Count(metric, labels))))


def pod_event(job: dict[str, Any], pods_: list[dict[str, Any]], pod: dict[str, Any],
              monkeypatch: pytest.MonkeyPatch) -> tuple[list[dict[str, Any]], list[Count], list[Event]]:
    """The pod-event pass on `pod`'s MODIFIED event: the status writes, the counts and the Events."""
    api, metrics = Api(job, pods_), Metrics()
    posted: list[Event] = []
    monkeypatch.setattr(passes, "post", lambda ref, reason, message, warning=False:
                        posted.append(Event(reason, message, warning)))
    passes.pod_event(Context(PLAIN, metrics=cast(Any, metrics), kube=cast(Any, api)), "MODIFIED", pod)
    return api.patches, metrics.counted, posted


def test_a_one_host_learner_is_readmitted_alike_by_the_pod_event_and_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    read, pod = lost(1), learner(1, namespace="ml")
    decided = readmission.decide(read, REF, US1, [pod])
    assert decided is not None
    writes, counted, posted = pod_event(body(read), [pod], pod, monkeypatch)
    assert writes == [{"status": st.validated(decided.patch)}]
    assert counted == [decided.count] and posted == [decided.event]
    assert readmit_ready(read, RUNNING_PODS, REF) == Slots(decided.patch, decided.then)  # the plan's sub-plan
    p = plan(running(read), T0 + 10)
    assert [e for e in p.events if e in decided.then] == list(decided.then)
    assert {k: p.status[k] for k in decided.patch} == decided.patch


def test_a_multi_host_learner_is_readmitted_alike_by_the_pod_event_and_the_plan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    read, gang = lose(GANG_RUNNING, TPU1), [host(1, 0), host(1, 1)]
    decided = readmission.decide(read, REF, TPU1, gang, hosts=2)
    assert decided is not None and decided.event.message == "learner tpu-1 is back: all 2 hosts are ready"
    writes, counted, posted = pod_event(body(read, learnerGroups=GANGED), GANG_PODS, host(1, 1), monkeypatch)
    assert writes == [{"status": st.validated(decided.patch)}]
    assert counted == [decided.count] and posted == [decided.event]
    assert settle_gang(read, REF, TPU1, 2, GANG_PODS, now=T0) == Slots(decided.patch, decided.then)  # the plan's
    p = plan(ganged(read), T0 + 10)
    assert [e for e in p.events if e in decided.then] == list(decided.then)
    assert {k: p.status[k] for k in decided.patch} == decided.patch


def test_children_taken_by_kueues_default_integrations_are_named_with_the_setting_the_cluster_lacks() -> None:
    """Issue 61, fix 2: in a namespace with a LocalQueue named `default`, Kueue's statefulset and
    deployment webhooks label the operator's children unless the job's kind is in Kueue's
    integrations.externalFrameworks (jobframework/defaults.go): the job says so, once."""
    live = dict(RUNNING_LIVE)
    ((kind, name),) = [k for k in live if k[0] == "StatefulSet"]
    sts = copy.deepcopy(live[(kind, name)])
    sts["metadata"]["labels"][kueue.QUEUE_LABEL] = "default"
    live[(kind, name)] = sts
    first = plan(observed(body(NEW.status), live=live, pods=RUNNING_PODS, syncer=(view(), "")), T0)
    assert condition(first, kueue.DEFAULTED) == ("True", "DefaultLocalQueue")
    message = c.find(first.status["conditions"], kueue.DEFAULTED)["message"]
    assert f"StatefulSet {name}" in message and "integrations.externalFrameworks" in message
    assert kueue.EXTERNAL_FRAMEWORK in message and "label the job" in message  # it is not queued itself
    assert reasons(first).count(kueue.DEFAULTED) == 1
    again = plan(observed(body(first.status), live=live, pods=RUNNING_PODS, syncer=(view(), "")), T0 + 1)
    assert kueue.DEFAULTED not in reasons(again)  # told once
    assert condition(plan(running(), T0), kueue.DEFAULTED) == ("", "")  # nothing taken: no condition
