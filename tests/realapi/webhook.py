"""The chart's admission webhook reached in the real-control-plane lane, where the operator runs
in the test's process and no pod network exists.

What the chart installs stays as installed: its ValidatingWebhookConfiguration (no caBundle
until the operator writes one), its Service, and the operator's settings from its Deployment's
environment. What the test plays is the pod network alone: the chart's Deployment runs no pod
here, so the Service's selector would give it no endpoints; the test drops the selector and
writes the Endpoints a Ready operator pod would get, at this host's non-loopback address (an
Endpoints address may not be a loopback one) and the port the in-process operator serves on.
The API server (--enable-aggregator-routing) dials that endpoint, as it dials a pod's IP,
with the Service's DNS name for TLS.
"""

from __future__ import annotations

import socket
from dataclasses import replace

from diloco.operator.admission.certificates import WebhookOptions
from diloco.operator.kube import ApiError, Kube
from tests.helpers import wait_for


def host_address() -> str:
    """This host's address on its default route: not loopback, so an Endpoints may hold it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the route's source
        except OSError as exc:
            raise RuntimeError("the webhook test needs a non-loopback IPv4 address with a route (the API server "
                               "may not dial a loopback Endpoints address)") from exc
        address = str(s.getsockname()[0])
    if address.startswith("127."):
        raise RuntimeError(f"the default route's source address is loopback ({address})")
    return address


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def chart_options(admin: Kube, namespace: str, deployment: str) -> WebhookOptions:
    """The operator's webhook settings as the chart's Deployment gives them to its container."""
    found = admin.get("Deployment", namespace, deployment)
    assert found is not None, f"the chart installed no Deployment {namespace}/{deployment}"
    (container,) = found["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container.get("env") or [] if "value" in e}
    options = WebhookOptions.from_env(env)
    assert options is not None, "the chart's operator serves no webhook (DILOCO_WEBHOOK_PORT unset)"
    return options


def route(admin: Kube, options: WebhookOptions, cert_dir: str) -> WebhookOptions:
    """Point the chart's webhook Service at this process (the pod network's part, see above);
    the settings the in-process operator serves with: the chart's, on this host's address."""
    address = host_address()
    port = free_port(address)
    admin.patch("Service", options.namespace, options.service, {"spec": {"selector": None}})
    endpoints = {"apiVersion": "v1", "kind": "Endpoints",
                 "metadata": {"name": options.service, "namespace": options.namespace},
                 "subsets": [{"addresses": [{"ip": address}], "ports": [{"name": "webhook", "port": port}]}]}
    collection = f"api/v1/namespaces/{options.namespace}/endpoints"
    try:  # the endpoints controller made it (empty) while the Service had its selector, or not yet
        current = admin.request("GET", f"{collection}/{options.service}")
    except ApiError as exc:
        if exc.status != 404:
            raise
        admin.request("POST", collection, endpoints)
    else:
        admin.request("PUT", f"{collection}/{options.service}",
                      {**endpoints, "metadata": {**endpoints["metadata"],
                                                 "resourceVersion": current["metadata"]["resourceVersion"]}})
    return replace(options, addr=address, port=port, cert_dir=cert_dir)


def wait_served(options: WebhookOptions, timeout: float = 30.0) -> None:
    """kopf starts its webhook server once it has discovered the API's resources."""
    def listening() -> bool:
        try:
            with socket.create_connection((options.addr, options.port), timeout=1):
                return True
        except OSError:
            return False

    wait_for(listening, timeout=timeout, what=f"the operator's webhook on {options.addr}:{options.port}")
