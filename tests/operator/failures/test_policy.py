"""The failure policy, pure: which pod states are permanent, counted once, and the Failed end."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from diloco.contract import Exit
from diloco.operator.failures import policy as failures
from diloco.operator.render import naming as n
from diloco.operator.status import conditions
from diloco.operator.status import job as st
from diloco.spec import JobSpec, parse_job

T0 = 1_800_000_000.0


def spec(backoff: int = 1) -> JobSpec:
    return parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "demo"},
                      "spec": {"learnerGroups": [{"name": "us", "replicas": 2}],
                               "runPolicy": {"backoffLimit": backoff}}}).spec


def pod(uid: str = "u1", name: str = "demo-us-1", *, containers: list[dict[str, Any]] | None = None,
        conditions_: list[dict[str, Any]] | None = None, component: str = n.LEARNER, **meta: Any) -> dict[str, Any]:
    labels = {**n.selector("demo", component, "us" if component == n.LEARNER else None), n.INDEX: name[-1]}
    return {"metadata": {"name": name, "uid": uid, "labels": labels, **meta},
            "status": {"phase": "Running", "containerStatuses": containers or [], "conditions": conditions_ or []}}


def exited(code: int, restarts: int = 1, cid: str = "c1", *, now: bool = False, reason: str = "Error",
           name: str = "learner") -> dict[str, Any]:
    ended = {"terminated": {"exitCode": code, "reason": reason, "containerID": cid}}
    return {"name": name, "restartCount": restarts, "ready": False, "image": "img:1",
            **({"state": ended} if now else {"state": {"waiting": {"reason": "CrashLoopBackOff"}}, "lastState": ended})}


def waiting(reason: str, name: str = "learner") -> dict[str, Any]:
    return {"name": name, "restartCount": 0, "ready": False, "image": "ghcr.io/x/learner:typo",
            "state": {"waiting": {"reason": reason, "message": "not found"}}}


def unschedulable(since: float) -> list[dict[str, Any]]:
    return [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": "0/3 nodes are available: 3 Insufficient google.com/tpu.",
             "lastTransitionTime": st.rfc3339(since)}]


@pytest.mark.parametrize("reason", sorted(failures.IMAGE_WAITING))
def test_image_pull_errors_are_permanent(reason: str) -> None:
    found = failures.classify(pod(containers=[waiting(reason)]))
    assert found is not None and found.reason == failures.IMAGE and found.who == "learner us-1"
    assert reason in found.detail and "ghcr.io/x/learner:typo" in found.detail and "image" in found.fix


def test_an_init_container_that_cannot_pull_counts_too() -> None:
    p = pod(containers=[])
    p["status"]["initContainerStatuses"] = [waiting("ErrImagePull", "fetch")]
    found = failures.classify(p)
    assert found is not None and found.key == "u1/fetch/image"


@pytest.mark.parametrize("code, reason", [(Exit.CONFIG, failures.CONFIG), (Exit.REFUSED, failures.REFUSED)])
@pytest.mark.parametrize("current", [True, False])
def test_config_and_refused_exit_codes_are_permanent(code: int, reason: str, current: bool) -> None:
    found = failures.classify(pod(containers=[exited(code, now=current)]))
    assert found is not None and (found.reason, found.key) == (reason, "u1/learner/c1")
    assert f"exited with code {int(code)}" in found.detail


def test_waiting_for_capacity_is_never_a_permanent_failure() -> None:
    """Unschedulable is a capacity wait (capacity.py), however long: nothing counts against backoffLimit."""
    p = pod(conditions_=unschedulable(T0))
    for waited in (0, 300, 86_400):
        assert failures.classify(p) is None
        assert failures.fold({}, [p], T0 + waited) == ({}, [])


@pytest.mark.parametrize("container", [
    exited(137, reason="OOMKilled"),  # out of memory
    exited(143),  # SIGTERM
    exited(int(Exit.FAILED)),  # a crash
    {"name": "learner", "restartCount": 0, "ready": True, "state": {"running": {}}},
    {"name": "learner", "restartCount": 0, "state": {"waiting": {"reason": "ContainerCreating"}}},
])
def test_transient_failures_are_not_classified(container: dict[str, Any]) -> None:
    assert failures.classify(pod(containers=[container])) is None
    assert failures.fold({}, [pod(containers=[container])], T0) == ({}, [])  # nothing in the status at all


def test_a_preempted_or_deleted_pod_is_a_loss_not_a_permanent_failure() -> None:
    going = pod(containers=[exited(Exit.CONFIG)], deletionTimestamp=st.rfc3339(T0))
    assert failures.classify(going) is None


def test_the_same_failure_counts_once_across_passes_and_views() -> None:
    first = pod(containers=[exited(Exit.CONFIG, restarts=0, cid="c1", now=True)])  # terminated, not restarted yet
    patch, fresh = failures.fold({}, [first], T0)
    assert patch["failures"]["permanent"] == 1 and [f.pod for f in fresh] == ["demo-us-1"]
    status = {**patch}
    again = pod(containers=[exited(Exit.CONFIG, restarts=1, cid="c1")])  # the same dead container, as lastState
    assert failures.fold(status, [again], T0 + 10) == ({}, [])
    assert failures.fold(status, [again], T0 + 20) == ({}, [])  # and on every later pass
    nxt = pod(containers=[exited(Exit.CONFIG, restarts=2, cid="c2")])  # its next run failed too
    patch, fresh = failures.fold(status, [nxt], T0 + 30)
    assert patch["failures"]["permanent"] == 2 and len(fresh) == 1


def test_the_count_survives_the_pod_being_replaced() -> None:
    status, _ = failures.fold({}, [pod("u1", containers=[exited(Exit.REFUSED)])], T0)
    replaced = pod("u2", containers=[exited(Exit.REFUSED, cid="c9")])  # same name, new pod
    patch, fresh = failures.fold(status, [replaced], T0 + 60)
    state = patch["failures"]
    assert state["permanent"] == 2 and len(fresh) == 1
    assert [k.split("/")[0] for k in state["counted"]] == ["u2"]  # the gone pod's keys are dropped
    assert state["last"]["pod"] == "demo-us-1" and state["last"]["at"] == st.rfc3339(T0 + 60)
    healthy = pod("u3", containers=[{"name": "learner", "restartCount": 0, "ready": True, "state": {"running": {}}}])
    patch, _ = failures.fold({**status, **patch}, [healthy], T0 + 90)
    assert patch["failures"]["permanent"] == 2 and patch["failures"]["current"] == []


def test_the_syncer_is_classified_too() -> None:
    syncer = pod("s1", "demo-syncer-abc", component=n.SYNCER, containers=[exited(Exit.CONFIG, name="syncer")])
    found = failures.classify(syncer)
    assert found is not None and found.who == "syncer"


def test_events_name_the_pod_the_reason_and_the_fix() -> None:
    _, fresh = failures.fold({}, [pod(containers=[waiting("ImagePullBackOff")])], T0)
    [(reason, message)] = failures.events({}, fresh, 6)
    assert reason == "ImagePullFailed"
    assert "pod demo-us-1 (learner us-1)" in message and "fix: check the image name" in message
    assert "Permanent failure 1" in message and "backoffLimit=6" in message


def obs(now: float) -> st.Observation:
    return st.Observation(now=now, ready={"us": 1}, syncer_endpoint="demo-syncer:1", syncer_ready=True)


def test_more_than_backoff_limit_permanent_failures_end_the_job_failed() -> None:
    s = spec(backoff=1)
    status = st.compute(s, {}, obs(T0), generation=1)
    patch, _ = failures.fold(status, [pod(containers=[exited(Exit.CONFIG, cid="c1")])], T0 + 1)
    status = {**status, **patch}
    assert st.ending(s, status, obs(T0 + 1)) is None  # 1 is not over backoffLimit=1
    status = st.compute(s, status, obs(T0 + 1), generation=1)
    failing = conditions.find(status["conditions"], conditions.PODS_FAILING)
    assert failing["status"] == "True" and failing["reason"] == "ConfigError" and "kubectl logs" in failing["message"]
    assert status["phase"] == "Running" and status["failures"]["permanent"] == 1
    patch, _ = failures.fold(status, [pod(containers=[exited(Exit.CONFIG, restarts=2, cid="c2")])], T0 + 2)
    status = {**status, **patch}
    ended = st.ending(s, status, obs(T0 + 2))
    assert ended is not None and (ended.succeeded, ended.reason) == (False, "BackoffLimitExceeded")
    assert "2 permanent failures" in ended.message and "ConfigError" in ended.message
    done = st.compute(s, status, obs(T0 + 2), generation=1, ended=ended)
    assert done["phase"] == "Failed" and conditions.find(done["conditions"], "Failed")["reason"] == "BackoffLimitExceeded"
    assert done["failures"]["last"]["reason"] == "ConfigError"


def test_a_job_that_never_failed_has_no_failure_condition() -> None:
    status = st.compute(spec(), {}, obs(T0), generation=1)
    assert conditions.find(status["conditions"], conditions.PODS_FAILING) is None and "failures" not in status


def test_many_failing_pods_are_counted_but_listed_briefly() -> None:
    many = [pod(f"u{i}", f"demo-us-{i}", containers=[waiting("ErrImagePull")]) for i in range(25)]
    patch, fresh = failures.fold({}, many, T0)
    state = patch["failures"]
    assert (state["permanent"], state["failingPods"], len(state["current"]), len(fresh)) == (25, 25, failures.SHOWN, 25)
    assert failures.fold(patch, many, T0 + 1) == ({}, [])  # all remembered: none counted twice
    conds = failures.condition([], patch, limit=6, now="t", generation=1)
    assert "(and 24 more pods)" in conds[0]["message"]


def test_a_pod_for_a_slot_the_spec_does_not_want_is_not_the_jobs_failure() -> None:
    """A StatefulSet scaled up by hand runs pods for slots that do not exist; they exit CONFIG
    ("no such learner") until the operator puts the replicas back: not counted."""
    extra = pod("u5", "demo-us-4", containers=[exited(Exit.CONFIG)])
    wanted = pod("u1", "demo-us-1", containers=[exited(Exit.CONFIG)])
    syncer = pod("u9", "demo-syncer-abc", component=n.SYNCER, containers=[exited(Exit.CONFIG, name="syncer")])
    assert failures.counting([extra, wanted, syncer], lambda slot: st.slot_wanted(spec(), slot)) == [wanted, syncer]


def stuck(uid: str, name: str, since: float, component: str = n.LEARNER) -> dict[str, Any]:
    """A pod whose container never started: the kubelet cannot pull its image (since `since`)."""
    ready = [{"type": "Ready", "status": "False", "reason": "ContainersNotReady", "lastTransitionTime": st.rfc3339(since)}]
    return pod(uid, name, containers=[waiting("ImagePullBackOff", "syncer" if component == n.SYNCER else "learner")],
               conditions_=ready, component=component)


def running(uid: str, name: str) -> dict[str, Any]:
    return pod(uid, name, containers=[{"name": "learner", "restartCount": 0, "ready": True, "state": {"running": {}}}])


def test_a_bad_image_ends_the_job_once_its_whole_group_is_stuck_past_the_grace() -> None:
    """backoffLimit 6 and 2 replicas: the 2 pull failures count once each and never exceed it, so
    the group rule ends the job (Failed/ImagePullFailed) instead of PodsFailing forever."""
    s = spec(backoff=6)
    group = [stuck("u0", "demo-us-0", T0), stuck("u1", "demo-us-1", T0 + 20)]
    status = st.compute(s, {}, obs(T0), generation=1)
    patch, _ = failures.fold(status, group, T0 + 30)
    status = {**status, **patch}
    assert status["failures"]["permanent"] == 2 and failures.exceeded(status, 6) is None
    assert failures.image_stuck(group, T0 + 319, grace=300) is None  # demo-us-1 has waited 299 s
    message = failures.image_stuck(group, T0 + 320, grace=300)
    assert message is not None and "every pod of the learner group us (2)" in message
    assert "ghcr.io/x/learner:typo" in message and "fix: check the image name" in message
    assert st.ending(s, status, obs(T0 + 320)) is None  # the operator passes what it observed
    ended = st.ending(s, status, replace(obs(T0 + 320), image_stuck=message))
    assert ended is not None and (ended.succeeded, ended.reason, ended.message) == (False, "ImagePullFailed", message)
    done = st.compute(s, status, obs(T0 + 320), generation=1, ended=ended)
    assert done["phase"] == "Failed" and conditions.find(done["conditions"], "Failed")["reason"] == "ImagePullFailed"


def test_one_pod_stuck_beside_running_ones_does_not_end_the_job() -> None:
    """One node's registry mirror, or a rollout to a bad tag (a StatefulSet replaces one pod at a
    time): the group still trains, so only PodsFailing shows it."""
    assert failures.image_stuck([stuck("u0", "demo-us-0", T0), running("u1", "demo-us-1")], T0 + 3600) is None
    assert failures.image_stuck([], T0) is None


def test_the_syncer_is_a_group_of_its_own() -> None:
    syncer = stuck("s1", "demo-syncer-abc", T0, component=n.SYNCER)
    message = failures.image_stuck([syncer, running("u1", "demo-us-1")], T0 + 300)
    assert message is not None and "every pod of the syncer (1)" in message


def test_stuck_is_timed_from_the_ready_flip_else_the_start_else_the_creation() -> None:
    p = pod("u0", "demo-us-0", containers=[waiting("ErrImagePull")], creationTimestamp=st.rfc3339(T0))
    assert failures.image_stuck([p], T0 + 299) is None and failures.image_stuck([p], T0 + 300) is not None
    p["status"]["startTime"] = st.rfc3339(T0 + 100)
    assert failures.image_stuck([p], T0 + 300) is None and failures.image_stuck([p], T0 + 400) is not None
    going = stuck("u1", "demo-us-1", T0)
    going["metadata"]["deletionTimestamp"] = st.rfc3339(T0 + 1)
    assert failures.image_stuck([going], T0 + 900) is None
