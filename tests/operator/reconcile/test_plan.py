"""The reconcile's plan as tables: what one pass observed -> what it decides (operator/reconcile/plan.py).

No cluster, no client, no clock: each row builds an Observed as observe.observe would
have read it and checks the Plan (children, status, Events and counts, pod deletions, Kueue's
writes) through the main phases of a job: new, running, a learner lost and back, queued,
admitted and evicted by Kueue, finished, failed, past its TTL.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from diloco.contract import Finished, LearnerId
from diloco.operator.context import Config
from diloco.operator.failures import pod_refusals, pods, refusals
from diloco.operator.kueue import integration as kueue
from diloco.operator.kueue import queueing
from diloco.operator.reconcile import children
from diloco.operator.reconcile.actions import Count, Event, PodDelete
from diloco.operator.reconcile.loading import effective
from diloco.operator.reconcile.observe import Observed
from diloco.operator.reconcile.plan import Plan, plan, settle
from diloco.operator.render import naming as n
from diloco.operator.status import conditions as c
from diloco.operator.status import job as st

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
    assert stopping.suspend is True and reasons(stopping) == ["Evicted"] and stopping.workload_writes == ()
    assert ("StatefulSet", "demo-us") in kinds(stopping.children.delete)
    gone = plan(queued(EVICTED, suspend=True), T0)
    (release,) = gone.workload_writes
    assert release.status["admission"] is None and release.event is not None
    assert release.event.reason == "QuotaReleased" and "Preempted" in release.event.message


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
