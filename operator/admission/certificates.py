"""The admission webhook's serving certificate: where it comes from, and the CA the API server trusts.

Two ways, chosen by the chart (values `webhook.certManager.enabled`):

- cert-manager issues it into a Secret mounted at `cert_dir`, and its CA injector writes the CA into
  the ValidatingWebhookConfiguration; the operator only serves the files (kopf re-reads them when
  cert-manager renews them).
- Otherwise the operator makes it: a CA and a serving certificate for the webhook Service's DNS
  names, kept in one Secret (`secret`) so that every replica, the standby too, serves the same
  certificate; the first replica creates it, the others read it (a create that loses the race
  reads the winner's). Each replica writes it to `cert_dir` and puts the CA into the chart's
  ValidatingWebhookConfiguration (`configuration`) where it differs. A Secret that no longer fits
  (another Service name, or less than RENEW_BEFORE left) stops the operator with the fix: delete
  the Secret and restart the operator's pods.
"""

from __future__ import annotations

import base64
import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco.operator.kube import ApiError, Kube
from diloco.operator.render import naming as n

VALIDITY = datetime.timedelta(days=3650)
RENEW_BEFORE = datetime.timedelta(days=30)
WEBHOOK_CONFIGURATIONS = "apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"
STRATEGIC_MERGE = "application/strategic-merge-patch+json"  # the webhooks list merges by name


@dataclass(frozen=True)
class WebhookOptions:
    """Where the operator serves its validating webhook and how it gets its certificate (the
    chart sets each from its values; DILOCO_WEBHOOK_PORT unset: no webhook)."""

    port: int = 9443
    addr: str = ""  # "": every interface (a pod's IPv4 and IPv6 addresses)
    cert_dir: str = "/tmp/diloco-webhook"  # tls.crt and tls.key: written here, or mounted by cert-manager
    namespace: str = ""  # the operator's: its Service and Secret live there
    service: str = ""  # the webhook's Service: the certificate's DNS names
    secret: str = ""  # the Secret the operator keeps its certificate in; "" when cert-manager's is mounted
    configuration: str = ""  # the ValidatingWebhookConfiguration whose caBundle the operator writes; "": not

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WebhookOptions | None:
        """From the process's environment, or `env` (a container's, as the chart renders it)."""
        env = os.environ if env is None else env
        port = env.get("DILOCO_WEBHOOK_PORT")
        if not port:
            return None
        options = cls(port=int(port), addr=env.get("DILOCO_WEBHOOK_ADDR") or cls.addr,
                      cert_dir=env.get("DILOCO_WEBHOOK_CERT_DIR") or cls.cert_dir,
                      namespace=env.get("DILOCO_OPERATOR_NAMESPACE", ""), service=env.get("DILOCO_WEBHOOK_SERVICE", ""),
                      secret=env.get("DILOCO_WEBHOOK_SECRET", ""),
                      configuration=env.get("DILOCO_WEBHOOK_CONFIGURATION", ""))
        if options.secret and not (options.namespace and options.service):
            raise ValueError("$DILOCO_WEBHOOK_SECRET: the operator makes the webhook's certificate for its Service, "
                             "so $DILOCO_OPERATOR_NAMESPACE and $DILOCO_WEBHOOK_SERVICE must be set too")
        return options

    @property
    def certfile(self) -> Path:
        return Path(self.cert_dir) / n.TLS_CERT_KEY

    @property
    def keyfile(self) -> Path:
        return Path(self.cert_dir) / n.TLS_KEY_KEY


def dns_names(service: str, namespace: str) -> list[str]:
    """The names the API server may dial the Service by; it checks `<service>.<namespace>.svc`."""
    return [f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local", f"{service}.{namespace}",
            service]


def make(names: list[str], now: datetime.datetime) -> dict[str, bytes]:
    """A new CA and a serving certificate it signs for `names`: a kubernetes.io/tls Secret's
    keys (tls.crt, tls.key) and cert-manager's ca.crt, PEM."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{names[0]} webhook CA")])
    start, end = now - datetime.timedelta(minutes=5), now + VALIDITY
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name) for name in names]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return {n.TLS_CERT_KEY: cert.public_bytes(pem), n.CA_KEY: ca.public_bytes(pem),
            n.TLS_KEY_KEY: key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())}


def unfit(files: dict[str, bytes], names: list[str], now: datetime.datetime) -> str | None:
    """Why a stored certificate cannot serve `names` until RENEW_BEFORE from `now`, or None."""
    from cryptography import x509

    missing = [key for key in (n.TLS_CERT_KEY, n.TLS_KEY_KEY, n.CA_KEY) if not files.get(key)]
    if missing:
        return f"it lacks {', '.join(missing)}"
    try:
        cert = x509.load_pem_x509_certificate(files[n.TLS_CERT_KEY])
    except ValueError as exc:
        return f"its {n.TLS_CERT_KEY} is not a PEM certificate ({exc})"
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return "its certificate names no DNS names"
    if names[0] not in sans.get_values_for_type(x509.DNSName):
        return f"its certificate is not for {names[0]} (it names {', '.join(sans.get_values_for_type(x509.DNSName))})"
    if cert.not_valid_after_utc - now < RENEW_BEFORE:
        return f"its certificate expires at {cert.not_valid_after_utc.isoformat()}"
    return None


def _decoded(secret: dict[str, Any]) -> dict[str, bytes]:
    return {key: base64.b64decode(value) for key, value in (secret.get("data") or {}).items()}


def stored(kube: Kube, options: WebhookOptions, now: datetime.datetime) -> dict[str, bytes]:
    """The certificate every replica serves: the Secret's, made and stored first if it is missing."""
    names = dns_names(options.service, options.namespace)
    secret = kube.get("Secret", options.namespace, options.secret)
    if secret is None:
        made = make(names, now)
        try:
            secret = kube.create({
                "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                "metadata": {"name": options.secret, "namespace": options.namespace,
                             "labels": {"app.kubernetes.io/managed-by": n.MANAGER}},
                "data": {key: base64.b64encode(value).decode() for key, value in made.items()}})
        except ApiError as exc:
            if exc.status != 409:
                raise
            secret = kube.get("Secret", options.namespace, options.secret)  # another replica made it first
            if secret is None:
                raise RuntimeError(f"Secret {options.namespace}/{options.secret} was created and is gone") from exc
    files = _decoded(secret)
    why = unfit(files, names, now)
    if why is not None:
        raise RuntimeError(f"Secret {options.namespace}/{options.secret} cannot serve the admission webhook: {why}; "
                           f"delete it (kubectl -n {options.namespace} delete secret {options.secret}) and restart "
                           "the operator's pods: the first to start makes a new one")
    return files


def ca_patch(configuration: dict[str, Any], ca: bytes) -> dict[str, Any] | None:
    """The strategic merge patch that gives every webhook of `configuration` the CA `ca`, or None
    when each has it already (a restart writes nothing)."""
    bundle = base64.b64encode(ca).decode()
    stale = [w["name"] for w in configuration.get("webhooks") or []
             if (w.get("clientConfig") or {}).get("caBundle") != bundle]
    return {"webhooks": [{"name": name, "clientConfig": {"caBundle": bundle}} for name in stale]} if stale else None


def prepare(kube: Kube, options: WebhookOptions, now: datetime.datetime) -> None:
    """Make `options.certfile` and `keyfile` ready to serve: from the shared Secret (and the CA
    put into the webhook configuration), or, with cert-manager, check that they are mounted."""
    if not options.secret:
        if not (options.certfile.is_file() and options.keyfile.is_file()):
            raise RuntimeError(f"the admission webhook's certificate is not at {options.certfile} and "
                               f"{options.keyfile}: mount cert-manager's Secret there (the chart's "
                               "webhook.certManager.enabled), or let the operator make one ($DILOCO_WEBHOOK_SECRET)")
        return
    files = stored(kube, options, now)
    folder = Path(options.cert_dir)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    for key in (n.TLS_CERT_KEY, n.TLS_KEY_KEY, n.CA_KEY):
        path = folder / key
        path.touch(mode=0o600)
        path.write_bytes(files[key])
    if options.configuration:
        url = f"{WEBHOOK_CONFIGURATIONS}/{options.configuration}"
        try:
            configuration = kube.request("GET", url)
        except ApiError as exc:
            raise RuntimeError(f"ValidatingWebhookConfiguration {options.configuration}: {exc.detail} (the chart "
                               "installs it with the operator; $DILOCO_WEBHOOK_CONFIGURATION names it)") from exc
        patch = ca_patch(configuration, files[n.CA_KEY])
        if patch is not None:
            kube.request("PATCH", url, patch, content_type=STRATEGIC_MERGE)
