"""Three real clusters on this machine for one job across them (tests/realapi/test_multicluster.py).

Each is the lane's cluster (tests/realapi/cluster.py): a Kubernetes 1.20 control plane, a test
kubelet running pods as local processes, the chart installed by helm and its operator in this
process logged in as the chart's ServiceAccount. The home cluster's chart has
multiCluster.home.enabled (its operator may read the kubeconfig Secrets in its own namespace,
those two by name); each remote's has multiCluster.remoteAccess for the jobs' namespace, and the
home cluster's kubeconfig Secret for it is built from that chart's own ServiceAccount token
(`<fullname>-home-token`), the remote's CA and its URL: the home operator writes there with the
documented Role and nothing more.

The job checkpoints to a bucket (moto's S3 server, tests/s3_server.py; its credentials in a
Secret in the home and standby clusters) and has a standby syncer in cluster west
(spec.syncer.standby.cluster): one syncer a shard at home and one in west, racing for each
shard's lease in the bucket.

What stands in for the network between them: each shard's two syncers are exposed (one
LoadBalancer Service each) as `shard-<i>.<HOST>:50051` (home) and `shard-<i>.<STANDBY_HOST>:50051`
(west), which no DNS resolves here; every other cluster's runtime maps those names to the local
ports of those Services (ProcessRuntime.hosts), and the operators' Status RPCs go through the
same mapping (`Dialled`), the certificate (one for both hosts) checked for the name dialled, as
after a DNS lookup.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml

from diloco.contract import SYNCER_GRPC_PORT
from diloco.operator.kube import Kube
from diloco.operator.render import naming as n
from diloco.operator.render.policies import Peers
from diloco.operator.syncer_client import ChannelKey, SyncerClients
from diloco.spec import KIND
from diloco.wire import auth_metadata, channel, pb, rpc
from tests.helpers import TINY_MODEL, wait_for
from tests.kube.multicluster import Tls, tls_for
from tests.kube.processes import ProcessRuntime
from tests.realapi.cluster import JOBS, PEERING, SYSTEM, Cluster, real_cluster
from tests.realapi.controlplane import ControlPlane
from tests.s3_server import Bucket, s3_bucket

NAME = "mc"
HOST = "syncer.mc.test"  # spec.syncer.expose.host: shard i is dialled at shard-<i>.<HOST>:50051
STANDBY_HOST = "standby.mc.test"  # spec.syncer.standby.host: shard i's standby at shard-<i>.<STANDBY_HOST>:50051
SHARDS = 2
REMOTES = ("east", "west")
STANDBY = "west"  # spec.syncer.standby.cluster
STORE_SECRET = f"{NAME}-store"  # the bucket's credentials, in the home and standby clusters
LEASE_SECONDS = 4.0  # spec.syncer.standby.leaseSeconds: a takeover within seconds
REGIONS = {"home": "us-central1", "east": "europe-west4", "west": "asia-southeast1"}  # by cluster
HOME_ACCOUNT = f"{PEERING}-home"  # multiCluster.remoteAccess's ServiceAccount (and `-token` Secret)
HOME_USER = f"system:serviceaccount:{SYSTEM}:{HOME_ACCOUNT}"  # the home operator, as a remote sees it
HOME_ROLE_VERBS = {"get", "create", "update", "delete"}  # the chart's Role for it (templates/multicluster.yaml)
TLS_SECRET = f"{NAME}-syncer-tls"


def kubeconfig_secret(remote: str) -> str:
    return f"{remote}-kubeconfig"


def exposed(shard: int, host: str = HOST) -> str:
    """Where a learner of another cluster dials shard `shard` (at home, or its standby's at STANDBY_HOST)."""
    return f"shard-{shard}.{host}:{SYNCER_GRPC_PORT}"


@dataclass
class Clusters:
    home: Cluster
    remotes: dict[str, Cluster]
    tls: Tls
    bucket: Bucket

    def all(self) -> dict[str, Cluster]:
        return {"home": self.home, **self.remotes}


class Dialled(SyncerClients):
    """An operator's syncer clients dialling through its cluster's runtime (the Services, pods and
    hosts it maps); a host dialled by name is checked for that name, as after a DNS lookup."""

    def __init__(self, runtime: ProcessRuntime) -> None:
        super().__init__()
        self.runtime = runtime

    def _channel(self, key: ChannelKey) -> Any:
        namespace, job, address, ca, name = key
        if ca is not None and name is None and address in self.runtime.hosts:
            name = address.rsplit(":", 1)[0]
        return super()._channel((namespace, job, self.runtime.dial(address), ca, name))


def own_login(plane: ControlPlane, token: str) -> Kube:
    """Each operator its own cluster's client ($KUBECONFIG names one cluster of three)."""
    return Kube(plane.url, token=token, ca_file=str(plane.ca_file), user_agent=n.MANAGER)


def home_token(remote: Cluster) -> str:
    """multiCluster.remoteAccess's ServiceAccount token, once the token controller has minted it."""
    def minted() -> str | None:
        secret = remote.admin.get("Secret", SYSTEM, f"{HOME_ACCOUNT}-token") or {}
        token = (secret.get("data") or {}).get("token")
        return base64.b64decode(token).decode() if token else None

    return wait_for(minted, timeout=30, what=f"the token of ServiceAccount {HOME_ACCOUNT}")


def login_secret(remote: str, cluster: Cluster) -> dict[str, Any]:
    """The home operator's kubeconfig Secret for `cluster`: its URL, its CA and the remote-access token."""
    config = {"apiVersion": "v1", "kind": "Config", "current-context": remote,
              "clusters": [{"name": remote, "cluster": {
                  "server": cluster.plane.url,
                  "certificate-authority-data": base64.b64encode(cluster.plane.ca_file.read_bytes()).decode()}}],
              "users": [{"name": HOME_ACCOUNT, "user": {"token": home_token(cluster)}}],
              "contexts": [{"name": remote, "context": {"cluster": remote, "user": HOME_ACCOUNT, "namespace": JOBS}}]}
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": kubeconfig_secret(remote), "namespace": SYSTEM},
            "stringData": {"kubeconfig": yaml.safe_dump(config)}}


@contextmanager
def three_clusters(folder: Path) -> Iterator[Clusters]:
    fast = {"status_interval": 1.0, "operator_kube": own_login}
    with ExitStack() as stack:
        bucket = stack.enter_context(s3_bucket(NAME))
        remotes = {name: stack.enter_context(real_cluster(
            folder / name, first_cpu=i + 1, **fast,
            chart_values={"multiCluster": {"remoteAccess": {"enabled": True, "namespaces": [JOBS]}}}))
            for i, name in enumerate(REMOTES)}
        home = stack.enter_context(real_cluster(
            folder / "home", peers=Peers(operator_namespace=SYSTEM), **fast,
            chart_values={"multiCluster": {"home": {"enabled": True,
                                                    "kubeconfigSecrets": [kubeconfig_secret(r) for r in REMOTES]}}}))
        standby = remotes[STANDBY]
        for i in range(SHARDS):  # both syncers' load balancers' addresses, as the other clusters' DNS would give them
            service = f"{n.exposed_syncer(NAME, i)}.{JOBS}.svc:{SYNCER_GRPC_PORT}"
            local, there = home.runtime.local(service), standby.runtime.local(service)
            # The shard's own Service reaches the same port (one pod behind both), however early a
            # learner there dials it.
            for c in (home, standby):
                c.runtime.ports[f"{n.syncer_shard(NAME, i)}.{JOBS}.svc:{SYNCER_GRPC_PORT}"] = c.runtime.ports[service]
            for r in (home, *remotes.values()):
                if r is not home:
                    r.runtime.hosts[exposed(i)] = local
                if r is not standby:
                    r.runtime.hosts[exposed(i, STANDBY_HOST)] = there
        for c in (home, *remotes.values()):
            c.operator.ctx.syncers = Dialled(c.runtime)  # before any job: no pass has dialled yet
        for name, r in remotes.items():
            home.admin.create(login_secret(name, r))
        tls = tls_for(f"*.{HOST}", f"*.{STANDBY_HOST}")  # every shard's names, at home and the standby's
        for c in (home, standby):  # what each syncer of a pair needs in its own cluster: its certificate, the store
            c.admin.create({"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                            "metadata": {"name": TLS_SECRET, "namespace": JOBS},
                            "data": {k: base64.b64encode(v).decode() for k, v in
                                     (("tls.crt", tls.cert), ("tls.key", tls.key), ("ca.crt", tls.ca))}})
            c.admin.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": STORE_SECRET, "namespace": JOBS},
                            "stringData": bucket.env})
        yield Clusters(home, remotes, tls, bucket)


def home_job(store: str) -> dict[str, Any]:
    """The one object applied: a learner in each cluster, a syncer of two shards exposed with TLS,
    checkpointing to `store`, each shard's standby in cluster west."""
    groups = [{"name": cluster, "region": region, "replicas": 1, **({"cluster": cluster} if cluster != "home" else {})}
              for cluster, region in REGIONS.items()]
    return {"apiVersion": "diloco.dev/v1alpha1", "kind": KIND, "metadata": {"name": NAME, "namespace": JOBS},
            "spec": {"clusters": [{"name": r, "kubeconfigSecret": kubeconfig_secret(r)} for r in REMOTES],
                     "learnerGroups": groups,
                     "syncer": {"fragments": 2, "shards": SHARDS, "checkpointIntervalSeconds": 2,
                                "expose": {"type": "LoadBalancer", "host": HOST, "tls": {"secretName": TLS_SECRET}},
                                "checkpoints": {"url": store, "secretName": STORE_SECRET},
                                "standby": {"cluster": STANDBY, "host": STANDBY_HOST, "leaseSeconds": LEASE_SECONDS}},
                     "model": dict(TINY_MODEL),
                     # A bound for the Progress column, far beyond what the module trains.
                     "training": {"batchSize": 8, "warmupSteps": 10, "decaySteps": 5000,
                                  "evalIntervalSteps": 100000, "tokenBudget": 100_000_000}}}


# -- reading -----------------------------------------------------------------------------------


def status(c: Cluster) -> dict[str, Any]:
    return c.job(NAME).get("status") or {}


def condition(c: Cluster, type_: str) -> dict[str, Any]:
    return next((x for x in status(c).get("conditions") or [] if x.get("type") == type_), {})


def events(c: Cluster, reason: str) -> list[dict[str, Any]]:
    return [e for e in c.events(JOBS, reason) if e["involvedObject"]["name"] == NAME]


def part(c: Cluster) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """A remote cluster's part: its job and Secret, as its admin reads them."""
    return c.admin.get(KIND, JOBS, NAME), c.admin.get("Secret", JOBS, n.syncer(NAME))


def job_token(c: Clusters) -> str:
    secret = c.home.admin.get("Secret", JOBS, n.token_secret(NAME)) or {}
    return base64.b64decode(secret["data"]["token"]).decode()


def shard_replies(c: Clusters, token: str) -> list[pb.StatusReply]:
    """Every shard's Status RPC, dialled as a learner of the third cluster dials it (shard-<i>.<HOST>,
    else its standby at shard-<i>.<STANDBY_HOST>, TLS): read from whichever syncer holds the shard's
    lease, with or without any API server."""
    hosts = c.remotes["east"].runtime.hosts
    replies = []
    for i in range(SHARDS):
        for k, address in enumerate((exposed(i), exposed(i, STANDBY_HOST))):
            try:
                with channel(hosts[address], c.tls.ca, address.rsplit(":", 1)[0]) as ch:
                    replies.append(rpc.SyncerStub(ch).Status(pb.StatusRequest(), metadata=auth_metadata(token),
                                                             timeout=5.0))
                break
            except grpc.RpcError:
                if k:
                    raise
    return replies


def progress(c: Clusters, token: str) -> dict[str, Any]:
    """The outer version (every shard's fragments) and each region's contributions on each shard."""
    try:
        replies = shard_replies(c, token)
    except grpc.RpcError:
        return {"version": -1, "regions": {}}
    return {"version": sum(sum(r.versions) for r in replies),
            "regions": {(x.region, r.shard): int(x.contributions) for r in replies for x in r.regions}}


def audit(c: Cluster, user: str) -> list[dict[str, Any]]:
    """The audit log's completed requests of `user` made by an operator (not the test's probes), so far."""
    entries = [json.loads(line) for line in Path(c.plane.audit_log).read_text().splitlines() if line.strip()]
    return [e for e in entries if e.get("user", {}).get("username") == user and e.get("stage") == "ResponseComplete"
            and e.get("userAgent") == n.MANAGER]


def refused(c: Cluster, user: str) -> list[tuple[str, str]]:
    return sorted({(e["verb"], e.get("requestURI", "")) for e in audit(c, user)
                   if e.get("responseStatus", {}).get("code") == 403})


def training(c: Clusters) -> dict[str, Any]:
    """The home job's status once it shows all three regions contributing, both remotes reachable
    with their groups (marked by cluster) running; {} before."""
    s = status(c.home)
    regions = {r["region"]: r for r in s.get("regions") or []}
    reached = {x["name"]: x for x in s.get("clusters") or []}
    groups = {g["name"]: g for g in s.get("learnerGroups") or []}
    ok = (set(regions) == set(REGIONS.values()) and all(r["contributions"] > 0 for r in regions.values())
          and all(reached.get(r, {}).get("reachable") and reached[r].get("learners") == "1/1" for r in REMOTES)
          and all(groups.get(r, {}).get("cluster") == r for r in REMOTES) and s.get("learners") == "1/1")
    return s if ok else {}


def trains(c: Clusters, timeout: float, what: str = "learners of all three clusters training") -> dict[str, Any]:
    """`training`, waited for; a timeout says what the home job's status showed."""
    try:
        return wait_for(lambda: training(c), timeout=timeout, period=1.0, what=what)
    except AssertionError as exc:
        s = status(c.home)
        shown = {k: s.get(k) for k in ("phase", "learners", "regions", "clusters", "learnerGroups", "conditions")}
        pods = {name: [(p["metadata"]["name"], [(x["type"], x["status"]) for x in p["status"].get("conditions") or []])
                       for p in cl.admin.list("Pod", JOBS)] for name, cl in c.all().items()}
        nodes = {name: [(x["metadata"]["name"], x["spec"].get("taints"),
                         [(y["type"], y["status"]) for y in x["status"].get("conditions") or []])
                        for x in cl.admin.request("GET", "api/v1/nodes")["items"]] for name, cl in c.all().items()}
        raise AssertionError(f"{exc}; the home job's status: {json.dumps(shown)[:4000]}; pods {pods}; "
                             f"nodes {nodes}") from None
