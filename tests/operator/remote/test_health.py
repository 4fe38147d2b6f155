"""A home job's remote clusters decided (operator/remote/health.py): the writes, status.clusters,
the remote groups, condition ClustersReachable and the Events, as tables of what was read."""

from __future__ import annotations

from typing import Any

from diloco.operator.remote import health, parts
from diloco.operator.status import conditions as c
from tests.operator.remote.test_parts import home

STAMP = "2026-12-07T04:00:00Z"


def seen(h: parts.Home, name: str, **kw: Any) -> health.Seen:
    cluster = next(x for x in h.job.spec.clusters if x.name == name)
    return health.Seen(cluster, cluster.namespace or "ml", kube="client-" + name, **kw)


def in_place(h: parts.Home, name: str, **status: Any) -> health.Seen:
    cluster = next(x for x in h.job.spec.clusters if x.name == name)
    job = {**parts.desired_job(h, cluster), "status": status}
    return seen(h, name, job=job, secret=parts.desired_secret(h, cluster))


def decide(h: parts.Home, s: list[health.Seen], old: dict[str, Any] | None = None,
           gone: list[health.Seen] | None = None) -> tuple[health.Remote, list[dict[str, Any]]]:
    return health.decide(h, s, gone or [], old or {}, [], stamp=STAMP, generation=3)


def test_a_new_home_job_writes_each_part_secret_first() -> None:
    h = home()
    done, conds = decide(h, [seen(h, "eu"), seen(h, "asia")])
    assert [(w.cluster, w.verb, w.kind, w.namespace) for w in done.writes] == [
        ("eu", "create", "Secret", "ml"), ("eu", "create", "DecoupledDiLoCoJob", "ml"),
        ("asia", "create", "Secret", "train"), ("asia", "create", "DecoupledDiLoCoJob", "train")]
    assert all(w.kube == f"client-{w.cluster}" for w in done.writes)
    assert c.is_true(conds, health.CONDITION) and done.events == ()
    assert [(x["name"], x["reachable"], x["kubeconfigSecret"]) for x in done.clusters] == [
        ("eu", True, "diloco-eu"), ("asia", True, "diloco-asia")]


def test_parts_in_place_are_left_alone_and_their_groups_shown() -> None:
    h = home()
    groups = [{"name": "eu", "region": "europe-west4", "desired": 2, "ready": 2}]
    done, conds = decide(h, [in_place(h, "eu", phase="Running", learners="2/2", learnerGroups=groups),
                             in_place(h, "asia", phase="Running", learners="1/1")])
    assert done.writes == () and c.is_true(conds, health.CONDITION)
    assert done.groups == ({**groups[0], "cluster": "eu"},)
    assert [(x["phase"], x["learners"]) for x in done.clusters] == [("Running", "2/2"), ("Running", "1/1")]


def test_a_lost_cluster_is_a_condition_and_one_event_then_reconciled_when_back() -> None:
    h = home()
    groups = [{"name": "eu", "desired": 2, "ready": 2}]
    first, _ = decide(h, [in_place(h, "eu", phase="Running", learners="2/2", learnerGroups=groups),
                          in_place(h, "asia")])
    old = {"clusters": list(first.clusters), "learnerGroups": [{"name": "us"}, *first.groups]}
    down = seen(h, "eu", problem="its API server cannot be reached (NewConnectionError: refused)")
    lost, conds = decide(h, [down, in_place(h, "asia")], old)
    assert not c.is_true(conds, health.CONDITION)
    cond = c.find(conds, health.CONDITION) or {}
    assert cond["reason"] == health.UNREACHABLE and cond["message"].startswith("cluster eu: its API server cannot")
    assert [e.reason for e in lost.events] == [health.UNREACHABLE] and lost.events[0].warning
    eu = lost.clusters[0]
    assert (eu["reachable"], eu["phase"], eu["learners"], eu["lastTransitionTime"]) == (False, "Running", "2/2", STAMP)
    assert lost.groups == ({"name": "eu", "desired": 2, "ready": 2, "cluster": "eu"},)  # the last known
    assert lost.writes == ()
    # Still down a pass later: no second Event. Back: an Event, and the part someone changed meanwhile put back.
    again, _ = decide(h, [down, in_place(h, "asia")], {"clusters": list(lost.clusters)})
    assert again.events == ()
    edited = in_place(h, "eu")
    assert edited.job is not None
    edited.job["spec"]["learnerGroups"][0]["replicas"] = 7
    back, conds = decide(h, [edited, in_place(h, "asia")], {"clusters": list(lost.clusters)})
    assert [e.reason for e in back.events] == [health.REACHABLE] and c.is_true(conds, health.CONDITION)
    assert [(w.verb, w.kind) for w in back.writes] == [("replace", "DecoupledDiLoCoJob")]
    assert back.writes[0].body is not None and back.writes[0].body["spec"]["learnerGroups"][0]["replicas"] == 2


def test_someone_elses_object_of_the_same_name_is_never_overwritten() -> None:
    h = home()
    theirs = in_place(h, "eu")
    assert theirs.job is not None
    theirs.job["metadata"]["annotations"] = {}
    done, conds = decide(h, [theirs, in_place(h, "asia")])
    assert done.writes == ()
    assert (c.find(conds, health.CONDITION) or {})["reason"] == health.CONFLICT
    assert [e.reason for e in done.events] == [health.CONFLICT]


def test_no_part_is_written_before_the_syncer_has_an_address() -> None:
    h = home()
    waiting = parts.Home(h.job, h.uid, h.token, h.ca, [])
    done, conds = decide(waiting, [seen(waiting, "eu"), seen(waiting, "asia")])
    assert done.writes == () and done.clusters[0]["message"].startswith("waiting for the syncer's exposed address")
    assert c.is_true(conds, health.CONDITION)  # nothing is wrong with the clusters


def test_a_cluster_taken_out_of_the_spec_has_its_part_deleted_job_first() -> None:
    h = home()
    old_part = in_place(h, "eu")
    done, _ = decide(h, [in_place(h, "asia")], gone=[old_part])
    assert [(w.verb, w.kind, w.name) for w in done.writes] == [("delete", "DecoupledDiLoCoJob", "big"),
                                                               ("delete", "Secret", "big-syncer")]
