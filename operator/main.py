"""`diloco operator`: run the kopf operator with its liveness endpoint and Prometheus metrics.

One replica (the chart's Deployment uses the Recreate strategy), so `--standalone` skips
kopf's peering objects; without it kopf uses peering when the cluster has its CRDs.
Ports come from the environment so the chart sets them next to the probes that use them.
"""

from __future__ import annotations

import argparse
import logging
import os

import kopf
from prometheus_client import start_http_server

from diloco.operator.context import Config, Context
from diloco.operator.handlers import build_memo, build_registry, configure


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=os.environ.get("DILOCO_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = Config.from_env()
    ctx = Context(config)
    metrics_port = int(os.environ.get("DILOCO_OPERATOR_METRICS_PORT", "9090"))
    health_port = int(os.environ.get("DILOCO_OPERATOR_HEALTH_PORT", "8080"))
    start_http_server(metrics_port, registry=ctx.metrics.registry)
    settings = kopf.OperatorSettings()
    configure(settings)
    namespace = getattr(args, "namespace", None)
    kopf.run(
        registry=build_registry(config),
        settings=settings,
        memo=build_memo(ctx),
        standalone=bool(getattr(args, "standalone", False)),
        clusterwide=namespace is None,
        namespaces=[namespace] if namespace else (),
        liveness_endpoint=f"http://0.0.0.0:{health_port}/healthz",
    )
    return 0
