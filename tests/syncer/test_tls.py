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

from diloco.syncer.servicer import SyncerServicer
from diloco.trainer.sync.client import SyncerClient
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


@pytest.fixture
def tls_syncer(tmp_path: Path):
    ca_pem, ca_key, ca_name = make_ca(tmp_path, "diloco-test-ca")
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _cert("syncer", ca_key, ca_name, key, False, ["syncer.diloco.svc", "localhost"])
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    harness = sh.start()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=server_options())
    add_syncer(SyncerServicer(harness.core, sh.TOKEN), server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key_pem, cert.public_bytes(serialization.Encoding.PEM))]))
    server.start()
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
