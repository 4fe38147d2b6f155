"""Pure status logic: conditions, phases, goodput, endings, pod losses and chaos schedules."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from diloco.contract import LearnerId
from diloco.operator.failures import chaos, pods
from diloco.operator.render import access
from diloco.operator.render import naming as n
from diloco.operator.status import conditions
from diloco.operator.status import job as st
from diloco.spec import JobSpec, parse_job

US1 = LearnerId("us", 1)

T0 = 1_800_000_000.0


def spec(**extra: Any) -> JobSpec:
    return parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "j"},
                      "spec": {"learnerGroups": [{"name": "us", "replicas": 2}, {"name": "eu", "replicas": 2}],
                               **extra}}).spec


def view(active: int = 4, tokens: int = 0) -> st.SyncerView:
    return st.SyncerView(incarnation="i1", outer_version=12, tokens_merged=tokens, active_learners=active,
                         readmissions=1)


def obs(now: float = T0, ready: dict[str, int] | None = None, **kw: Any) -> st.Observation:
    return st.Observation(now=now, ready={"us": 2, "eu": 2} if ready is None else ready, syncer_endpoint="j-syncer:1",
                          syncer_ready=True, **kw)


def test_condition_keeps_transition_time_until_status_flips() -> None:
    c = conditions.set_condition([], "Running", True, reason="LearnersTraining", message="", now="t1", generation=1)
    c = conditions.set_condition(c, "Running", True, reason="LearnersTraining", message="other message", now="t2",
                                 generation=2)
    assert (c[0]["lastTransitionTime"], c[0]["observedGeneration"]) == ("t1", 2)
    c = conditions.set_condition(c, "Running", False, reason="NotRunning", message="", now="t3", generation=2)
    assert c[0]["lastTransitionTime"] == "t3" and c[0]["status"] == "False"


def test_running_degraded_and_counts() -> None:
    s = st.compute(spec(), {}, obs(syncer=view()), generation=1)
    assert (s["phase"], s["learners"], s["outerVersion"], s["startTime"]) == ("Running", "4/4", 12, st.rfc3339(T0))
    assert conditions.is_true(s["conditions"], "Created") and not conditions.is_true(s["conditions"], "Degraded")
    s2 = st.compute(spec(), {**s, "lostLearners": [{"slot": "us-1", "reason": "Deleted"}]},
                    obs(T0 + 5, ready={"us": 1, "eu": 2}, syncer=view(active=3)), generation=1)
    degraded = conditions.find(s2["conditions"], "Degraded")
    assert s2["phase"] == "Running" and degraded["status"] == "True" and "lost: us-1" in degraded["message"]
    assert s2["syncer"]["readmissions"] == 1


def test_availability_is_active_over_desired_learner_time() -> None:
    s = st.compute(spec(), {}, obs(syncer=view(active=4)), generation=1)
    s = st.compute(spec(), s, obs(T0 + 10, syncer=view(active=4)), generation=1)
    s = st.compute(spec(), s, obs(T0 + 20, syncer=view(active=2)), generation=1)
    assert s["availability"] == pytest.approx(0.75)  # 10 s at 4/4, 10 s at 2/4
    gap = st.compute(spec(), s, obs(T0 + 20 + 3600, syncer=view(active=0)), generation=1)
    assert gap["availability"] == s["availability"]  # the operator was down: nothing is guessed
    assert "goodput" not in s  # no step time measured yet: no capacity to divide by


def regional(us_tokens: int, eu_tokens: int, refused: int, active: int = 4, step: float = 0.1) -> st.SyncerView:
    regions = tuple(st.RegionView(region=r, learners=2, active_learners=active // 2, tokens_merged=t, bytes_received=0,
                                  contributions=0, mean_staleness=0.0, step_seconds=step)
                    for r, t in (("us", us_tokens), ("eu", eu_tokens)))
    return st.SyncerView(incarnation="i1", outer_version=12, tokens_merged=us_tokens + eu_tokens, active_learners=active,
                         readmissions=0, regions=regions, refused=refused)


def two_regions() -> JobSpec:
    return parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "j"},
                      "spec": {"learnerGroups": [{"name": "us", "region": "us", "replicas": 2},
                                                 {"name": "eu", "region": "eu", "replicas": 2}]}}).spec


def test_a_connected_learner_whose_pushes_are_all_refused_is_available_and_not_productive() -> None:
    """Four learners connected for 100 s at 0.1 s steps (batch 8 x context 128 = 1024 tokens a
    step): capacity 4 x 1000 x 1024 tokens. The us pair's pushes are merged; the eu pair's are
    all refused (one a step each): availability 1, goodput the us pair's half, badput refused."""
    job = two_regions()
    per_learner = 1000 * job.tokens_per_step
    s = st.compute(job, {}, obs(ready={"us": 2, "eu": 2}, syncer=regional(0, 0, 0)), generation=1)
    s = st.compute(job, s, obs(T0 + 100, ready={"us": 2, "eu": 2}, syncer=regional(2 * per_learner, 0, 2000)),
                   generation=1)
    assert s["availability"] == 1.0
    assert s["goodput"] == pytest.approx(0.5)
    assert s["badput"] == {"down": 0.0, "refused": 0.5, "other": 0.0}
    honest = st.compute(job, {}, obs(ready={"us": 2, "eu": 2}, syncer=regional(0, 0, 0)), generation=1)
    honest = st.compute(job, honest, obs(T0 + 100, ready={"us": 2, "eu": 2},
                                         syncer=regional(2 * per_learner, 2 * per_learner, 0)), generation=1)
    assert honest["goodput"] == 1.0 and honest["availability"] == 1.0


def test_goodput_counts_down_learners_against_the_capacity_and_only_this_clusters_regions() -> None:
    job = two_regions()
    per_learner = 1000 * job.tokens_per_step
    s = st.compute(job, {}, obs(syncer=regional(0, 0, 0, active=2)), generation=1)
    # Half the learners down for 100 s; the up half trained at full speed; another cluster's
    # region merged tokens too, which this cluster's goodput does not claim.
    other = st.RegionView(region="asia", learners=2, active_learners=2, tokens_merged=10**9, bytes_received=0,
                          contributions=0, mean_staleness=0.0, step_seconds=0.1)
    view = regional(2 * per_learner, 0, 0, active=2)
    view = dataclasses.replace(view, regions=(*view.regions, other))
    s = st.compute(job, s, obs(T0 + 100, syncer=view), generation=1)
    assert s["availability"] == pytest.approx(0.5) and s["goodput"] == pytest.approx(0.5)
    assert s["badput"]["down"] == pytest.approx(0.5) and s["badput"]["refused"] == 0.0


def test_suspended_pending_and_invalid() -> None:
    assert st.compute(spec(suspend=True), {}, obs(ready={}), generation=1)["phase"] == "Suspended"
    running = st.compute(spec(), {}, obs(), generation=1)
    paused = st.compute(spec(suspend=True), running, obs(T0 + 50, ready={}), generation=2)
    assert paused["startTime"] is None  # removed by the merge patch: the deadline restarts on resume
    assert st.compute(spec(), {**running, **paused}, obs(T0 + 90), generation=3)["startTime"] == st.rfc3339(T0 + 90)
    assert st.compute(spec(), {}, obs(ready={}), generation=1)["phase"] == "Pending"
    bad = st.invalid({}, ["spec.syncer.quorum: 9 exceeds the 4 learners"], 3, T0)
    failed = conditions.find(bad["conditions"], "Failed")
    assert (bad["phase"], failed["reason"], bad["observedGeneration"]) == ("Failed", "InvalidSpec", 3)
    fixed = st.compute(spec(), bad, obs(syncer=view()), generation=4)
    assert fixed["phase"] == "Running" and conditions.find(fixed["conditions"], "Failed")["status"] == "False"


@pytest.mark.parametrize("extra, after, observed, expected", [
    ({"training": {"tokenBudget": 1000}}, 0, {"syncer": view(tokens=1000)}, (True, "TokenBudgetReached")),
    ({"training": {"durationSeconds": 60}}, 61, {}, (True, "DurationReached")),
    ({"runPolicy": {"activeDeadlineSeconds": 60}}, 61, {}, (False, "DeadlineExceeded")),
    ({"runPolicy": {"backoffLimit": 2}}, 0, {"syncer_restarts": 3}, (False, "BackoffLimitExceeded")),
    ({"runPolicy": {"activeDeadlineSeconds": 60}}, 59, {}, None),
])
def test_endings(extra: dict[str, Any], after: float, observed: dict[str, Any], expected: Any) -> None:
    status = {"startTime": st.rfc3339(T0)}
    end = st.ending(spec(**extra), status, obs(T0 + after, **observed))
    assert (end.succeeded, end.reason) == expected if expected else end is None
    if end:
        done = st.compute(spec(**extra), status, obs(T0 + after, **observed), generation=1, ended=end)
        assert done["phase"] == ("Succeeded" if end.succeeded else "Failed") and st.finished(done)


def pod(name: str = "j-us-1", uid: str = "u1", **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": uid, "namespace": "ns",
                         "labels": {"diloco.dev/job": "j", "diloco.dev/component": "learner", "diloco.dev/group": "us",
                                    "apps.kubernetes.io/pod-index": "1"}}, "status": status}


def test_loss_reasons() -> None:
    assert pods.loss("DELETED", pod()).reason == "Deleted"
    preempted = pod(conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}])
    preempted["metadata"]["deletionTimestamp"] = "2027-01-01T00:00:00Z"
    assert pods.loss("MODIFIED", preempted).reason == "Preempted"
    assert pods.loss("MODIFIED", pod(phase="Failed", reason="Evicted")).reason == "Evicted"
    crashed = pod(phase="Running", containerStatuses=[{"name": "learner", "ready": False, "restartCount": 2,
                                                       "lastState": {"terminated": {"exitCode": 3}}}])
    assert pods.loss("MODIFIED", crashed).reason == "Failed"
    assert pods.loss("MODIFIED", pod(phase="Running")) is None
    assert pods.ready(pod(phase="Running", conditions=[{"type": "Ready", "status": "True"}]))


def test_spot_reclaims_and_node_shutdowns_are_preemptions_node_pressure_an_eviction() -> None:
    def disrupted(why: str, **status: Any) -> dict[str, Any]:
        p = pod(conditions=[{"type": "DisruptionTarget", "status": "True", "reason": why}], **status)
        p["metadata"]["deletionTimestamp"] = "2027-01-01T00:00:00Z"
        return p

    assert pods.loss("MODIFIED", disrupted("DeletionByTaintManager")).reason == "Preempted"  # the node went
    assert pods.loss("MODIFIED", disrupted("TerminationByKubelet")).reason == "Preempted"  # graceful shutdown
    assert pods.loss("MODIFIED", disrupted("TerminationByKubelet", reason="Evicted")).reason == "Evicted"
    assert pods.loss("MODIFIED", pod(phase="Failed", reason="Terminated")).reason == "Preempted"  # before 1.26


def test_chaos_kills_and_rollouts_are_planned_restarts_not_losses() -> None:
    deleted = pods.loss("DELETED", pod())
    killed = pod()
    killed["metadata"]["annotations"] = {n.CHAOS: "true"}
    assert pods.planned(deleted, killed, None) == pods.Loss("Chaos", "pod j-us-1 deleted by chaos", planned=True)
    rolled = pod()
    rolled["metadata"]["labels"][pods.REVISION] = "j-us-aaa"
    assert pods.planned(deleted, rolled, "j-us-bbb").reason == "Rollout"  # replaced for the new template
    assert pods.planned(deleted, rolled, "j-us-aaa") == deleted  # current revision: a real loss
    preempted = pods.Loss("Preempted", "x")
    assert pods.planned(preempted, rolled, "j-us-bbb") == preempted  # the cluster's doing, whatever the revision
    status: dict[str, Any] = {"learnerGroups": [{"name": "us", "lost": 0, "preempted": 0, "readmitted": 0}]}
    status.update(pods.record_loss(status, US1, lost=pods.planned(deleted, killed, None), pod_uid="u1", now=T0))
    assert (status["learnerGroups"][0]["lost"], status["learnerGroups"][0]["planned"]) == (0, 1)
    assert [x["slot"] for x in status["lostLearners"]] == [str(US1)]  # down until it is back


def test_a_slot_is_lost_once_until_readmitted() -> None:
    status: dict[str, Any] = {"learnerGroups": [{"name": "us", "lost": 0, "preempted": 0, "readmitted": 0}]}
    loss = pods.Loss("Deleted", "pod j-us-1 deleted")
    patch = pods.record_loss(status, US1, lost=loss, pod_uid="u1", now=T0)
    status.update(patch)
    assert status["learnerGroups"][0]["lost"] == 1
    assert pods.record_loss(status, US1, lost=loss, pod_uid="u1", now=T0) is None  # the DELETED after Terminating
    assert pods.record_loss(status, US1, lost=loss, pod_uid="u2", now=T0) is None  # a replacement crashing before ready
    status.update(pods.record_ready(status, US1))
    assert (status["learnerGroups"][0]["readmitted"], status["lostLearners"]) == (1, [])
    assert pods.record_ready(status, US1) is None
    status.update(pods.record_loss(status, US1, lost=pods.Loss("Preempted", ""), pod_uid="u3", now=T0))
    assert (status["learnerGroups"][0]["lost"], status["learnerGroups"][0]["preempted"]) == (1, 1)


def test_stuck_pods_are_those_past_grace_plus_timeout() -> None:
    old = {"metadata": {"name": "a", "deletionTimestamp": st.rfc3339(T0 - 200)}}
    new = {"metadata": {"name": "b", "deletionTimestamp": st.rfc3339(T0 - 10)}}
    assert pods.stuck([old, new, pod()], T0, 120) == [old]


def test_chaos_plan_respects_max_concurrent_and_targets() -> None:
    job = spec(chaos={"enabled": True, "meanSecondsBetweenKills": 1.0, "maxConcurrent": 1})
    ready = []
    for group, i in (("us", 0), ("us", 1), ("eu", 0), ("eu", 1)):
        x = pod(f"j-{group}-{i}", f"{group}{i}", phase="Running", conditions=[{"type": "Ready", "status": "True"}])
        x["metadata"]["labels"].update({"diloco.dev/group": group, "apps.kubernetes.io/pod-index": str(i)})
        ready.append(x)
    state = chaos.state(job.chaos, {}, T0)
    assert state == {"seed": 0, "meanSecondsBetweenKills": 1.0, "since": T0, "kills": 0}
    kills = chaos.plan(job, state, ready, T0 + 100)
    assert len(kills) == 1 and kills[0].number == 0  # a hundred due, one at a time
    assert chaos.plan(job, state, ready[:3], T0 + 100) == []  # one learner already down
    assert chaos.state(job.chaos, {"chaos": {**state, "kills": 5}}, T0 + 9)["kills"] == 5  # survives restarts


def remote(**extra: Any) -> JobSpec:
    return spec(syncer={"external": {"endpoint": "syncer.example.com:50051", "tokenSecret": "home"}},
                data={"shards": 8}, learnerGroups=[{"name": "us", "replicas": 2, "shardOffset": 4},
                                                   {"name": "eu", "replicas": 2, "shardOffset": 6}], **extra)


def test_regions_come_from_the_syncer_and_outlive_its_silence() -> None:
    regions = (st.RegionView("europe-west4", 2, 2, 5000, 1 << 20, 40, 0.25),
               st.RegionView("us-central1", 4, 3, 9000, 2 << 20, 80, 0.1234))
    v = st.SyncerView(incarnation="i1", outer_version=12, tokens_merged=14000, active_learners=5, readmissions=0,
                      regions=regions)
    s = st.compute(remote(), {}, obs(syncer=v), generation=1)
    assert s["regions"][1] == {"region": "us-central1", "learners": 4, "activeLearners": 3, "tokensMerged": 9000,
                               "bytesReceived": 2 << 20, "contributions": 80, "meanStaleness": 0.123}
    assert s["syncer"]["external"] is True and s["phase"] == "Running"
    eu = spec(learnerGroups=[{"name": "eu", "region": "europe-west4", "replicas": 4}])
    assert st.own_active(eu, v) == 2 and st.own_active(eu, dataclasses.replace(v, regions=())) == 5
    quiet = st.compute(remote(), s, st.Observation(now=T0 + 5, ready={"us": 2, "eu": 2},
                                                   syncer_endpoint="syncer.example.com:50051",
                                                   syncer_error="UNAVAILABLE"), generation=1)
    assert quiet["regions"] == s["regions"] and quiet["tokensMerged"] == 14000  # the last known picture
    running = conditions.find(quiet["conditions"], "Running")
    assert (running["status"], running["reason"], quiet["phase"]) == ("False", "SyncerUnreachable", "Pending")
    assert "syncer.example.com:50051" in running["message"] and "UNAVAILABLE" in running["message"]


def test_a_blocker_is_the_running_condition() -> None:
    blocker = access.Blocker("SecretMissing", "Secret home (spec.syncer.external.tokenSecret) does not exist")
    s = st.compute(remote(), {}, obs(ready={}, blocker=blocker), generation=1)
    running = conditions.find(s["conditions"], "Running")
    assert (s["phase"], running["status"], running["reason"]) == ("Pending", "False", "SecretMissing")
    assert running["message"] == blocker.message and not conditions.is_true(s["conditions"], "Failed")
    assert st.compute(remote(), s, obs(T0 + 5, syncer=view()), generation=1)["phase"] == "Running"  # recovers


def test_referenced_secrets_are_checked_by_name_and_key() -> None:
    job = parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "j"},
                     "spec": {"learnerGroups": [{"name": "us"}],
                              "syncer": {"expose": {"tls": {"secretName": "j-tls"}}}}})
    assert [r[0] for r in access.referenced(job)] == ["j-tls"]
    missing = access.secret_blocker(job, {"j-tls": None})
    assert missing is not None and missing.reason == "SecretMissing" and "Secret j-tls" in missing.message
    partial = access.secret_blocker(job, {"j-tls": {"data": {"tls.crt": "eA==", "tls.key": "!!"}}})
    assert partial is not None and partial.reason == "SecretIncomplete"
    assert "has no tls.key, ca.crt" in partial.message  # not base64 counts as missing
    assert access.secret_blocker(job, {"j-tls": {"data": {k: "eA==" for k in ("tls.crt", "tls.key", "ca.crt")}}}) \
        is None
    link = access.link(job, "ns", {})
    assert (link.address, link.token_secret, link.ca_secret) == ("j-syncer.ns.svc:50051", "j-token", "j-tls")


def test_only_an_unauthenticated_answer_refuses_a_remote_token() -> None:
    job = parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "j"},
                     "spec": {"learnerGroups": [{"name": "eu", "shardOffset": 1}], "data": {"shards": 2},
                              "syncer": {"external": {"endpoint": "s.example.com:443", "tokenSecret": "home"}}}})
    link = access.link(job, "ns", {"home": {"data": {"token": "dA=="}}})
    refused = access.refused(job, link, "UNAUTHENTICATED")
    assert refused is not None and refused.reason == "SyncerUnauthenticated"
    assert "Secret home" in refused.message and "j-token" in refused.message
    assert access.refused(job, link, "UNAVAILABLE") is None and access.refused(job, link, "") is None


def test_the_active_syncer_its_epoch_and_takeovers() -> None:
    """spec.syncer.standby: the lease's holder and epoch ride in the incarnation; a higher epoch
    after a known one is a takeover, counted once, and an Event's reason and message."""
    def leased(host: str, epoch: int) -> st.SyncerView:
        return dataclasses.replace(view(), incarnation=f"{host}/0123456789ab@{epoch}")

    s1 = st.compute(spec(), {}, obs(syncer=leased("j-syncer-a", 1)), generation=1)
    assert (s1["syncer"]["active"], s1["syncer"]["leaseEpoch"], s1["syncer"]["takeovers"]) == ("j-syncer-a", 1, 0)
    silent = st.compute(spec(), s1, obs(T0 + 5), generation=1)  # the syncer does not answer: the last known
    assert (silent["syncer"]["active"], silent["syncer"]["leaseEpoch"]) == ("j-syncer-a", 1)
    s2 = st.compute(spec(), silent, obs(T0 + 10, syncer=leased("j-syncer-b", 2)), generation=1)
    assert (s2["syncer"]["active"], s2["syncer"]["leaseEpoch"], s2["syncer"]["takeovers"]) == ("j-syncer-b", 2, 1)
    reason, message = st.takeover(silent, s2)  # type: ignore[misc]
    assert reason == "SyncerTakeover" and "j-syncer-b" in message and "j-syncer-a" in message
    s3 = st.compute(spec(), s2, obs(T0 + 15, syncer=leased("j-syncer-b", 2)), generation=1)
    assert s3["syncer"]["takeovers"] == 1 and st.takeover(s2, s3) is None
    plain = st.compute(spec(), {}, obs(syncer=view()), generation=1)  # no lease: none of these fields
    assert not {"active", "leaseEpoch", "takeovers"} & set(plain["syncer"])


def test_a_sharded_standby_names_each_shards_holder_and_counts_every_shards_takeovers() -> None:
    """A sharded syncer's incarnation joins its shards' (diloco/shards.py `aggregate`): `active`
    names each shard's lease holder in shard order, `leaseEpochs` keeps each shard's epoch and
    `leaseEpoch` their sum; a shard's higher epoch is one takeover, whichever shard, and the
    Event names the shard, its new holder and its old one."""
    sharded = spec(syncer={"checkpoints": {"url": "s3://b/j"}, "standby": {}, "fragments": 2, "shards": 2})

    def leased(*holders: tuple[str, int]) -> st.SyncerView:
        return dataclasses.replace(view(), incarnation="+".join(f"{h}/0123456789ab@{e}" for h, e in holders))

    def fields(s: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(s["syncer"].get(k) for k in ("active", "leaseEpoch", "leaseEpochs", "takeovers"))

    s1 = st.compute(sharded, {}, obs(syncer=leased(("j-syncer-shard-0-a", 1), ("j-syncer-shard-1-a", 1))), generation=1)
    assert fields(s1) == ("j-syncer-shard-0-a,j-syncer-shard-1-a", 2, [1, 1], 0)
    # Shard 1's active is killed: the Status RPC fails (its Service has no ready pod) until its
    # standby serves; the status keeps the last known meanwhile.
    silent = st.compute(sharded, s1, obs(T0 + 5, syncer_error="UNAVAILABLE"), generation=1)
    assert fields(silent) == fields(s1) and "incarnation" not in silent["syncer"]
    s2 = st.compute(sharded, silent, obs(T0 + 10, syncer=leased(("j-syncer-shard-0-a", 1), ("j-syncer-shard-1-b", 2))),
                    generation=1)
    assert fields(s2) == ("j-syncer-shard-0-a,j-syncer-shard-1-b", 3, [1, 2], 1)
    reason, message = st.takeover(silent, s2)  # type: ignore[misc]
    assert reason == "SyncerTakeover" and message.startswith(
        "shard 1: syncer j-syncer-shard-1-b took over the lease (epoch 2) from j-syncer-shard-1-a; learners re-join")
    assert "shard 0" not in message
    same = leased(("j-syncer-shard-0-a", 1), ("j-syncer-shard-1-b", 2))
    s3 = st.compute(sharded, s2, obs(T0 + 15, syncer=same), generation=1)
    assert fields(s3) == fields(s2) and st.takeover(s2, s3) is None and s3["syncer"]["incarnation"] == same.incarnation
    # Both shards taken over between two passes: two takeovers, both told.
    s4 = st.compute(sharded, s3, obs(T0 + 20, syncer=leased(("j-syncer-shard-0-b", 2), ("j-syncer-shard-1-a", 3))),
                    generation=1)
    assert fields(s4) == ("j-syncer-shard-0-b,j-syncer-shard-1-a", 5, [2, 3], 3)
    _, both = st.takeover(s3, s4)  # type: ignore[misc]
    assert "shard 0: syncer j-syncer-shard-0-b" in both and "shard 1: syncer j-syncer-shard-1-a" in both
    st.validated(s4)  # leaseEpochs is in the status's schema (the CRD's)
    # A sharded syncer without a standby: no lease, none of these fields.
    plain = st.compute(spec(syncer={"fragments": 2, "shards": 2}), {},
                       obs(syncer=dataclasses.replace(view(), incarnation="aaaa+bbbb")), generation=1)
    assert not {"active", "leaseEpoch", "leaseEpochs", "takeovers"} & set(plain["syncer"])
