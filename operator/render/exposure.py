"""An in-cluster syncer made reachable from other clusters: a LoadBalancer Service or a GRPCRoute.

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
from diloco.spec import DecoupledDiLoCoJob


def exposed(job: DecoupledDiLoCoJob, namespace: str, owner_uid: str,
            defaults: Mapping[str, str]) -> dict[str, Any]:
    """The exposing object; `defaults` are the chart's annotations, which the job's override."""
    expose = job.spec.syncer.expose
    assert expose is not None, "only called for exposed syncers"
    job_name = job.metadata.name
    meta = {"name": n.exposed_syncer(job_name), "namespace": namespace,
            "labels": n.labels(job_name, n.SYNCER), "ownerReferences": [n.owner_reference(job_name, owner_uid)]}
    annotations = {**defaults, **expose.annotations}
    if annotations:
        meta["annotations"] = annotations
    if expose.type == "LoadBalancer":
        spec: dict[str, Any] = {
            "type": "LoadBalancer", "selector": n.selector(job_name, n.SYNCER),
            "ports": [{"name": "grpc", "port": SYNCER_GRPC_PORT, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"}]}
        if expose.load_balancer_source_ranges:
            spec["loadBalancerSourceRanges"] = list(expose.load_balancer_source_ranges)
        return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": spec}
    gateway = expose.gateway
    assert gateway is not None, "spec validation requires a gateway for GRPCRoute"
    parent: dict[str, Any] = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gateway.name}
    if gateway.namespace:
        parent["namespace"] = gateway.namespace
    if gateway.section_name:
        parent["sectionName"] = gateway.section_name
    route: dict[str, Any] = {"parentRefs": [parent],
                             "rules": [{"backendRefs": [{"name": n.syncer(job_name), "port": SYNCER_GRPC_PORT}]}]}
    if expose.host:
        route["hostnames"] = [expose.host]
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GRPCRoute", "metadata": meta, "spec": route}


def problems(job: DecoupledDiLoCoJob, gateway_api: bool) -> list[str]:
    """What this operator's installation cannot do for the job (reported like spec problems)."""
    expose = job.spec.syncer.expose
    if expose is not None and expose.type == "GRPCRoute" and not gateway_api:
        return ["spec.syncer.expose.type: GRPCRoute needs the Gateway API, which this operator was installed "
                "without; install the chart with syncerExposure.gatewayAPI=true, or use type LoadBalancer"]
    return []


def address(job: DecoupledDiLoCoJob, service: dict[str, Any] | None) -> str:
    """Where other clusters dial the syncer: `expose.host`, else the load balancer's address once
    the cloud has assigned one; "" while unknown. A GRPCRoute's port is its Gateway listener's."""
    expose = job.spec.syncer.expose
    if expose is None:
        return ""
    if expose.type == "GRPCRoute":
        return expose.host or ""
    ingress = (((service or {}).get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
    host = expose.host or next((i.get("hostname") or i.get("ip") for i in ingress if i.get("hostname") or i.get("ip")),
                               None)
    if not host:
        return ""
    return f"[{host}]:{SYNCER_GRPC_PORT}" if ":" in host else f"{host}:{SYNCER_GRPC_PORT}"
