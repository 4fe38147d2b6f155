"""Multi-host learners: the whole-gang restart, as a pure decision and with the operator running.

A learner of `hostsPerLearner: H` is H pods of one JAX program; losing one host restarts the
learner as a whole (its other hosts deleted), and only it. The kopf tests use the emulated
cluster of tests/operator/test_handlers.py (tests/kube/): its StatefulSet stand-in recreates deleted
pods, its kubelet marks them ready.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from diloco.contract import LearnerId
from diloco.operator.context import Config
from diloco.operator.failures import gangs, pods
from diloco.operator.kube import Kube
from diloco.operator.render import job as render
from diloco.operator.render import learners
from diloco.operator.render import naming as n
from diloco.operator.status import job as st
from diloco.spec import load_job, parse_job
from tests.helpers import wait_for
from tests.kube import NAMESPACE
from tests.kube.controllers import Controllers
from tests.kube.emulator import ClusterThread
from tests.kube.running import OperatorThread

pytest_plugins = ["tests.kube.fixtures"]
T0 = 1_800_000_000.0
TPU1 = LearnerId("tpu", 1)


def host(h: int, uid: str | None = None, restarts: int = 0, ready: bool = True, phase: str = "Running",
         terminating: bool = False, last: dict[str, Any] | None = None) -> dict[str, Any]:
    """Host `h` of learner tpu-1 (gang demo-tpu-1), as the API shows its pod."""
    cs: dict[str, Any] = {"name": "learner", "ready": ready, "restartCount": restarts, "state": {"running": {}}}
    if last:
        cs["lastState"] = {"terminated": last}
    meta: dict[str, Any] = {"name": f"demo-tpu-1-{h}", "uid": uid or f"u{h}", "namespace": "ns",
                            "labels": {n.JOB: "demo", n.COMPONENT: "learner", n.GROUP: "tpu", n.GANG: "demo-tpu-1",
                                       n.LEARNER_INDEX: "1", n.INDEX: str(h)}}
    if terminating:
        meta["deletionTimestamp"] = "2027-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase, "containerStatuses": [cs],
                                         "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


RUN = ("u0/0", "u1/0", "u2/0", "u3/0")


def decide(members: list[dict[str, Any]], run: tuple[str, ...] | None = RUN,
           gone: dict[str, Any] | None = None) -> gangs.Decision:
    return gangs.decide(members, 4, run=run, gang="demo-tpu-1", gone=gone)


def test_a_run_forms_once_every_host_runs() -> None:
    assert decide([host(0), host(1), host(2)], None) == gangs.Decision()  # host 3 not there yet
    waiting = host(3)
    waiting["status"]["containerStatuses"][0]["state"] = {"waiting": {"reason": "ContainerCreating"}}
    assert decide([host(0), host(1), host(2), waiting], None) == gangs.Decision()
    formed = decide([host(h, ready=False) for h in range(4)], None)  # ready or not: the processes exist
    assert formed == gangs.Decision(run=RUN)
    assert decide([host(h) for h in range(4)]) == gangs.Decision()  # intact: nothing to do


@pytest.mark.parametrize("lost, gone, reason, detail", [
    (None, None, "Deleted", "pod demo-tpu-1-2 deleted"),
    (host(2, phase="Failed", ready=False), None, "Failed", "pod demo-tpu-1-2 failed: Failed"),
    (host(2, terminating=True), None, "Deleted", "pod demo-tpu-1-2 deleted"),
    (host(2, uid="v2", ready=False), None, "Deleted", "pod demo-tpu-1-2 was replaced"),
    (host(2, restarts=1, last={"exitCode": 137, "reason": "OOMKilled"}), None, "Failed",
     "pod demo-tpu-1-2: container restarted (exit code 137, OOMKilled)"),
    (host(2, restarts=1, ready=False, last={"exitCode": 1, "reason": "Error"}), None, "Failed",
     "pod demo-tpu-1-2: container learner exited with code 1 (Error)"),
    (None, {**host(2), "status": {"conditions": [
        {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]}},
     "Preempted", "pod demo-tpu-1-2: PreemptionByScheduler"),
    (host(2, uid="v2", ready=False), host(2, terminating=True), "Deleted", "pod demo-tpu-1-2 deleted"),  # replaced fast
])
def test_one_lost_host_restarts_the_gang(lost: dict[str, Any] | None, gone: dict[str, Any] | None, reason: str,
                                         detail: str) -> None:
    members = [host(0), host(1), host(3)] + ([lost] if lost else [])
    restart = decide(members, gone=gone).restart
    assert restart is not None and (restart.host, restart.hosts) == (2, 4)
    assert (restart.loss.reason, restart.loss.detail) == (reason, detail)
    # The intact hosts go (a restarted container's own process is already new: it stays).
    assert [p["metadata"]["name"] for p in restart.survivors] == ["demo-tpu-1-0", "demo-tpu-1-1", "demo-tpu-1-3"]
    assert gangs.message(TPU1, restart) == f"learner tpu-1 restarting as a whole: host 2 of 4 lost ({detail})"


def test_a_restart_in_progress_is_not_restarted_again_and_the_next_run_forms() -> None:
    # The operator deleted the survivors: all Terminating, one host already recreated.
    after = [host(0, terminating=True), host(1, terminating=True), host(2, uid="v2"), host(3, terminating=True)]
    assert decide(after) == gangs.Decision()
    back = [host(0, uid="v0"), host(1, uid="v1"), host(2, uid="v2"), host(3, uid="v3")]
    assert decide(back) == gangs.Decision(run=("v0/0", "v1/0", "v2/0", "v3/0"))
    # JAX aborted every process at once and each container restarted in place: nobody to delete.
    everyone = [host(h, restarts=1) for h in range(4)]
    assert decide(everyone) == gangs.Decision(run=("u0/1", "u1/1", "u2/1", "u3/1"))


def test_back_needs_the_recorded_run_intact_and_ready() -> None:
    ready = [host(h) for h in range(4)]
    assert gangs.back(ready, 4, RUN)
    assert not gangs.back(ready, 4, None)  # no run recorded yet
    assert not gangs.back(ready[:3], 4, RUN)
    assert not gangs.back([*ready[:3], host(3, ready=False)], 4, RUN)
    assert not gangs.back([*ready[:3], host(3, uid="v3")], 4, RUN)  # ready, but not of this run


def test_the_status_says_the_learner_restarts_as_a_whole_and_counts_one_loss() -> None:
    restart = decide([host(0), host(1), host(3)]).restart
    assert restart is not None
    status: dict[str, Any] = {"learnerGroups": [{"name": "tpu", "lost": 0, "preempted": 0, "readmitted": 0}]}
    status.update(gangs.record_restart(status, TPU1, restart=restart, lost_uid="u2", now=T0))
    (entry,) = status["lostLearners"]
    assert (entry["slot"], entry["reason"], entry["pod"]) == ("tpu-1", "Deleted", "u2")
    assert entry["restart"] == "host 2 of 4 lost (pod demo-tpu-1-2 deleted)"
    assert (status["learnerGroups"][0]["lost"], status["learnerGroups"][0]["restarts"]) == (1, 1)
    # lost already: a restart, no new loss
    status.update(gangs.record_restart(status, TPU1, restart=restart, lost_uid="u2", now=T0))
    assert (status["learnerGroups"][0]["lost"], status["learnerGroups"][0]["restarts"]) == (1, 2)
    status.update(pods.record_ready(status, TPU1))
    assert status["lostLearners"] == [] and status["learnerGroups"][0]["readmitted"] == 1
    status.update(gangs.set_run(status, "tpu-0", ("a/0", "b/0")))
    status.update(gangs.set_run(status, "tpu-1", RUN))
    status.update(gangs.set_run(status, "tpu-0", ("c/0", "b/0")))
    assert (gangs.run_of(status, "tpu-0"), gangs.run_of(status, "tpu-1")) == (("c/0", "b/0"), RUN)


def test_status_keeps_the_runs_of_wanted_learners_and_counts_restarts_per_gang_group() -> None:
    spec = parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "j"},
                      "spec": {"learnerGroups": [{"name": "tpu", "replicas": 1, "hostsPerLearner": 4},
                                                 {"name": "eu", "replicas": 1}]}}).spec
    prior = {"gangRuns": [{"learner": "tpu-0", "hosts": list(RUN)}, {"learner": "tpu-1", "hosts": list(RUN)}]}
    out = st.compute(spec, prior, st.Observation(now=T0, ready={"tpu": 1, "eu": 1}), generation=1)
    assert out["gangRuns"] == [{"learner": "tpu-0", "hosts": list(RUN)}]  # tpu-1 was scaled away
    tpu, eu = out["learnerGroups"]
    assert tpu["restarts"] == 0 and "restarts" not in eu
    assert "gangRuns" not in st.compute(spec, {}, st.Observation(now=T0), generation=1)


def test_the_tpu_and_gpu_examples() -> None:
    import kubernetes_validate

    root = Path(__file__).resolve().parents[3] / "examples"
    tpu = load_job(str(root / "k8s-tpu.yaml"))
    (slice_group,) = tpu.spec.learner_groups
    assert slice_group.hosts_per_learner == learners.slice_hosts(slice_group) == 4
    assert (tpu.spec.model.preset, tpu.spec.model.dtype, tpu.spec.data.source.kind) == ("llama-1b", "bfloat16", "tokens")
    assert render.name_problems(tpu) == []
    running = tpu.model_copy(update={"spec": tpu.spec.model_copy(update={"suspend": False})})  # as Kueue admits it
    owner = render.Owner("tpu-1b", "research", "0f5a1f4e-0000-4000-8000-000000000000")
    objs = render.children(running, owner, "t" * 43, started=True, finished=False)
    sets = [o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"].startswith("tpu-1b-v5e-")]
    assert len(sets) == 4 and all(s["spec"]["replicas"] == 4 for s in sets)  # a learner per slice, a pod per host
    for doc in objs:  # valid for both Kubernetes versions the chart supports
        for version in ("1.30.0", "1.33.0"):
            kubernetes_validate.validate(doc, version, strict=True)
    gpu = load_job(str(root / "k8s-gpu.yaml"))
    (h100,) = gpu.spec.learner_groups
    assert (h100.replicas, h100.hosts_per_learner, h100.resources.limits["nvidia.com/gpu"]) == (8, 1, 8)
    assert gpu.spec.training.mesh.shape(8) == (1, 8)  # one program over the node's 8 GPUs, FSDP over NVLink
    assert (gpu.spec.model.preset, gpu.spec.model.dtype, gpu.spec.model.remat) == ("llama-1b", "bfloat16", True)


# -- with the operator running ------------------------------------------------------------

FAST = Config(status_interval=0.5, chaos_interval=0.25, stuck_timeout=1.0)
JOB = "DecoupledDiLoCoJob"


@pytest.fixture
def operator(cluster: ClusterThread) -> Iterator[OperatorThread]:
    with OperatorThread(FAST) as op:
        yield op


def status(kube: Kube) -> dict[str, Any]:
    return (kube.get(JOB, NAMESPACE, "demo") or {}).get("status") or {}


def events(kube: Kube, reason: str) -> list[dict[str, Any]]:
    items = kube.request("GET", f"api/v1/namespaces/{NAMESPACE}/events").get("items") or []
    return [e for e in items if e.get("reason") == reason]


def uids(kube: Kube) -> dict[str, str]:
    """The learner pods that are up (not Terminating), by name."""
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in kube.list("Pod", NAMESPACE, n.selector("demo", n.LEARNER))
            if not p["metadata"].get("deletionTimestamp")}


def group(kube: Kube, name: str) -> dict[str, Any]:
    return next(g for g in status(kube).get("learnerGroups") or [] if g["name"] == name)


def formed(kube: Kube, slot: str) -> tuple[str, ...] | None:
    return gangs.run_of(status(kube), slot)


@pytest.mark.slow
def test_losing_a_host_restarts_that_learner_whole_and_no_other(api: Kube, controllers: Controllers,
                                                                operator: OperatorThread) -> None:
    groups = [{"name": "tpu", "region": "us-west4", "replicas": 2, "hostsPerLearner": 2},
              {"name": "us", "region": "us-central1", "replicas": 1}]
    api.create({"apiVersion": "diloco.dev/v1alpha1", "kind": JOB, "metadata": {"name": "demo", "namespace": NAMESPACE},
                "spec": {"learnerGroups": groups}})
    wait_for(lambda: status(api).get("learners") == "3/3" and formed(api, "tpu-0") and formed(api, "tpu-1"),
             what="3 learners ready, both gangs' runs recorded")
    before, old_run = uids(api), formed(api, "tpu-1")
    assert sorted(before) == ["demo-tpu-0-0", "demo-tpu-0-1", "demo-tpu-1-0", "demo-tpu-1-1", "demo-us-0"]
    # Host 1 of learner tpu-1 is lost: its host 0 is deleted too, so the learner starts again whole.
    api.delete("Pod", NAMESPACE, "demo-tpu-1-1", grace_seconds=1)
    wait_for(lambda: events(api, "LearnerRestarting"), what="the restart Event")
    (event,) = events(api, "LearnerRestarting")
    assert event["type"] == "Warning" and event["message"] == (
        "learner tpu-1 restarting as a whole: host 1 of 2 lost (pod demo-tpu-1-1 deleted); "
        "the other learners keep training")
    lost = wait_for(lambda: status(api).get("lostLearners"), what="the loss in the status")
    assert [(x["slot"], x["restart"]) for x in lost] == [("tpu-1", "host 1 of 2 lost (pod demo-tpu-1-1 deleted)")]
    wait_for(lambda: (u := uids(api)).get("demo-tpu-1-0") not in (None, before["demo-tpu-1-0"]) and
             u.get("demo-tpu-1-1") not in (None, before["demo-tpu-1-1"]), what="both hosts of tpu-1 replaced")
    # Back as one: re-admitted once both new hosts are ready, under a new run.
    wait_for(lambda: group(api, "tpu")["readmitted"] == 1 and status(api).get("learners") == "3/3",
             what="tpu-1 re-admitted")
    new_run = formed(api, "tpu-1")
    assert new_run != old_run and [h.split("/")[0] for h in new_run or ()] == \
        [uids(api)["demo-tpu-1-0"], uids(api)["demo-tpu-1-1"]]
    tpu = group(api, "tpu")
    assert (tpu["lost"], tpu["restarts"], status(api)["lostLearners"]) == (1, 1, [])
    wait_for(lambda: events(api, "LearnerReadmitted"), what="the LearnerReadmitted Event")
    # Nobody else restarted, and nothing loops: a few more reconciles change nothing.
    operator.ticks(3)
    after = uids(api)
    for name in ("demo-tpu-0-0", "demo-tpu-0-1", "demo-us-0"):
        assert after[name] == before[name], name
    assert len(events(api, "LearnerRestarting")) == 1 and group(api, "tpu")["restarts"] == 1
    assert group(api, "us")["lost"] == 0


@pytest.mark.slow
def test_a_host_whose_container_restarted_restarts_its_peers_and_scaling_touches_no_gang(
        api: Kube, controllers: Controllers, operator: OperatorThread) -> None:
    groups = [{"name": "tpu", "region": "us-west4", "replicas": 1, "hostsPerLearner": 2}]
    api.create({"apiVersion": "diloco.dev/v1alpha1", "kind": JOB, "metadata": {"name": "demo", "namespace": NAMESPACE},
                "spec": {"learnerGroups": groups, "data": {"shards": 2}}})  # room to scale up
    wait_for(lambda: status(api).get("learners") == "1/1" and formed(api, "tpu-0"), what="the gang up")
    before = uids(api)
    # Host 0's container died (OOM) and the kubelet restarted it in place, ready again at once:
    # its new process cannot rejoin the old program, so host 1 goes and both start afresh.
    victim = api.get("Pod", NAMESPACE, "demo-tpu-0-0")
    api.patch("Pod", NAMESPACE, "demo-tpu-0-0", {"status": {"containerStatuses": [
        {"name": "learner", "ready": True, "restartCount": 1, "state": {"running": {}},
         "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]}}, sub="status")
    wait_for(lambda: events(api, "LearnerRestarting"), what="the restart Event")
    assert events(api, "LearnerRestarting")[0]["message"].startswith(
        "learner tpu-0 restarting as a whole: host 0 of 2 lost (pod demo-tpu-0-0: container restarted "
        "(exit code 137, OOMKilled))")
    wait_for(lambda: uids(api).get("demo-tpu-0-1") not in (None, before["demo-tpu-0-1"]), what="host 1 replaced")
    wait_for(lambda: formed(api, "tpu-0") is not None and formed(api, "tpu-0")[0] == f"{victim['metadata']['uid']}/1",
             what="the new run: host 0's new process, host 1's new pod")
    wait_for(lambda: group(api, "tpu")["readmitted"] == 1, what="re-admitted")
    assert uids(api)["demo-tpu-0-0"] == before["demo-tpu-0-0"]  # its process is already new: kept
    # Scaling the group up adds a learner and leaves the running gang alone.
    running = uids(api)
    api.patch(JOB, NAMESPACE, "demo", {"spec": {"learnerGroups": [{**groups[0], "replicas": 2}]}})
    wait_for(lambda: status(api).get("learners") == "2/2" and formed(api, "tpu-1"), what="the second learner")
    assert {k: v for k, v in uids(api).items() if k.startswith("demo-tpu-0-")} == \
        {k: v for k, v in running.items() if k.startswith("demo-tpu-0-")}
    assert group(api, "tpu")["restarts"] == 1 and len(events(api, "LearnerRestarting")) == 1
