"""Two clusters on one machine: an emulated API server, controllers and an operator for each.

kopf keeps no process-wide state that stops two operators from running side by side: each
`kopf.run` gets its own registry, settings, memo and event loop (its own thread here), and
kopf's Events go through context variables of that operator's own tasks. The one thing that
was global is where to log in, $KUBECONFIG: our login handler takes the credentials of the
operator's own API client instead, so each operator is handed a client for its own cluster.
Also here: TLS material from a throwaway CA, and an in-process syncer for the fast tests.
"""

from __future__ import annotations

import base64
import datetime as dt
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from diloco.operator.context import Config
from diloco.operator.kube import Kube
from diloco.spec import Syncer as SyncerSpec
from diloco.syncer.core import SyncerCore
from diloco.syncer.global_model import GlobalModel
from diloco.syncer.metrics import SyncerMetrics
from diloco.syncer.servicer import SyncerServicer
from diloco.wire import add_syncer, server_options
from tests import syncer_harness as sh
from tests.kube import NAMESPACE
from tests.kube.controllers import Controllers, Runtime
from tests.kube.emulator import ClusterThread
from tests.kube.running import OperatorThread


@dataclass
class Site:
    """One cluster as the tests see it: `api` acts like kubectl, `operator` is that cluster's."""

    cluster: ClusterThread
    api: Kube
    controllers: Controllers
    operator: OperatorThread


@contextmanager
def site(config: Config, runtime: Callable[[Kube], Runtime] | None = None, period: float = 0.1) -> Iterator[Site]:
    """A cluster with its controllers (and kubelet `runtime`) and its own operator, torn down in order."""
    with ClusterThread() as cluster:
        api = Kube(cluster.url, user_agent="diloco-tests")
        with Controllers(api, NAMESPACE, runtime(api) if runtime else None, period=period) as controllers, \
                OperatorThread(config, kube=Kube(cluster.url, token="test-token")) as operator:
            yield Site(cluster, api, controllers, operator)


def secret(name: str, data: dict[str, bytes], type_: str = "Opaque") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": NAMESPACE},
            "type": type_, "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}


@dataclass(frozen=True)
class Tls:
    """PEM material: a CA, and a certificate it signed for `host` (what cert-manager would issue)."""

    ca: bytes
    cert: bytes
    key: bytes

    def secret(self, name: str) -> dict[str, Any]:
        """A kubernetes.io/tls Secret with ca.crt, as the home cluster's expose.tls.secretName."""
        return secret(name, {"tls.crt": self.cert, "tls.key": self.key, "ca.crt": self.ca}, "kubernetes.io/tls")


def tls_for(host: str, *also: str) -> Tls:
    now = dt.datetime.now(dt.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "diloco-test-ca")])

    def sign(subject: x509.Name, public: Any, ca: bool) -> x509.Certificate:
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name).public_key(public)
                   .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=1))
                   .not_valid_after(now + dt.timedelta(hours=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(h) for h in (host, *also)]),
                                            critical=False)
        return builder.sign(ca_key, hashes.SHA256())

    pem = serialization.Encoding.PEM
    leaf = sign(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]), key.public_key(), False)
    return Tls(ca=sign(ca_name, ca_key.public_key(), True).public_bytes(pem), cert=leaf.public_bytes(pem),
               key=key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


@contextmanager
def local_syncer(token: str, regions: set[str]) -> Iterator[str]:
    """A syncer (small numpy model) in this process on 127.0.0.1; yields its address. Enough for
    the operators' Status RPCs and for fake learners joining with `SyncerClient.join(sh.SHAPES)`."""
    spec = SyncerSpec(fragments=2)
    core = SyncerCore(spec=spec, model=GlobalModel.fresh(spec, sh.params()), store=None, metrics=SyncerMetrics(),
                      regions=frozenset(regions), tokens_per_step=sh.TOKENS_PER_STEP)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=server_options())
    add_syncer(SyncerServicer(core, token), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)
