"""spec.training.steps as an ending, pure: a learner container's exit 0 with the finished marker in
its termination message is the signal (exit 0 alone is also SIGTERM's), every learner of the
manifest having finished ends the job Succeeded, and its learners go with it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from diloco.contract import Finished
from diloco.operator.metrics import PHASES, OperatorMetrics
from diloco.operator.render import job as render
from diloco.operator.render import naming as n
from diloco.operator.status import conditions, steps
from diloco.operator.status import job as st
from diloco.operator.status.job import RegionView, SyncerView
from diloco.spec import DecoupledDiLoCoJob, parse_job

T0 = 1_800_000_000.0


def job(steps_: int | None = 100, replicas: int = 2, **spec: Any) -> DecoupledDiLoCoJob:
    training = {"steps": steps_} if steps_ is not None else {}
    return parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob",
                      "metadata": {"name": "demo", "namespace": "ml"},
                      "spec": {"learnerGroups": [{"name": "us", "replicas": replicas}], "training": training, **spec}})


def learner_pod(index: int, state: dict[str, Any] | None = None, last: dict[str, Any] | None = None,
                container: str = n.LEARNER, **meta: Any) -> dict[str, Any]:
    """A learner pod whose container is in `state` (default running) after `last`."""
    cs: dict[str, Any] = {"name": container, "restartCount": 1 if last else 0,
                          "state": state or {"running": {"startedAt": st.rfc3339(T0)}}}
    if last:
        cs["lastState"] = last
    return {"metadata": {"name": f"demo-us-{index}", "uid": f"uid-{index}",
                         "labels": {**n.selector("demo", n.LEARNER, "us"), n.INDEX: str(index)}, **meta},
            "status": {"phase": "Running", "containerStatuses": [cs]}}


def exited(code: int, message: str | None = None) -> dict[str, Any]:
    """A terminated state; `message`: the container's termination message."""
    ended: dict[str, Any] = {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}
    if message is not None:
        ended["message"] = message
    return {"terminated": ended}


def done(index: int = 0, steps_: int = 100, group: str = "us") -> dict[str, Any]:
    """The state of learner `group-index` that exited 0 having reached `steps_` (the learner's marker)."""
    return exited(0, Finished(f"{group}-{index}", steps_, steps_).line())


def observe(pods: list[dict[str, Any]], spec_job: DecoupledDiLoCoJob, syncer: SyncerView | None = None,
            now: float = T0) -> st.Observation:
    return st.Observation(now=now, ready={"us": 0}, syncer_endpoint="demo-syncer:50051", syncer_ready=True,
                          syncer=syncer, finished=steps.finished(spec_job.spec, pods))


def evicted(pod: dict[str, Any]) -> dict[str, Any]:
    pod["status"].update(phase="Failed", reason="Evicted")
    return pod


@pytest.mark.parametrize(("pod", "finished"), [
    (learner_pod(0, done()), True),  # just exited, saying so
    (learner_pod(0, last=done()), True),  # restarted by the kubelet since
    (learner_pod(0, {"waiting": {"reason": "CrashLoopBackOff"}}, done()), True),
    (learner_pod(0, exited(0), deletionTimestamp=st.rfc3339(T0)), False),  # SIGTERM on delete: exit 0, no marker
    (learner_pod(0, done(), deletionTimestamp=st.rfc3339(T0)), True),  # finished, then deleted: it did finish
    (evicted(learner_pod(0, exited(0))), False),  # SIGTERM from the kubelet: exit 0, no marker
    (learner_pod(0), False),  # training
    (learner_pod(0, exited(1)), False),  # a crash
    (learner_pod(0, last=exited(2)), False),  # a config error (failures.py)
    (learner_pod(0, exited(0)), False),  # exit 0 without the marker: a SIGTERM (a liveness probe's kill)
    (learner_pod(0, last=exited(0, "")), False),  # ... with the empty file the kubelet gave the start
    (learner_pod(0, exited(0), last=exited(0)), False),  # killed twice: still no finish
    (learner_pod(0, exited(0, "stopped\n")), False),  # another program's message
    (learner_pod(0, done(), container="log-shipper"), False),  # a sidecar's message says nothing about training
    (learner_pod(0, exited(1, done()["terminated"]["message"])), False),  # the marker, then a crash: not exit 0
    (learner_pod(0, done(index=1)), False),  # another learner's marker
    (learner_pod(0, done(steps_=50)), False),  # an older spec.training.steps (since raised to 100)
    (learner_pod(0, done(steps_=120)), True),  # since lowered: 120 reached covers 100
    (learner_pod(0, exited(0, done()["terminated"]["message"].replace('"version": 1', '"version": 2'))), False),
    (learner_pod(0, exited(0, ("x" * 5000 + "\n" + done()["terminated"]["message"])[-4096:])), True),  # a tail
])
def test_only_a_learner_container_that_exited_0_saying_it_finished_has_finished(pod: dict[str, Any],
                                                                                 finished: bool) -> None:
    assert steps.exited_done(pod, 100) is finished


def test_a_multi_host_learners_hosts_say_it_by_their_learners_id() -> None:
    """A gang pod (learner 1's host 2) is learner us-1's: its marker names us-1, not the host."""
    host = learner_pod(2, done(index=1))
    host["metadata"]["name"] = "demo-us-1-2"
    host["metadata"]["labels"][n.LEARNER_INDEX] = "1"
    assert steps.exited_done(host, 100)
    host["status"]["containerStatuses"][0]["state"] = done(index=2)
    assert not steps.exited_done(host, 100)


def test_the_marker_is_one_versioned_line_the_kubelets_cap_keeps() -> None:
    line = Finished("us-0", 100, 101).line()
    assert line.endswith("\n") and line.count("\n") == 1 and len(line.encode()) < 4096
    assert Finished.read(line) == Finished("us-0", 100, 101)
    assert '"reason": "finished"' in line and '"version": 1' in line
    for junk in (None, "", "{}", "not json diloco.dev/finished", 7, line.replace('"steps": 100', '"steps": true')):
        assert Finished.read(junk) is None, junk


def test_finished_learners_are_those_of_the_manifest_in_a_steps_bounded_job() -> None:
    pods = [learner_pod(0, last=done(0)), learner_pod(1), learner_pod(5, done(5))]  # 5: scaled up by hand
    assert steps.finished(job().spec, pods) == ("us-0",)
    assert steps.finished(job(steps_=None).spec, pods) == ()  # no steps: an exit 0 ends nothing
    syncer = {"metadata": {"name": "demo-syncer-x", "labels": n.selector("demo", n.SYNCER)},
              "status": {"containerStatuses": [{"name": n.LEARNER, "state": done(0)}]}}
    assert steps.finished(job().spec, [syncer]) == ()


def test_the_job_ends_succeeded_once_every_learner_finished() -> None:
    j = job()
    status = st.compute(j.spec, {}, observe([learner_pod(0), learner_pod(1)], j), generation=1)
    status["startTime"] = st.rfc3339(T0)
    # One learner done: the job trains on, and Degraded says which one finished.
    half = observe([learner_pod(0, {"waiting": {"reason": "CrashLoopBackOff"}}, done(0)), learner_pod(1)], j)
    assert st.ending(j.spec, status, half) is None
    running = st.compute(j.spec, status, replace(half, ready={"us": 1}), generation=1)
    degraded = conditions.find(running["conditions"], conditions.DEGRADED)
    assert degraded is not None and degraded["status"] == "True"
    assert degraded["message"].endswith("; finished spec.training.steps=100: us-0")
    # Both done: Succeeded/StepsReached, no learner desired any more.
    both = observe([learner_pod(0, last=done(0)), learner_pod(1, done(1))], j, now=T0 + 60)
    ended = st.ending(j.spec, running, both)
    assert ended == st.Ending(True, steps.REASON, "all 2 learners reached spec.training.steps=100 and exited 0")
    final = st.compute(j.spec, running, both, generation=1, ended=ended)
    assert final["phase"] == "Succeeded" and final["desiredLearners"] == 0
    assert final["completionTime"] == st.rfc3339(T0 + 60)
    succeeded = conditions.find(final["conditions"], conditions.SUCCEEDED)
    assert succeeded is not None and (succeeded["status"], succeeded["reason"]) == ("True", "StepsReached")
    st.validated(final)
    # Later passes see it finished: no new ending.
    assert st.finished(final)


def test_without_steps_exits_end_nothing() -> None:
    j = job(steps_=None)
    obs = observe([learner_pod(0, done(0)), learner_pod(1, done(1))], j)
    assert st.ending(j.spec, {}, obs) is None


def test_the_syncers_cluster_waits_for_other_clusters_learners_to_disconnect() -> None:
    j = job()
    pods = [learner_pod(0, done(0)), learner_pod(1, done(1))]

    def view(active_elsewhere: int) -> SyncerView:
        regions = (RegionView("default", 2, 0, 1000, 0, 10, 0.0), RegionView("eu", 2, active_elsewhere, 900, 0, 9, 0.0))
        return SyncerView("inc", 10, 1900, active_elsewhere, 0, regions)

    assert st.ending(j.spec, {}, observe(pods, j, view(1))) is None  # eu's learner still flushing
    ended = st.ending(j.spec, {}, observe(pods, j, view(0)))
    assert ended is not None and ended.reason == steps.REASON
    assert st.ending(j.spec, {}, observe(pods, j, None)) is not None  # the syncer silent: nothing to wait for


def test_a_finished_job_keeps_no_learner_unless_clean_pod_policy_is_none() -> None:
    owner = render.Owner("demo", "ml", "uid")
    for policy, kept in (("Running", False), ("All", False), ("None", True)):
        j = job(runPolicy={"cleanPodPolicy": policy})
        rendered = render.children(j, owner, "t" * 32, started=True, finished=True, outcome="Succeeded")
        statefulsets = [x["metadata"]["name"] for x in rendered if x["kind"] == "StatefulSet"]
        assert (n.statefulset("demo", "us") in statefulsets) is kept, (policy, statefulsets)


def test_the_phase_metric_has_one_series_per_phase_and_goes_with_the_job() -> None:
    m = OperatorMetrics()

    def phase(p: str) -> float | None:
        return m.registry.get_sample_value("diloco_job_phase", {"diloco_namespace": "ml", "diloco_job": "demo",
                                                                "phase": p})

    m.job_status("ml", "demo", {"phase": "Running"})
    assert {p: phase(p) for p in PHASES} == {"Pending": 0, "Running": 1, "Suspended": 0, "Succeeded": 0, "Failed": 0}
    m.job_status("ml", "demo", {"phase": "Succeeded"})
    assert phase("Succeeded") == 1 and phase("Running") == 0
    m.capacity_wait("ml", "demo", 2, 420.0)
    labels = {"diloco_namespace": "ml", "diloco_job": "demo"}
    assert m.registry.get_sample_value("diloco_job_unschedulable_pods", labels) == 2
    assert m.registry.get_sample_value("diloco_job_unschedulable_seconds", labels) == 420.0
    m.forget("ml", "demo")
    assert phase("Succeeded") is None and m.registry.get_sample_value("diloco_job_unschedulable_pods", labels) is None
    # Every reconcile outcome exists from 0, so increase() sees the first error.
    assert m.registry.get_sample_value("diloco_operator_reconciles_total", {"outcome": "error"}) == 0
