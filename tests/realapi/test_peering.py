"""Two operator replicas, one active (kopf's peering), against the real control plane (tests/realapi/).

A cluster of its own: the chart installed as usual (its peering CRDs and ClusterKopfPeering),
and two operator replicas in this process, each logged in as the chart's ServiceAccount through
a network path of its own (tests/realapi/link.py), each with its own peering identity, priority
and User-Agent, as two pods of the chart's Deployment are. Replica "a" starts first, so it ranks
higher and acts; "b" stands by. Killing "a" cuts its path to the API server: nothing of it
arrives any more, no clean-up of its peering record either, as when its node dies. The audit
log, which names each request's User-Agent, shows who wrote what and when.
"""

from __future__ import annotations

import datetime as dt
import json
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from diloco.operator.kube import Kube, replica_agent
from diloco.operator.peering import LIFETIME, Peering, kopf_agent
from diloco.operator.render import naming as n
from tests.helpers import wait_for
from tests.kube.running import OperatorThread
from tests.realapi.cluster import JOBS, PEERING, SERVICE_ACCOUNT, Cluster, real_cluster, service_account_token
from tests.realapi.controlplane import ControlPlane, free_port
from tests.realapi.link import Link
from tests.realapi.test_operator import tiny_job

pytestmark = [pytest.mark.realapi, pytest.mark.e2e, pytest.mark.timeout(300)]
A, B = "replica-a", "replica-b"  # pod names
POOL = "diloco.dev/test-pool"  # a node label no node has: the learners stay Pending, no process starts
WRITES = {"create", "update", "patch", "delete"}
TAKEOVER = 30.0  # seconds: the standby completes a scale within this of the active one's death


class Replicas:
    """The second replica and both network paths, beside the cluster's own operator (replica a)."""

    def __init__(self) -> None:
        self.links: dict[str, Link] = {}
        self.b: OperatorThread | None = None
        self.b_health = 0

    def kube(self, pod: str, plane: ControlPlane, token: str) -> Kube:
        link = self.links[pod] = Link(plane.url).__enter__()
        return Kube(link.url, token=token, ca_file=str(plane.ca_file), user_agent=replica_agent({"POD_NAME": pod}))


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Replicas]]:
    r = Replicas()
    with ExitStack() as stack:
        stack.callback(lambda: [link.cut() for link in r.links.values()])  # last, after both replicas stopped
        cluster = stack.enter_context(real_cluster(tmp_path_factory.mktemp("realapi-peering"), identity=A,
                                                   operator_kube=lambda plane, token: r.kube(A, plane, token)))
        kube_b = r.kube(B, cluster.plane, service_account_token(cluster.admin))
        r.b_health = free_port()
        r.b = stack.enter_context(OperatorThread(cluster.operator.ctx.config, kube=kube_b,
                                                 peering=Peering.start(PEERING, B), liveness_port=r.b_health))
        yield cluster, r


def peers(cluster: Cluster) -> dict[str, Any]:
    got = cluster.admin.request("GET", f"apis/kopf.dev/v1/clusterkopfpeerings/{PEERING}")
    return dict(got.get("status") or {})


def writes(cluster: Cluster) -> list[tuple[float, str, str, str, str]]:
    """(received, pod, verb, resource, User-Agent) of every completed write the operator's ServiceAccount made
    in the jobs' namespace (the job, its children, Events), oldest first."""
    out = []
    for line in Path(cluster.plane.audit_log).read_text().splitlines():
        e = json.loads(line) if line.strip() else {}
        ref = e.get("objectRef") or {}
        if (e.get("stage") == "ResponseComplete" and e.get("verb") in WRITES and ref.get("namespace") == JOBS
                and e.get("user", {}).get("username") == SERVICE_ACCOUNT):
            agent = e.get("userAgent", "")
            pod = A if f"({A})" in agent else B if f"({B})" in agent else agent
            at = dt.datetime.fromisoformat(e["requestReceivedTimestamp"].replace("Z", "+00:00")).timestamp()
            resource = ref.get("resource", "") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
            out.append((at, pod, e["verb"], f"{resource} {ref.get('name', '')}", agent))
    return sorted(out)


def log_since(cluster: Cluster, since: float) -> list[tuple[float, str, str, str, str]]:
    return [w for w in writes(cluster) if w[0] >= since]


def healthy(port: int) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
        return bool(response.status == 200)


def test_the_standby_takes_over_a_scale_within_seconds_and_only_one_replica_writes_at_a_time(
        replicas: tuple[Cluster, Replicas]) -> None:
    cluster, r = replicas
    job = tiny_job("scaled", replicas=1)
    job["spec"]["learnerGroups"][0]["nodeSelector"] = {POOL: "none"}
    job["spec"]["data"] = {"shards": 2}  # data split for the most learners it will have: scaling up is allowed
    cluster.admin.create(job)
    learners = n.statefulset("scaled", "local")
    wait_for(lambda: (cluster.admin.get("StatefulSet", JOBS, learners) or {}).get("spec", {}).get("replicas") == 1
             and (cluster.job("scaled").get("status") or {}).get("desiredLearners") == 1, timeout=60,
             what="the active replica rendered the job")

    # Both replicas are in the peering object, the first started ranks higher; the standby is
    # paused (it has written nothing) yet its liveness endpoint answers, so the kubelet keeps it.
    both = wait_for(lambda: (p := peers(cluster)).keys() >= {A, B} and p, timeout=30, what="both replicas peering")
    assert both[A]["priority"] > both[B]["priority"] and both[A]["lifetime"] == LIFETIME, both
    assert healthy(r.b_health)
    before = writes(cluster)
    assert before and {pod for _, pod, *_ in before} == {A}, before

    # Replica a's node dies the moment the job is scaled: its network goes first, then the
    # process (through its stop flag: a kopf that stops by itself SIGKILLs its thread, here
    # this whole test process).
    r.links[A].cut()
    killed = time.time()
    cluster.operator.kill()
    cluster.admin.patch("DecoupledDiLoCoJob", JOBS, "scaled", {"spec": {"learnerGroups": [
        {**job["spec"]["learnerGroups"][0], "replicas": 2}]}})
    generation = cluster.job("scaled")["metadata"]["generation"]

    def scaled() -> bool:
        sts = cluster.admin.get("StatefulSet", JOBS, learners) or {}
        status = cluster.job("scaled").get("status") or {}
        return (sts.get("spec", {}).get("replicas") == 2 and status.get("observedGeneration") == generation
                and status.get("desiredLearners") == 2 and status["learnerGroups"][0]["desired"] == 2)

    try:
        wait_for(scaled, timeout=TAKEOVER, what=f"the standby completing the scale within {TAKEOVER:.0f} s")
    except AssertionError as e:
        sts = (cluster.admin.get("StatefulSet", JOBS, learners) or {}).get("spec", {}).get("replicas")
        raise AssertionError(f"{e}: peers {peers(cluster)}, StatefulSet replicas {sts}, job "
                             f"{cluster.job('scaled').get('status')}, writes since {log_since(cluster, killed)}") from None
    took = time.time() - killed
    print(f"takeover: the scale completed {took:.1f} s after the active replica's death (lifetime {LIFETIME} s)")

    # The audit log: replica a wrote until it died and never after; b wrote nothing before and
    # everything after, the learners' StatefulSet patch among it: one writer at a time.
    log = wait_for(lambda: (w := writes(cluster)) and w[-1][1] == B and w, timeout=10, what="b's writes logged")
    sequence = [pod for _, pod, *_ in log]
    assert set(sequence) == {A, B}, sequence
    first_b = sequence.index(B)
    assert A not in sequence[first_b:], f"a wrote after b took over: {log[first_b:]}"
    assert all(at <= killed for at, pod, *_ in log if pod == A), [w for w in log if w[1] == A and w[0] > killed]
    assert all(at >= killed for at, pod, *_ in log if pod == B), [w for w in log if w[1] == B and w[0] < killed]
    assert any(pod == B and what == f"statefulsets {learners}" for _, pod, _, what, _ in log), log[first_b:]
    # Both of b's clients name it: the operator's own (children) and kopf's (the job's annotations).
    assert {agent for _, pod, *_, agent in log if pod == B} == {replica_agent({"POD_NAME": B}),
                                                                 kopf_agent(replica_agent({"POD_NAME": B}))}, log
    # b found a's record expired and removed it (kopf's clean-up of a dead peer).
    wait_for(lambda: A not in peers(cluster) and B in peers(cluster), timeout=30, what="a's record removed by b")
    cluster.kubectl("delete", "ddj", "-n", JOBS, "scaled")
