"""An in-cluster syncer made reachable from other clusters: a LoadBalancer Service or a GRPCRoute,
or for a sharded syncer one of either per shard (`J-syncer-exposed-<i>`, dialled as
`shard-<i>.<host>`; a shard's GRPCRoute sends to a ClusterIP Service of the same name that
selects that shard's pods).

A separate object from the job's ClusterIP Service `J-syncer`, so that only the gRPC port
leaves the cluster (metrics stay inside) and removing `spec.syncer.expose` removes exactly
this. TLS is the syncer's own (render mounts the certificate), so a LoadBalancer passes
bytes through; a GRPCRoute's Gateway terminates the client's TLS and, with the syncer's TLS
on, needs a BackendTLSPolicy to re-encrypt (docs/MULTI_CLUSTER.md). Pure, like render.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diloco.contract import SYNCER_GRPC_PORT
from diloco.operator.render import naming as n
from diloco.spec import DecoupledDiLoCoJob, shard_hosts

GRPC_PORT = {"name": "grpc", "port": SYNCER_GRPC_PORT, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"}


def exposed(job: DecoupledDiLoCoJob, namespace: str, owner_uid: str,
            defaults: Mapping[str, str]) -> list[dict[str, Any]]:
    """The exposing objects; `defaults` are the chart's annotations, which the job's override.
    One, or for a sharded syncer one LoadBalancer Service per shard (`J-syncer-exposed-<i>`),
    each selecting only its shard's pod (with a standby, its shard's two: `shard_selector`): a
    learner in another cluster dials every shard by name (`shard-<i>.<host>`), and one Service
    over all of them would send a shard's pushes to whichever pod the load balancer picked."""
    expose = job.spec.syncer.expose
    assert expose is not None, "only called for exposed syncers"
    job_name, shards = job.metadata.name, job.spec.syncer.shards
    annotations = {**defaults, **expose.annotations}

    def meta(name: str) -> dict[str, Any]:
        out = {"name": name, "namespace": namespace, "labels": n.labels(job_name, n.SYNCER),
               "ownerReferences": [n.owner_reference(job_name, owner_uid)]}
        if annotations:
            out["annotations"] = dict(annotations)
        return out

    if expose.type == "LoadBalancer":
        selector = n.selector(job_name, n.SYNCER)
        if shards == 1:
            return [_load_balancer(meta(n.exposed_syncer(job_name)), selector, expose.load_balancer_source_ranges)]
        return [_load_balancer(meta(n.exposed_syncer(job_name, i)), shard_selector(job, i),
                               expose.load_balancer_source_ranges)
                for i in range(shards)]
    gateway = expose.gateway
    assert gateway is not None, "spec validation requires a gateway for GRPCRoute"
    parent: dict[str, Any] = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gateway.name}
    if gateway.namespace:
        parent["namespace"] = gateway.namespace
    if gateway.section_name:
        parent["sectionName"] = gateway.section_name
    if shards == 1:
        return [_route(meta(n.exposed_syncer(job_name)), parent, n.syncer(job_name), expose.host)]
    assert expose.host is not None, "spec validation requires a host for a sharded syncer's exposure"
    out = []
    for i, host in enumerate(shard_hosts(expose.host, shards)):
        name = n.exposed_syncer(job_name, i)
        # The shard's own backend: a route to the headless J-syncer would spread a shard's pushes over all shards.
        out += [_backend(meta(name), shard_selector(job, i)), _route(meta(name), parent, name, host)]
    return out


def _route(meta: dict[str, Any], parent: dict[str, Any], backend: str, host: str | None) -> dict[str, Any]:
    """A GRPCRoute from the Gateway's listener `parent` to Service `backend`'s gRPC port."""
    route: dict[str, Any] = {"parentRefs": [parent],
                             "rules": [{"backendRefs": [{"name": backend, "port": SYNCER_GRPC_PORT}]}]}
    if host:
        route["hostnames"] = [host]
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GRPCRoute", "metadata": meta, "spec": route}


def _backend(meta: dict[str, Any], selector: dict[str, str]) -> dict[str, Any]:
    """A ClusterIP Service of one shard's gRPC port, which its GRPCRoute sends to."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta,
            "spec": {"selector": selector, "ports": [GRPC_PORT]}}


def shard_selector(job: DecoupledDiLoCoJob, shard: int) -> dict[str, str]:
    """The pods of shard `shard`: the StatefulSet's pod of that ordinal, or with a standby
    (spec.syncer.standby) the shard's two pods, of which only the lease holder is ready."""
    name = job.metadata.name
    if job.spec.syncer.standby is not None:
        return n.shard_selector(name, shard)
    return {**n.selector(name, n.SYNCER), n.POD_NAME: n.syncer_shard_pod(name, shard)}


def _load_balancer(meta: dict[str, Any], selector: dict[str, str], source_ranges: list[str]) -> dict[str, Any]:
    """A LoadBalancer Service of the gRPC port only (metrics stay inside the cluster)."""
    spec: dict[str, Any] = {"type": "LoadBalancer", "selector": selector, "ports": [GRPC_PORT]}
    if source_ranges:
        spec["loadBalancerSourceRanges"] = list(source_ranges)
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": spec}


def name_problems(job: DecoupledDiLoCoJob) -> list[str]:
    """An exposing object's name Kubernetes would refuse: the job's name plus `-syncer-exposed`
    (and `-<shard>`) must stay a DNS label."""
    if job.spec.syncer.expose is None:
        return []
    shards = job.spec.syncer.shards
    return n.service_name_problems(job.metadata.name, n.exposed_syncers(job.metadata.name, shards)[-1],
                                   "the exposed syncer's Service", f"spec.syncer.expose and {shards} shard(s)")


def problems(job: DecoupledDiLoCoJob, gateway_api: bool) -> list[str]:
    """What this operator's installation cannot do for the job (reported like spec problems)."""
    expose = job.spec.syncer.expose
    if expose is not None and expose.type == "GRPCRoute" and not gateway_api:
        return ["spec.syncer.expose.type: GRPCRoute needs the Gateway API, which this operator was installed "
                "without; install the chart with syncerExposure.gatewayAPI=true, or use type LoadBalancer"]
    return []


def addresses(job: DecoupledDiLoCoJob, live: Mapping[tuple[str, str], Any]) -> list[str]:
    """Where other clusters dial the syncer, one host:port per shard in shard order (what a
    learner there passes as --syncer, comma-joined): `expose.host`, or `shard-<i>.<host>` for a
    sharded syncer; else the load balancer's address once the cloud has assigned one (read from
    `live`, the job's children by (kind, name)); [] while unknown. A GRPCRoute's port is its
    Gateway listener's (`expose.gateway.port`)."""
    expose = job.spec.syncer.expose
    if expose is None:
        return []
    if expose.host:
        return [_host_port(h, expose.port) for h in shard_hosts(expose.host, job.spec.syncer.shards)]
    if expose.type == "GRPCRoute":
        return []
    service = live.get(("Service", n.exposed_syncer(job.metadata.name)))  # unsharded: spec validation needs a host
    ingress = (((service or {}).get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
    host = next((i.get("hostname") or i.get("ip") for i in ingress if i.get("hostname") or i.get("ip")), None)
    return [_host_port(host)] if host else []


def _host_port(host: str, port: int = SYNCER_GRPC_PORT) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
