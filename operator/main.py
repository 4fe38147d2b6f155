"""`diloco operator`: run the kopf operator with its liveness endpoint and Prometheus metrics.

The chart runs two replicas, one active: kopf's peering (operator/peering.py) pauses every
replica but the oldest, and a standby takes over within the peering lifetime (10 s) of the
active one's last keep-alive when its node dies, so jobs are not left unattended until a
replacement pod is scheduled. The peering object is mandatory: the operator refuses to start
without it rather than run unpeered beside another replica. `--standalone` skips peering, for
exactly one replica (a developer's run, a cluster without kopf's peering CRDs): two standalone
replicas would both reconcile every job.
Ports come from the environment so the chart sets them next to the probes that use them.
`--namespace`, repeated, limits it to those namespaces (the chart's watchNamespaces, with a
Role in each): kopf's namespace scanning is off (handlers.configure), so they are exact names,
each watched on its own, and the operator needs nothing cluster-wide.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

import kopf
from prometheus_client import start_http_server

from diloco.contract import Exit
from diloco.operator.context import Config, Context
from diloco.operator.handlers import build_memo, build_registry, configure
from diloco.operator.peering import Peering, require

NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # an RFC 1123 label


def namespaces(given: list[str] | None) -> list[str]:
    """The namespaces to watch, in order, without repeats; [] watches the whole cluster. A
    pattern would need kopf's namespace scanning, which the chart's RBAC does not grant."""
    out: list[str] = []
    for name in given or []:
        if not NAMESPACE.match(name):
            raise ValueError(f"--namespace {name!r} is not a namespace name (lowercase letters, digits and '-', at "
                             "most 63); name each namespace exactly, no patterns")
        if name not in out:
            out.append(name)
    return out


def main(args: argparse.Namespace) -> int:
    try:
        watched = namespaces(getattr(args, "namespace", None))
        peers = None if getattr(args, "standalone", False) else Peering.from_env()
    except ValueError as exc:
        print(f"diloco operator: {exc}", file=sys.stderr)
        return int(Exit.CONFIG)
    logging.basicConfig(level=os.environ.get("DILOCO_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = Config.from_env()
    ctx = Context(config)
    metrics_port = int(os.environ.get("DILOCO_OPERATOR_METRICS_PORT", "9090"))
    health_port = int(os.environ.get("DILOCO_OPERATOR_HEALTH_PORT", "8080"))
    start_http_server(metrics_port, registry=ctx.metrics.registry)
    settings = kopf.OperatorSettings()
    configure(settings)
    if peers is not None:
        try:
            require(ctx.connect(), peers, watched)
        except ValueError as exc:
            print(f"diloco operator: {exc}", file=sys.stderr)
            return int(Exit.CONFIG)
        peers.apply(settings)
    kopf.run(
        registry=build_registry(config),
        settings=settings,
        memo=build_memo(ctx),
        **(peers.run_kwargs() if peers is not None else {"standalone": True}),
        clusterwide=not watched,
        namespaces=watched,
        liveness_endpoint=f"http://0.0.0.0:{health_port}/healthz",
    )
    return 0
