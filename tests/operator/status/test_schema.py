"""Every status the operator writes fits JobStatus and the CRD's status schema.

The API server prunes a status field its structural schema lacks without a word, so each
representative status below (running, lost and re-admitted learners, finished, invalid,
permanent failures, a refused edit, multi-host restarts, suspended, an external syncer, chaos)
is checked against both the pydantic model and the CRD's own schema: a new field written
without a schema fails here.
"""

from __future__ import annotations

from typing import Any

import jsonschema
import pydantic
import pytest

from diloco.contract import LearnerId
from diloco.operator import crd
from diloco.operator.admission import immutable
from diloco.operator.failures import chaos, gangs, pods
from diloco.operator.failures import policy as failures
from diloco.operator.render import access
from diloco.operator.status import conditions as c
from diloco.operator.status import job as st
from diloco.spec import JobSpec, JobStatus, parse_job
from tests.operator.test_crd import json_schema

T0 = 1_800_000_000.0
UID = "5f0c-job-uid"


def spec(**extra: Any) -> JobSpec:
    return parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "j"},
                      "spec": {"learnerGroups": [{"name": "us", "region": "us-central1", "replicas": 2},
                                                 {"name": "eu", "region": "europe-west4", "replicas": 2}],
                               **extra}}).spec


def view(tokens: int = 5000, active: int = 4) -> st.SyncerView:
    regions = (st.RegionView("europe-west4", 2, active // 2, tokens // 2, 1 << 20, 40, 0.25, 0.08),
               st.RegionView("us-central1", 2, active - active // 2, tokens // 2, 2 << 20, 80, 0.1234, 0.05))
    return st.SyncerView(incarnation="61297fb1efe6", outer_version=12, tokens_merged=tokens, active_learners=active,
                         readmissions=1, regions=regions)


def obs(now: float = T0, ready: dict[str, int] | None = None, **kw: Any) -> st.Observation:
    return st.Observation(now=now, ready={"us": 2, "eu": 2} if ready is None else ready,
                          syncer_endpoint="j-syncer.ns.svc:50051", syncer_ready=True, **kw)


def pod(name: str, uid: str, group: str = "us", index: int = 0, **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": uid, "namespace": "ns",
                         "labels": {"diloco.dev/job": "j", "diloco.dev/component": "learner", "diloco.dev/group": group,
                                    "apps.kubernetes.io/pod-index": str(index)}}, "status": status}


SCHEMA = jsonschema.Draft4Validator(json_schema(crd.status_schema()))


def empty_strings(value: Any, node: dict[str, Any], path: str = "status") -> list[str]:
    """Paths of empty strings whose schema node is not nullable: a 1.20 API server refuses them
    (its validator takes "" for null), and with them the whole status patch."""
    if isinstance(value, dict) and "properties" in node:
        return [p for k, v in value.items() for p in empty_strings(v, node["properties"].get(k, {}), f"{path}.{k}")]
    if isinstance(value, list) and "items" in node:
        return [p for i, v in enumerate(value) for p in empty_strings(v, node["items"], f"{path}[{i}]")]
    return [path] if value == "" and not node.get("nullable") else []


def check(status: dict[str, Any]) -> dict[str, Any]:
    """The status (whole, or a merge patch), accepted by the model and by the CRD's schema."""
    JobStatus.model_validate(status)
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in SCHEMA.iter_errors(status)]
    assert not errors, errors
    assert not empty_strings(status, crd.status_schema())
    return status


def test_running_lost_readmitted_and_finished() -> None:
    s = check(st.compute(spec(), {}, obs(syncer=view()), generation=1))
    assert s["phase"] == "Running" and s["regions"] and s["syncer"]["incarnation"]
    s = check(st.compute(spec(), s, obs(T0 + 10, syncer=view(active=4)), generation=1))
    assert {"goodput", "availability", "badput"} <= set(s) and s["accounting"]["desiredLearnerSeconds"] > 0
    us1 = LearnerId("us", 1)
    for lost in (pods.Loss("Deleted", "pod j-us-1 deleted"), pods.Loss("Preempted", "pod j-eu-0: preempted")):
        learner = us1 if lost.reason == "Deleted" else LearnerId("eu", 0)
        s = {**s, **check(pods.record_loss(s, learner, lost=lost, pod_uid="u1", now=T0 + 15) or {})}
    s = check(st.compute(spec(), s, obs(T0 + 20, ready={"us": 1, "eu": 1}, syncer=view(active=2)), generation=1))
    assert c.is_true(s["conditions"], c.DEGRADED) and len(s["lostLearners"]) == 2
    s = {**s, **check(pods.record_ready(s, us1) or {})}
    budget = spec(training={"tokenBudget": 5000})
    end = st.ending(budget, s, obs(T0 + 30, syncer=view()))
    assert end is not None and end.reason == "TokenBudgetReached"
    done = check(st.compute(budget, s, obs(T0 + 30, syncer=view()), generation=1, ended=end))
    assert done["phase"] == "Succeeded" and done["completionTime"] and st.finished(done)
    check(st.compute(budget, done, obs(T0 + 40, ready={}), generation=1))  # a finished job's later passes


def test_invalid_suspended_blocked_and_external() -> None:
    bad = check(st.invalid({}, ["spec.syncer.quorum: 9 exceeds the 4 learners"], 3, T0))
    assert bad["phase"] == "Failed"
    running = check(st.compute(spec(), bad, obs(syncer=view()), generation=4))
    paused = check(st.compute(spec(suspend=True), running, obs(T0 + 50, ready={}), generation=5))
    assert paused["phase"] == "Suspended" and paused["startTime"] is None  # null: the merge patch clears it
    external = spec(syncer={"external": {"endpoint": "syncer.example.com:50051", "tokenSecret": "home"}},
                    data={"shards": 8}, learnerGroups=[{"name": "us", "replicas": 2, "shardOffset": 4}])
    blocker = access.Blocker("SecretMissing", "Secret home (spec.syncer.external.tokenSecret) does not exist")
    blocked = check(st.compute(external, {}, obs(ready={}, blocker=blocker), generation=1))
    assert c.find(blocked["conditions"], c.RUNNING)["reason"] == "SecretMissing"  # type: ignore[index]
    silent = check(st.compute(external, blocked, st.Observation(now=T0 + 5, syncer_endpoint="syncer.example.com:50051",
                                                                syncer_error="UNAVAILABLE"), generation=1))
    assert silent["syncer"]["external"] is True
    exposed = check(st.compute(spec(), {}, obs(syncer=view(), exposed_address="syncer.example.com:50051"),
                               generation=1))
    assert exposed["syncer"]["exposedAddress"]


def test_permanent_failures_count_and_end_the_job() -> None:
    limited = spec(runPolicy={"backoffLimit": 0})
    s = check(st.compute(limited, {}, obs(syncer=view()), generation=1))
    waiting = {"name": "learner", "image": "registry.invalid/x:0", "restartCount": 0,
               "state": {"waiting": {"reason": "ErrImagePull", "message": "not found"}}}
    crashed = {"name": "learner", "restartCount": 1, "state": {"running": {}},
               "lastState": {"terminated": {"exitCode": 2, "containerID": "containerd://abc"}}}
    broken = [pod("j-us-0", "u0", containerStatuses=[waiting]), pod("j-eu-1", "u1", "eu", 1, containerStatuses=[crashed])]
    patch, fresh = failures.fold(s, broken, T0 + 5)
    assert len(fresh) == 2 and patch[failures.FIELD]["last"]["at"]
    s = {**s, **check(patch)}
    end = st.ending(limited, s, obs(T0 + 5, syncer=view()))
    assert end is not None and not end.succeeded
    failed = check(st.compute(limited, s, obs(T0 + 5, syncer=view()), generation=1, ended=end))
    assert failed["phase"] == "Failed" and c.is_true(failed["conditions"], c.PODS_FAILING)
    cleared, _ = failures.fold(failed, [], T0 + 10)
    check(st.compute(limited, {**failed, **check(cleared)}, obs(T0 + 10, ready={}), generation=1))


def test_started_spec_and_a_refused_edit() -> None:
    job = spec(syncer={"external": {"endpoint": "syncer.example.com:50051", "tokenSecret": "home"}},
               data={"shards": 8}, learnerGroups=[{"name": "us", "replicas": 2, "shardOffset": 4}])
    s = st.compute(job, {}, obs(syncer=view()), generation=1)
    s = check(immutable.record({}, s, UID, job))
    assert set(s[immutable.FIELD]["fields"]) >= {"model", "data", "syncer.external"}
    edited = job.model_copy(update={"model": job.model.model_copy(update={"d_model": 256})})
    problems = immutable.refused(s[immutable.FIELD]["fields"], edited)
    assert problems
    refused = check(immutable.condition(st.compute(job, s, obs(T0 + 5, syncer=view()), generation=2), s,
                                        problems=problems, now=st.rfc3339(T0 + 5), generation=2))
    assert c.is_true(refused["conditions"], c.SPEC_REJECTED)
    check(immutable.condition(st.compute(job, refused, obs(T0 + 9, syncer=view()), generation=3), refused, problems=[],
                              now=st.rfc3339(T0 + 9), generation=3))


def test_multi_host_learners_runs_and_restarts() -> None:
    job = spec(learnerGroups=[{"name": "tpu", "replicas": 2, "hostsPerLearner": 4}])
    s = check(st.compute(job, {}, obs(ready={"tpu": 2}, syncer=view(active=2)), generation=1))
    assert s["learnerGroups"][0]["restarts"] == 0
    learner = LearnerId("tpu", 0)
    s = {**s, **check(gangs.set_run(s, str(learner), tuple(f"uid{h}/0" for h in range(4))))}
    restart = gangs.Restart(1, 4, pods.Loss("Failed", "pod j-tpu-0-1: container restarted"), ())
    s = {**s, **check(gangs.record_restart(s, learner, restart=restart, lost_uid="uid1", now=T0 + 5))}
    s = check(st.compute(job, s, obs(T0 + 6, ready={"tpu": 1}, syncer=view(active=1)), generation=1))
    assert s["lostLearners"][0]["restart"] and s["learnerGroups"][0]["restarts"] == 1 and s["gangRuns"]


def test_empty_strings_are_written_and_accepted() -> None:
    s = st.compute(spec(), {}, st.Observation(now=T0), generation=1)  # no endpoint yet; conditions without a message
    assert s["syncer"]["endpoint"] == "" and any(x["message"] == "" for x in s["conditions"])
    check(s)
    assert empty_strings({"syncer": {"endpoint": ""}}, {"properties": {"syncer": {"properties": {"endpoint": {}}}}})


def test_chaos_state() -> None:
    job = spec(chaos={"enabled": True, "meanSecondsBetweenKills": 30.0, "seed": 7})
    state = chaos.state(job.chaos, {}, T0)
    check({"chaos": {**state, "kills": 3}})


@pytest.mark.parametrize("typo", [
    {"observedGenerations": 1},  # not a field
    {"observed_generation": 1},  # snake_case: the API server knows camelCase only
    {"learnerGroups": [{"name": "us", "lsot": 1}]},
    {"syncer": {"endpoint": "x:1", "ready": True, "restarts": 0, "activeLearner": 2}},
    {"phase": "Runing"},
    {"learnerGroups": [{"name": "us", "lost": -1}]},
])
def test_a_status_field_without_a_schema_fails(typo: dict[str, Any]) -> None:
    with pytest.raises(pydantic.ValidationError):
        JobStatus.model_validate(typo)
    if "observed_generation" not in typo:  # the schema does not know Python's names either way
        assert list(SCHEMA.iter_errors(typo))
    with pytest.raises(pydantic.ValidationError):
        st.changed({}, {**st.compute(spec(), {}, obs(syncer=view()), generation=1), **typo})  # before any patch


def test_condition_messages_are_cut_to_the_api_limit() -> None:
    conds = c.set_condition([], c.FAILED, True, reason="InvalidSpec", message="x" * 40000, now=st.rfc3339(T0),
                            generation=1)
    check({"conditions": conds})
