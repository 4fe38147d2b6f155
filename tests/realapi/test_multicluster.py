"""One job across three real clusters as one object (issue 63; tests/realapi/multicluster.py).

Three Kubernetes 1.20 control planes on this machine, home and two remotes (east, west), each
with the chart installed by helm and its own operator running as the chart's ServiceAccount;
the home operator writes into the remotes as multiCluster.remoteAccess's ServiceAccount, whose
Role there is get/create/update/delete of jobs and Secrets in the jobs' namespace (the audit
logs show it used nothing else and was refused nothing). One `kubectl apply` of one home job
on the home cluster runs a learner in each cluster (pods as local processes) against a syncer
of two shards exposed as shard-<i>.<host> with TLS, every learner pushing to both shards; each
shard's standby runs in cluster west (issue 62), one syncer a shard there and one at home, racing
for the shard's lease in a bucket. Then: the cluster holding the leases loses its syncers (the
other cluster's take over, every region pushing on); a remote API server paused for 60 s (a
condition and an Event on the home job within seconds, training on, its part reconciled and
nothing lost when it answers); a hand edit of a remote part put back; the home API server paused (the remote learners train on, read from the
syncer itself); and the home job deleted (the remote parts gone within seconds, no Secret
left). The measured figures are printed (`-s`); docs/DEVELOPMENT.md quotes them.

Every test stands alone: the `job` fixture applies the home job when it is missing (the
deletion test removes it) and waits until all three clusters train.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from diloco.operator.kube import ApiError
from diloco.operator.remote.clients import connect
from diloco.operator.render import naming as n
from diloco.spec import KIND
from tests.helpers import wait_for
from tests.realapi.cluster import JOBS, SERVICE_ACCOUNT, SYSTEM
from tests.realapi.multicluster import (
    HOME_ACCOUNT,
    HOME_ROLE_VERBS,
    HOME_USER,
    LEASE_SECONDS,
    NAME,
    REGIONS,
    REMOTES,
    SHARDS,
    STANDBY,
    STANDBY_HOST,
    Clusters,
    audit,
    condition,
    events,
    exposed,
    home_job,
    job_token,
    kubeconfig_secret,
    part,
    progress,
    refused,
    shard_replies,
    status,
    three_clusters,
    training,
    trains,
)

pytestmark = [pytest.mark.realapi, pytest.mark.e2e, pytest.mark.timeout(300)]
REACHABLE = "ClustersReachable"
REMOTE_OUTAGE = 60.0  # seconds a remote API server stays paused
HOME_OUTAGE = 15.0  # seconds the home API server stays paused (under the node monitor's 20 s grace)


@pytest.fixture(scope="module")
def clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Clusters]:
    """Home and two remotes; after the module's last test, whatever the order: no request of
    either operator identity refused by RBAC, the home identity in the remotes using the verbs
    of its Role only, and none of its writes refused by a remote's admission."""
    t0 = time.monotonic()
    with three_clusters(tmp_path_factory.mktemp("realapi-multicluster")) as c:
        print(f"\nthree control planes, charts and operators ready in {time.monotonic() - t0:.1f} s")
        yield c
        for name, cluster in c.all().items():
            assert not refused(cluster, SERVICE_ACCOUNT), (name, refused(cluster, SERVICE_ACCOUNT))
        for name in REMOTES:
            remote = c.remotes[name]
            assert not refused(remote, HOME_USER), (name, refused(remote, HOME_USER))
            used = Counter(e["verb"] for e in audit(remote, HOME_USER))
            assert set(used) <= HOME_ROLE_VERBS, (name, used)
            print(f"\nthe home operator's requests in {name}: {dict(sorted(used.items()))}")
            assert not [r for r in remote.gate.refused if r.user == HOME_USER], remote.gate.refused


@pytest.fixture
def job(clusters: Clusters) -> str:
    """The home job, applied with kubectl on the home cluster if missing (its remote parts of an
    earlier one gone first), and training in all three clusters."""
    c = clusters
    if c.home.job(NAME).get("metadata", {}).get("deletionTimestamp"):
        wait_for(lambda: not c.home.job(NAME), timeout=60, what="the deleted home job gone")
    if not c.home.job(NAME):
        for name in REMOTES:
            wait_for(lambda name=name: part(c.remotes[name]) == (None, None), timeout=60,
                     what=f"the earlier job's part in {name} gone")
        manifest = Path(c.home.plane.folder).parent / "home-job.yaml"
        manifest.write_text(yaml.safe_dump(home_job(c.bucket.url)))
        t0 = time.monotonic()
        c.home.kubectl("apply", "-f", str(manifest))
        trains(c, 240)
        print(f"\nkubectl apply -> all three regions contributing, both remotes reachable: "
              f"{time.monotonic() - t0:.1f} s")
    trains(c, 120)
    return NAME


def test_one_apply_trains_in_three_clusters_through_both_shards(clusters: Clusters, job: str, tmp_path: Path) -> None:
    c = clusters
    # The home cluster runs its own group and the syncer, each shard exposed on its own.
    for i in range(SHARDS):
        svc = c.home.admin.get("Service", JOBS, n.exposed_syncer(job, i))
        assert svc is not None and svc["spec"]["type"] == "LoadBalancer", svc
    assert c.home.admin.get("StatefulSet", JOBS, n.statefulset(job, "home")) is not None
    # Each remote runs its part, written by the home operator, with the job's token and the
    # syncer's CA in Secret <job>-syncer: east a learners-only job dialling both syncers of each
    # shard by name (home's, then the standby's in west); west its learner and each shard's
    # standby, paired with the home syncers, on that token (spec.syncer.tokenSecret).
    for name in REMOTES:
        remote, secret = part(c.remotes[name])
        assert remote is not None and secret is not None, name
        assert remote["metadata"]["labels"]["diloco.dev/home-job"] == f"{JOBS}.{job}"
        assert [g["name"] for g in remote["spec"]["learnerGroups"]] == [name]
        assert remote["status"]["phase"] == "Running" and remote["status"]["learners"] == "1/1", remote["status"]
        syncers = c.remotes[name].admin.list("Deployment", JOBS, n.selector(job, n.SYNCER))
        if name == STANDBY:
            assert remote["spec"]["syncer"]["standby"]["peers"] == [exposed(i) for i in range(SHARDS)]
            assert remote["spec"]["syncer"]["expose"]["host"] == STANDBY_HOST and "external" not in remote["spec"]["syncer"]
            assert remote["spec"]["syncer"]["tokenSecret"] == n.syncer(job) and set(secret["data"]) == {"token", "ca.crt"}
            assert c.remotes[name].admin.get("Secret", JOBS, n.token_secret(job)) is None  # none of its own
            assert sorted((d["metadata"]["name"], d["spec"]["replicas"]) for d in syncers) == \
                [(n.syncer_shard(job, i), 1) for i in range(SHARDS)]
        else:
            assert remote["spec"]["syncer"]["external"]["endpoints"] == \
                [f"{exposed(i)}|{exposed(i, STANDBY_HOST)}" for i in range(SHARDS)]
            assert set(secret["data"]) == {"token", "ca.crt"} and not syncers  # learners only
    # One syncer a shard at home too (its pair's other member is west's).
    assert sorted((d["metadata"]["name"], d["spec"]["replicas"]) for d in
                  c.home.admin.list("Deployment", JOBS, n.selector(job, n.SYNCER))) == \
        [(n.syncer_shard(job, i), 1) for i in range(SHARDS)]
    # The home cluster's kubeconfig Secrets log in with the remote Role and nothing more: no
    # listing there, no Secret outside the jobs' namespace.
    for name in REMOTES:
        login = connect(kubeconfig_secret(name), c.home.admin.get("Secret", SYSTEM, kubeconfig_secret(name)),
                        "diloco-tests (probe)", str(tmp_path))
        for path in (f"api/v1/namespaces/{JOBS}/secrets", f"api/v1/namespaces/{SYSTEM}/secrets/{HOME_ACCOUNT}-token",
                     f"apis/diloco.dev/v1alpha1/namespaces/{JOBS}/decoupleddilocojobs"):
            with pytest.raises(ApiError) as denied:
                login.request("GET", path)
            assert denied.value.status == 403, (name, path)
    # Every learner pushes to both shards: each shard's own Status shows all three regions' contributions.
    token = job_token(c)

    def everywhere() -> list[Any]:
        replies = shard_replies(c, token)
        return replies if all({x.region for x in r.regions if x.contributions > 0} == set(REGIONS.values())
                               for r in replies) else []

    replies = wait_for(everywhere, timeout=60, period=1.0, what="every region's contributions on both shards")
    assert sorted(r.shard for r in replies) == list(range(SHARDS)) and all(r.shards == SHARDS for r in replies)
    # One status on the home job: every region (from the syncer), both remotes, their groups, progress.
    s = status(c.home)
    assert {r["region"] for r in s["regions"]} == set(REGIONS.values())
    assert {g["name"]: g.get("cluster") for g in s["learnerGroups"]} == {"home": None, "east": "east", "west": "west"}
    assert condition(c.home, REACHABLE)["status"] == "True"
    assert s["outerVersion"] > 0 and s["tokensMerged"] > 0 and re.fullmatch(r"[0-9]+%", s.get("progress") or ""), s
    assert s["syncer"]["exposedAddress"] == ",".join(exposed(i) for i in range(SHARDS))
    table = c.home.kubectl("get", "ddj", "-n", JOBS, job)
    print(f"\nhome job: outerVersion {s['outerVersion']}, tokensMerged {s['tokensMerged']} ({s['progress']} of "
          f"the token budget), regions "
          f"{ {r['region']: r['contributions'] for r in s['regions']} }, clusters "
          f"{ {x['name']: (x['reachable'], x['phase'], x['learners']) for x in s['clusters']} }\n{table}")



def told(c: Clusters, since: float, status: str, reason: str, already: dict[str, int], *,
         timeout: float) -> dict[str, float]:
    """Seconds from `since` until ClustersReachable was `status` and until a new `reason` Event was
    posted on the home job, each the first time it was seen."""
    seen: dict[str, float] = {}

    def both() -> bool:
        now = time.monotonic()
        if "condition" not in seen and condition(c.home, REACHABLE).get("status") == status:
            seen["condition"] = now - since
        if "event" not in seen and len(events(c.home, reason)) > already[reason]:
            seen["event"] = now - since
        return len(seen) == 2

    wait_for(both, timeout=timeout, period=0.2, what=f"ClustersReachable {status} and a {reason} Event")
    return seen

def test_a_remote_api_server_down_a_minute_is_a_condition_then_reconciled(clusters: Clusters, job: str) -> None:
    c, lost = clusters, REMOTES[0]
    remote = c.remotes[lost]
    token = job_token(c)
    before_job, before_secret = part(remote)
    assert before_job is not None and before_secret is not None
    (pod,) = remote.admin.list("Pod", JOBS, n.selector(job, n.LEARNER))
    already = {r: len(events(c.home, r)) for r in ("ClusterUnreachable", "ClusterReachable")}
    region = REGIONS[lost]
    start = progress(c, token)

    remote.plane.pause()
    t0 = time.monotonic()
    try:
        seen = told(c, t0, "False", "ClusterUnreachable", already, timeout=30)
        cond = condition(c.home, REACHABLE)
        assert cond["reason"] == "ClusterUnreachable" and f"cluster {lost}:" in cond["message"], cond
        entry = next(x for x in status(c.home)["clusters"] if x["name"] == lost)
        assert entry["reachable"] is False and entry["learners"] == "1/1", entry  # its last known, kept
        assert {g.get("cluster") for g in status(c.home)["learnerGroups"]} >= {lost}  # its group still shown
        during = progress(c, token)
        time.sleep(max(0.0, REMOTE_OUTAGE - (time.monotonic() - t0)))
        late = progress(c, token)
        home_version = status(c.home).get("outerVersion", 0)
    finally:
        remote.plane.resume()
    t1 = time.monotonic()
    # Training went on: the outer version rose, and the cut-off cluster's learner pushed to both shards.
    assert late["version"] > during["version"] > start["version"], (start, during, late)
    assert all(late["regions"][(region, i)] > start["regions"][(region, i)] for i in range(SHARDS)), (start, late)
    back = told(c, t1, "True", "ClusterReachable", already, timeout=60)
    # Nothing lost: the same part, the same learner process, still training.
    after_job, after_secret = part(remote)
    assert after_job is not None and after_job["metadata"]["uid"] == before_job["metadata"]["uid"]
    assert after_secret is not None and after_secret["metadata"]["uid"] == before_secret["metadata"]["uid"]
    (again,) = remote.admin.list("Pod", JOBS, n.selector(job, n.LEARNER))
    assert again["metadata"]["uid"] == pod["metadata"]["uid"]
    assert again["status"]["containerStatuses"][0]["restartCount"] == 0
    wait_for(lambda: all(progress(c, token)["regions"].get((region, i), 0) > late["regions"][(region, i)]
                         for i in range(SHARDS)), timeout=60, period=1.0, what=f"{lost}'s learner pushing on")
    trains(c, 60, "the home status whole again")
    assert status(c.home)["outerVersion"] >= home_version
    print(f"\n{lost}'s API server paused {t1 - t0:.0f} s: ClustersReachable False after {seen['condition']:.1f} s, "
          f"ClusterUnreachable Event after {seen['event']:.1f} s; outer version {start['version']} -> "
          f"{late['version']} meanwhile ({region} pushes per shard {[start['regions'][(region, i)] for i in range(SHARDS)]}"
          f" -> {[late['regions'][(region, i)] for i in range(SHARDS)]}); condition: {cond['message'][:150]!r}; "
          f"resumed: True after "
          f"{back['condition']:.1f} s, ClusterReachable Event after {back['event']:.1f} s")


def test_the_syncers_cluster_lost_the_standbys_in_another_cluster_take_over(clusters: Clusters, job: str) -> None:
    """Issue 62: each shard's standby in another cluster. The cluster holding the shards' leases
    loses its syncers (SIGKILL, as with the cluster: no final checkpoint, no handover); the other
    cluster's syncers take the leases from the bucket and serve, every region's learners find them
    (each dials both), the home status names them, and training goes on: nothing merged lost."""
    c = clusters
    token = job_token(c)
    both = {"home": c.home, STANDBY: c.remotes[STANDBY]}

    def pods(where: str) -> list[dict[str, Any]]:
        return both[where].admin.list("Pod", JOBS, n.selector(job, n.SYNCER))

    def holders() -> list[str]:
        return ((status(c.home).get("syncer") or {}).get("active") or "").split(",")

    def where(holder: str) -> str | None:
        return next((w for w in both if holder in {p["metadata"]["name"] for p in pods(w)}), None)

    def held_in(cluster: str) -> bool:
        return len(holders()) == SHARDS and all(where(h) == cluster for h in holders())

    # Each shard's lease is held, at home or in west (the two raced for it); the cluster holding
    # shard 0's loses its syncers, so every shard ends up served from the other one.
    wait_for(lambda: len(holders()) == SHARDS and all(where(h) for h in holders()), timeout=60, period=0.5,
             what="every shard's lease holder named in the home status")
    lost = where(holders()[0])
    assert lost is not None
    (rest,) = set(both) - {lost}
    moved = sum(where(h) == lost for h in holders())
    before = progress(c, token)
    epoch, takeovers = status(c.home)["syncer"]["leaseEpoch"], status(c.home)["syncer"].get("takeovers") or 0
    already = len(events(c.home, "SyncerTakeover"))
    victims = pods(lost)
    t0 = time.monotonic()
    for pod in victims:
        both[lost].runtime.kill(pod, signal.SIGKILL)
    seen: dict[str, float] = {}

    def taken() -> bool:
        now = time.monotonic()
        if "status" not in seen and held_in(rest):
            seen["status"] = now - t0
        if "event" not in seen and len(events(c.home, "SyncerTakeover")) > already:
            seen["event"] = now - t0
        return len(seen) == 2

    wait_for(taken, timeout=60, period=0.2, what=f"the home status naming {rest}'s syncers and a SyncerTakeover Event")
    after = status(c.home)["syncer"]
    assert after["leaseEpoch"] >= epoch + moved and after["takeovers"] >= takeovers + moved, after
    # Every region's learner pushes on to both shards, now served from the other cluster, and the
    # outer version never went back (what was merged before the kill is in the bucket's checkpoint
    # or handed back by the learners that held it).
    # The new holders count contributions from their own start: compare with what they said first.
    def answering() -> dict[str, Any] | None:
        now = progress(c, token)
        return now if now["version"] >= 0 else None

    serving = wait_for(answering, timeout=30, period=0.5, what=f"{rest}'s syncers answering Status")
    wait_for(lambda: all(progress(c, token)["regions"].get((region, i), 0) > serving["regions"].get((region, i), 0)
                         for region in REGIONS.values() for i in range(SHARDS)), timeout=90, period=1.0,
             what=f"every region pushing to both shards through {rest}'s syncers")
    pushed = time.monotonic() - t0
    late = progress(c, token)
    assert late["version"] >= before["version"], (before, late)
    trains(c, 60, "the home status whole again")
    print(f"\nthe {lost} cluster's syncers SIGKILLed: {rest}'s took every shard's lease; the home status named them "
          f"after {seen['status']:.1f} s, a SyncerTakeover Event after {seen['event']:.1f} s, every region pushing to "
          f"both shards again after {pushed:.1f} s (lease {LEASE_SECONDS:.0f} s); outer version {before['version']} "
          f"-> {late['version']}")


def test_a_hand_edit_of_a_remote_part_is_put_back(clusters: Clusters, job: str) -> None:
    c, name = clusters, REMOTES[0]
    remote = c.remotes[name]
    put_back = f"cluster {name}: replaced {KIND} {JOBS}/{job}"

    def put_backs() -> int:
        return sum(put_back in e["message"] for e in events(c.home, "RemotePartsUpdated"))

    already = put_backs()
    remote.kubectl("patch", "ddj", "-n", JOBS, job, "--type=json", "-p",
                   json.dumps([{"op": "replace", "path": "/spec/learnerGroups/0/replicas", "value": 2}]))
    t0 = time.monotonic()
    wait_for(lambda: (part(remote)[0] or {})["spec"]["learnerGroups"][0]["replicas"] == 1, timeout=30, period=0.1,
             what="the remote part's replicas put back")
    took = time.monotonic() - t0
    wait_for(lambda: put_backs() > already, timeout=30, what="a RemotePartsUpdated Event naming the put-back")
    wait_for(lambda: len(remote.admin.list("Pod", JOBS, n.selector(job, n.LEARNER))) == 1, timeout=60,
             what=f"one learner in {name} again")
    trains(c, 60)
    print(f"\na hand edit of {name}'s part (replicas 1 -> 2) put back after {took:.1f} s (status every 1 s)")


def test_the_home_api_server_down_remote_learners_train_on(clusters: Clusters, job: str) -> None:
    c = clusters
    token = job_token(c)
    parts = {name: (part(c.remotes[name])[0] or {})["metadata"]["uid"] for name in REMOTES}
    version = status(c.home)["outerVersion"]
    c.home.plane.pause()
    t0 = time.monotonic()
    try:
        start = progress(c, token)
        time.sleep(max(0.0, HOME_OUTAGE - (time.monotonic() - t0)))
        late = progress(c, token)
    finally:
        c.home.plane.resume()
    t1 = time.monotonic()
    assert late["version"] > start["version"] >= 0, (start, late)
    for name in REMOTES:
        region = REGIONS[name]
        assert all(late["regions"][(region, i)] > start["regions"][(region, i)] for i in range(SHARDS)), (name, late)
    # Reconciled after: the home status moves on, both remotes reachable, the same parts.
    wait_for(lambda: status(c.home).get("outerVersion", 0) >= late["version"] > version and training(c),
             timeout=60, period=0.5, what="the home status caught up")
    caught_up = time.monotonic() - t1
    assert condition(c.home, REACHABLE)["status"] == "True"
    assert {name: (part(c.remotes[name])[0] or {}).get("metadata", {}).get("uid") for name in REMOTES} == parts
    for name in REMOTES:
        (pod,) = c.remotes[name].admin.list("Pod", JOBS, n.selector(job, n.LEARNER))
        assert pod["status"]["containerStatuses"][0]["restartCount"] == 0, name
    print(f"\nhome API server paused {t1 - t0:.0f} s: outer version {start['version']} -> {late['version']} on the "
          f"syncer meanwhile, remote pushes per shard "
          f"{ {r: [late['regions'][(REGIONS[r], i)] - start['regions'][(REGIONS[r], i)] for i in range(SHARDS)] for r in REMOTES} }; "
          f"home status caught up {caught_up:.1f} s after it answered")


def test_deleting_the_home_job_deletes_the_remote_parts(clusters: Clusters, job: str) -> None:
    c = clusters
    c.home.kubectl("delete", "ddj", "-n", JOBS, job, "--wait=false")
    t0 = time.monotonic()
    gone: dict[str, float] = {}

    def parts_gone() -> bool:
        for name in REMOTES:
            if name not in gone and part(c.remotes[name]) == (None, None):
                gone[name] = time.monotonic() - t0
        if "home" not in gone and not c.home.job(job):
            gone["home"] = time.monotonic() - t0
        return len(gone) == len(REMOTES) + 1

    wait_for(parts_gone, timeout=60, period=0.1, what="both remote parts and the home job gone")
    for name in REMOTES:
        left = c.remotes[name].admin.list("Secret", JOBS, {"diloco.dev/home-job": f"{JOBS}.{job}"})
        assert left == [], (name, [s["metadata"]["name"] for s in left])
        wait_for(lambda name=name: not c.remotes[name].admin.list("Pod", JOBS, n.selector(job)), timeout=60,
                 what=f"{name}'s learner pods gone")
    wait_for(lambda: all(any(f"cluster {name}: deleted {KIND} {JOBS}/{job}" in e["message"]
                             for e in events(c.home, "RemotePartsDeleted")) for name in REMOTES),
             timeout=30, what="the RemotePartsDeleted Event")
    print("\nhome job deleted: " + ", ".join(f"{k}'s part gone after {v:.1f} s" for k, v in gone.items()
                                             if k != "home") + f"; the home job gone after {gone['home']:.1f} s")
