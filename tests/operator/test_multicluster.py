"""Jobs across clusters: two emulated clusters, an operator in each, and one syncer.

The home cluster runs the syncer and exposes it; the remote cluster's job names it in
`spec.syncer.external` and runs learners only, with the home job's token copied into a
Secret. Both custom resources read the global picture (every region) from the syncer. The
fast tests use an in-process syncer and pods without processes; the e2e test trains for
real: the home kubelet runs the syncer (TLS) and a learner, the remote one a learner.
"""

from __future__ import annotations

import base64
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from diloco.operator.context import Config
from diloco.operator.kube import Kube
from diloco.operator.reconcile.children import MANAGED_KINDS
from diloco.operator.render import naming as n
from diloco.trainer.sync.client import SyncerClient
from tests import syncer_harness as sh
from tests.helpers import TINY_MODEL, wait_for
from tests.kube import NAMESPACE
from tests.kube.controllers import Controllers
from tests.kube.multicluster import local_syncer, secret, site, tls_for
from tests.kube.processes import ProcessRuntime
from tests.kube.running import OperatorThread

pytest_plugins = ["tests.kube.fixtures"]
FAST = Config(status_interval=0.5, chaos_interval=0.25, stuck_timeout=1.0)
JOB = "DecoupledDiLoCoJob"


def manifest(spec: dict[str, Any], name: str = "mc") -> dict[str, Any]:
    return {"apiVersion": "diloco.dev/v1alpha1", "kind": JOB, "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": spec}


def home_spec(**syncer: Any) -> dict[str, Any]:
    return {"learnerGroups": [{"name": "us", "region": "us-central1", "replicas": 1}], "data": {"shards": 3},
            "syncer": {"fragments": 2, "remoteRegions": ["europe-west4"], **syncer}}


def remote_spec(endpoint: str, replicas: int = 2, **external: Any) -> dict[str, Any]:
    return {"learnerGroups": [{"name": "eu", "region": "europe-west4", "replicas": replicas, "shardOffset": 1}],
            "data": {"shards": 3},
            "syncer": {"fragments": 2, "external": {"endpoint": endpoint, "tokenSecret": "mc-home", **external}}}


def status(api: Kube, name: str = "mc") -> dict[str, Any]:
    return (api.get(JOB, NAMESPACE, name) or {}).get("status") or {}


def condition(api: Kube, type_: str, name: str = "mc") -> dict[str, Any]:
    return next((c for c in status(api, name).get("conditions") or [] if c["type"] == type_), {})


def events(api: Kube, reason: str) -> list[dict[str, Any]]:
    items = api.request("GET", f"api/v1/namespaces/{NAMESPACE}/events").get("items") or []
    return [e for e in items if e.get("reason") == reason]


def children_of(api: Kube, job: str = "mc") -> set[tuple[str, str]]:
    return {(k, o["metadata"]["name"]) for k in (*MANAGED_KINDS, "GRPCRoute")
            for o in api.list(k, NAMESPACE, {n.JOB: job})}


def token_of(api: Kube, job: str = "mc") -> str:
    return base64.b64decode(api.get("Secret", NAMESPACE, n.token_secret(job))["data"]["token"]).decode()


def regions(api: Kube) -> dict[str, int]:
    return {r["region"]: r["learners"] for r in status(api).get("regions") or []}


def blocked_with(api: Kube, reason: str) -> dict[str, Any]:
    """The remote job waits with `reason`, and runs no learner (nor anything else but its config)."""
    running = wait_for(lambda: (c := condition(api, "Running")).get("reason") == reason and c, what=reason)
    assert running["status"] == "False" and status(api)["phase"] == "Pending"
    wait_for(lambda: children_of(api) == {("ConfigMap", "mc-config")} and api.list("Pod", NAMESPACE) == [],
             what="no learners")
    wait_for(lambda: events(api, reason), what=f"a {reason} Event")
    return dict(running)


@pytest.mark.slow
def test_remote_cluster_waits_for_its_secret_and_token_then_runs_learners_only() -> None:
    home_address: dict[str, str] = {}
    home_config = dataclasses.replace(FAST, syncer_address=lambda job, ns: home_address.get("syncer", "127.0.0.1:9"))
    with site(home_config) as home, site(FAST) as remote:
        home.api.create(manifest(home_spec(expose={"tls": {"enabled": False}})))
        wait_for(lambda: status(home.api).get("phase") == "Running", what="the home job running")
        token = token_of(home.api)
        with local_syncer(token, {"us-central1", "europe-west4"}) as address:
            home_address["syncer"] = address
            remote.api.create(manifest(remote_spec(address)))
            missing = blocked_with(remote.api, "SecretMissing")
            assert "Secret mc-home (spec.syncer.external.tokenSecret) does not exist" in missing["message"]
            remote.api.create(secret("mc-home", {"note": b"the token goes here"}))
            assert "Secret mc-home (spec.syncer.external.tokenSecret) has no token" in \
                blocked_with(remote.api, "SecretIncomplete")["message"]
            remote.api.patch("Secret", NAMESPACE, "mc-home", {"data": {"token": base64.b64encode(b"x" * 43).decode()}})
            refused = blocked_with(remote.api, "SyncerUnauthenticated")
            assert f"the syncer at {address} refused the token in Secret mc-home" in refused["message"]

            remote.api.patch("Secret", NAMESPACE, "mc-home", secret("mc-home", {"token": token.encode()}))
            wait_for(lambda: status(remote.api).get("learners") == "2/2" and status(remote.api)["phase"] == "Running",
                     what="the remote learners")
            assert children_of(remote.api) == {("ConfigMap", "mc-config"), ("StatefulSet", "mc-eu"),
                                               ("Service", "mc-eu")}  # no syncer, checkpoint volume or token
            (c,) = remote.api.get("StatefulSet", NAMESPACE, "mc-eu")["spec"]["template"]["spec"]["containers"]
            assert c["args"][c["args"].index("--syncer") + 1] == address
            pod = remote.api.get("StatefulSet", NAMESPACE, "mc-eu")["spec"]["template"]["spec"]
            assert {"secretName": "mc-home", "items": [{"key": "token", "path": "token"}]}.items() <= \
                next(v["secret"] for v in pod["volumes"] if v["name"] == "token").items()  # the copy, as a file
            assert status(remote.api)["syncer"] == {"endpoint": address, "ready": True, "restarts": 0, "external": True,
                                                    "incarnation": status(home.api)["syncer"]["incarnation"],
                                                    "activeLearners": 0, "readmissions": 0}

            # Learners of both clusters join: each custom resource shows every region.
            for learner, region in (("us-0", "us-central1"), ("eu-0", "europe-west4"), ("eu-1", "europe-west4")):
                client = SyncerClient(address, token, learner, region)
                client.join(dict(sh.SHAPES))
                client.close()
            for api in (home.api, remote.api):
                wait_for(lambda api=api: regions(api) == {"us-central1": 1, "europe-west4": 2}, what="regions")
            assert [g["name"] for g in status(remote.api)["learnerGroups"]] == ["eu"]  # its own learners only
            # The copied Secret goes: learners go too (they could not restart), and come back with it.
            remote.api.delete("Secret", NAMESPACE, "mc-home")
            blocked_with(remote.api, "SecretMissing")
            remote.api.create(secret("mc-home", {"token": token.encode()}))
            wait_for(lambda: status(remote.api).get("learners") == "2/2", what="the learners back")
            assert status(remote.api)["learnerGroups"][0]["lost"] == 0 and not events(remote.api, "LearnerLost")
            # The cloud provisions the load balancer: the home status says where remote clusters dial.
            home.api.patch("Service", NAMESPACE, "mc-syncer-exposed",
                           {"status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.7"}]}}}, sub="status")
            wait_for(lambda: status(home.api)["syncer"].get("exposedAddress") == "198.51.100.7:50051",
                     what="the exposed address")


@pytest.mark.slow
def test_jobs_managed_elsewhere_are_left_alone(api: Kube, controllers: Controllers) -> None:
    """MultiKueue's manager cluster holds the job with managedBy set; its workers run the copies."""
    with OperatorThread(FAST) as op:
        api.create(manifest({**home_spec(), "managedBy": "kueue.x-k8s.io/multikueue"}, "dispatched"))
        api.create(manifest(home_spec(), "witness"))
        wait_for(lambda: status(api, "witness").get("phase") == "Running", what="the witness job running")
        op.ticks(4)  # timers and events had every chance
    job = api.get(JOB, NAMESPACE, "dispatched")
    assert "status" not in job and not job["metadata"].get("finalizers")
    assert not [k for k in job["metadata"].get("annotations") or {} if k.startswith("diloco.dev")]
    assert children_of(api, "dispatched") == set()


def test_grpc_route_exposure_follows_the_spec(api: Kube, controllers: Controllers) -> None:
    with OperatorThread(dataclasses.replace(FAST, gateway_api=True)):
        expose = {"type": "GRPCRoute", "host": "syncer.example.test", "gateway": {"name": "edge"},
                  "tls": {"enabled": False}}
        api.create(manifest(home_spec(expose=expose)))
        wait_for(lambda: ("GRPCRoute", "mc-syncer-exposed") in children_of(api), what="the GRPCRoute")
        wait_for(lambda: status(api).get("syncer", {}).get("exposedAddress") == "syncer.example.test:443",
                 what="its host and the listener's port")
        api.patch(JOB, NAMESPACE, "mc", {"spec": {"syncer": {"expose": {"type": "LoadBalancer", "gateway": None}}}})
        wait_for(lambda: ("Service", "mc-syncer-exposed") in children_of(api)
                 and ("GRPCRoute", "mc-syncer-exposed") not in children_of(api), what="a LoadBalancer instead")
        api.patch(JOB, NAMESPACE, "mc", {"spec": {"syncer": {"expose": None}}})
        wait_for(lambda: not {c for c in children_of(api) if c[1] == "mc-syncer-exposed"}, what="exposure removed")


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_learners_in_two_clusters_train_with_one_syncer_over_tls(tmp_path: Path) -> None:
    host = "syncer.mc.example.test"
    tls = tls_for(host)
    runtimes: dict[str, ProcessRuntime] = {}

    def runtime(name: str, first_cpu: int) -> Any:
        def make(api: Kube) -> ProcessRuntime:
            runtimes[name] = ProcessRuntime(api, NAMESPACE, tmp_path / name, first_cpu=first_cpu)
            return runtimes[name]
        return make

    home_config = dataclasses.replace(
        FAST, status_interval=1.0, syncer_address=lambda job, ns: runtimes["home"].local(n.syncer_address(job, ns)))
    training = {"model": TINY_MODEL, "training": {"batchSize": 8, "warmupSteps": 10, "decaySteps": 5000,
                                            "evalIntervalSteps": 100000}}
    with site(home_config, runtime("home", 0), period=0.2) as home, \
            site(dataclasses.replace(FAST, status_interval=1.0), runtime("remote", 1), period=0.2) as remote:
        home.api.create(tls.secret("mc-syncer-tls"))
        home.api.create(manifest({**home_spec(expose={"host": host, "tls": {"secretName": "mc-syncer-tls"}}),
                                  **training}))
        # The address the home cluster's load balancer would have: the syncer's local port here.
        endpoint = runtimes["home"].local(n.syncer_address("mc", NAMESPACE))
        remote.api.create(manifest({**remote_spec(endpoint, replicas=1, serverName=host), **training}))
        blocked_with(remote.api, "SecretMissing")
        wait_for(lambda: status(home.api).get("syncer", {}).get("incarnation"), timeout=60,
                 what="the home syncer answering over TLS")
        remote.api.create(secret("mc-home", {"token": b"y" * 43, "ca.crt": tls.ca}))
        blocked_with(remote.api, "SyncerUnauthenticated")  # the real syncer refused it, over TLS
        remote.api.patch("Secret", NAMESPACE, "mc-home",
                         {"data": {"token": base64.b64encode(token_of(home.api).encode()).decode()}})

        def trained(api: Kube) -> bool:
            s = status(api)
            by_region = {r["region"]: r for r in s.get("regions") or []}
            return s.get("phase") == "Running" and s["learners"] == "1/1" and \
                set(by_region) == {"us-central1", "europe-west4"} and \
                all(r["tokensMerged"] > 0 and r["contributions"] > 0 for r in by_region.values())

        wait_for(lambda: trained(home.api) and trained(remote.api), timeout=150, period=0.5,
                 what="both clusters' learners ready, both regions contributing merges, seen from both clusters")
        for api in (home.api, remote.api):
            s = status(api)
            assert s["tokensMerged"] >= sum(r["tokensMerged"] for r in s["regions"]) > 0
            assert s["outerVersion"] > 0 and s["syncer"]["ready"] and s["syncer"]["activeLearners"] == 2
        assert children_of(remote.api) == {("ConfigMap", "mc-config"), ("StatefulSet", "mc-eu"), ("Service", "mc-eu")}
        (learner,) = runtimes["remote"].logs_of("mc-eu-0")  # joined once: never refused, never restarted
        assert '"event": "joined"' in learner and '"region": "europe-west4"' in learner
