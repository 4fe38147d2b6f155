"""TLS between learners and the syncer, with certificates from a generated CA."""

from __future__ import annotations

import datetime
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from diloco.operator.syncer_client import SyncerClients, Target
from diloco.shards import server_names, syncer_addresses
from diloco.spec import Syncer as SyncerSpec
from diloco.syncer.servicer import SyncerServicer
from diloco.trainer.sync.client import SyncerClient
from diloco.trainer.sync.sharded_client import ShardedClient
from diloco.wire import add_syncer, server_options
from tests import syncer_harness as sh


def _cert(subject: str, issuer_key, issuer_name, key, ca: bool, san: list[str]) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in san]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_ca(tmp: Path, name: str) -> tuple[bytes, object, x509.Name]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = _cert(name, key, subject, key, True, [])
    return cert.public_bytes(serialization.Encoding.PEM), key, subject


def serve_tls(harness: sh.Harness, ca_key, ca_name: x509.Name, names: list[str]) -> tuple[grpc.Server, int]:
    """The harness's syncer on a TLS port of its own, with a certificate for `names`."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _cert("syncer", ca_key, ca_name, key, False, names)
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=server_options())
    add_syncer(SyncerServicer(harness.core, sh.TOKEN), server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key_pem, cert.public_bytes(serialization.Encoding.PEM))]))
    server.start()
    return server, port


@pytest.fixture
def tls_syncer(tmp_path: Path):
    ca_pem, ca_key, ca_name = make_ca(tmp_path, "diloco-test-ca")
    harness = sh.start()
    server, port = serve_tls(harness, ca_key, ca_name, ["syncer.diloco.svc", "localhost"])
    yield port, ca_pem
    server.stop(0)
    harness.close()


def test_join_over_tls_with_the_right_ca(tls_syncer) -> None:
    port, ca = tls_syncer
    client = SyncerClient(f"127.0.0.1:{port}", sh.TOKEN, "a-0", "r", tls_ca=ca, tls_server_name="syncer.diloco.svc")
    state = client.join(dict(sh.SHAPES))
    assert set(state.params) == set(sh.SHAPES)
    client.close()


def test_wrong_ca_or_plaintext_cannot_connect(tls_syncer, tmp_path: Path) -> None:
    port, _ = tls_syncer
    other_ca, _, _ = make_ca(tmp_path, "someone-else")
    for client in (
        SyncerClient(f"127.0.0.1:{port}", sh.TOKEN, "a-0", "r", tls_ca=other_ca, tls_server_name="syncer.diloco.svc"),
        SyncerClient(f"127.0.0.1:{port}", sh.TOKEN, "a-0", "r"),  # plaintext to a TLS port
    ):
        with pytest.raises(grpc.RpcError) as info:
            client.join(dict(sh.SHAPES), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        client.close()


def test_a_sharded_syncer_is_checked_shard_by_shard_for_each_shards_own_name(tmp_path: Path) -> None:
    """A sharded syncer exposed as shard-<i>.<host>: the home cluster's learners and the operator
    dial the shards by other names (their pods'), and check shard i for shard-<i>.<host>. Here
    each shard's certificate carries its own name only, so a name checked against the wrong
    shard fails."""
    ca, ca_key, ca_name = make_ca(tmp_path, "diloco-test-ca")
    spec = SyncerSpec(fragments=2, shards=2)
    harnesses = [sh.start(spec, shard=i) for i in range(2)]
    served = [serve_tls(h, ca_key, ca_name, [f"shard-{i}.syncer.test"]) for i, h in enumerate(harnesses)]
    addresses = ",".join(f"127.0.0.1:{port}" for _, port in served)
    per_shard = "shard-0.syncer.test,shard-1.syncer.test"
    clients = SyncerClients()
    try:
        # The learner: --tls-server-name one per --syncer address, as bringup.connect passes them.
        names = dict(zip(syncer_addresses(addresses), server_names(per_shard, syncer_addresses(addresses)),
                         strict=True))
        learner = ShardedClient(syncer_addresses(addresses),
                                lambda a: SyncerClient(a, sh.TOKEN, "a-0", "r", tls_ca=ca, tls_server_name=names[a]))
        try:
            assert learner.join_with_retry(dict(sh.SHAPES)).owned == [0, 1, 2, 3]
        finally:
            learner.close()
        # The operator's Status RPC, every shard checked for its own name.
        view, error = clients.status("ns", "job", Target(addresses, sh.TOKEN, ca, per_shard))
        assert error == "" and view is not None
        # One name for both: shard 1's certificate does not carry it.
        view, error = clients.status("ns", "other", Target(addresses, sh.TOKEN, ca, "shard-0.syncer.test"))
        assert view is None and error == "UNAVAILABLE"
    finally:
        clients.close()
        for (server, _), h in zip(served, harnesses, strict=True):
            server.stop(0)
            h.close()
