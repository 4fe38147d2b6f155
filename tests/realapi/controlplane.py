"""A real Kubernetes 1.20 control plane on 127.0.0.1: etcd, kube-apiserver, kube-controller-manager
and kube-scheduler, built from Debian's sources by scripts/control-plane.sh.

What a managed cluster would enforce is on: TLS, token authentication, RBAC, owner-reference
permission enforcement, and an audit log of every request (the RBAC test reads it to show each
verb the chart grants is used). What is off, and why: the ServiceAccount admission plugin (pods
need no token volume; the tests' kubelet runs containers as local processes) and the CSR/node-IPAM
controllers (no real nodes). Users: `admin` (system:masters, the test itself, helm and kubectl),
the controller-manager and scheduler (system:masters: they only stand in for the real ones), and
each ServiceAccount through its token Secret, which the controller-manager's token controller
creates as in every 1.20 cluster.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
# Every stage: a watch's RequestReceived is written at once, its ResponseComplete only when it ends.
AUDIT_POLICY = {"apiVersion": "audit.k8s.io/v1", "kind": "Policy", "rules": [{"level": "Metadata"}]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def binaries() -> Path:
    """The control plane's bin folder, building it on first use (about 10 minutes, once per machine)."""
    done = subprocess.run(["bash", str(ROOT / "scripts" / "control-plane.sh"), "path"], capture_output=True,
                          text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"scripts/control-plane.sh failed:\n{done.stderr[-4000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def _certificates(folder: Path) -> None:
    """A throwaway CA, the API server's serving certificate (127.0.0.1) and the service-account key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    def key() -> rsa.RSAPrivateKey:
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)

    def pem(k: rsa.RSAPrivateKey) -> bytes:
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                               serialization.NoEncryption())

    now = datetime.datetime.now(datetime.UTC)
    ca_key, server_key, sa_key = key(), key(), key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "diloco-test-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    names = [x509.DNSName("localhost"), x509.DNSName("kubernetes.default.svc"),
             x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server = (x509.CertificateBuilder()
              .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
              .issuer_name(ca_name).public_key(server_key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))
              .add_extension(x509.SubjectAlternativeName(names), critical=False)
              .sign(ca_key, hashes.SHA256()))
    (folder / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (folder / "server.crt").write_bytes(server.public_bytes(serialization.Encoding.PEM))
    (folder / "server.key").write_bytes(pem(server_key))
    (folder / "sa.key").write_bytes(pem(sa_key))
    (folder / "sa.pub").write_bytes(sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))


@dataclass
class ControlPlane:
    """`with ControlPlane(folder) as cp:` runs the four processes until the block ends."""

    folder: Path
    url: str = ""
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16))
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def ca_file(self) -> Path:
        return self.folder / "ca.crt"

    @property
    def audit_log(self) -> Path:
        return self.folder / "audit.log"

    def kubeconfig(self, path: Path, token: str, user: str = "admin", namespace: str = "default") -> Path:
        """A kubeconfig for `token`, as helm, kubectl, kopf and our client read it."""
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "real",
            "clusters": [{"name": "real", "cluster": {"server": self.url,
                                                       "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "real", "context": {"cluster": "real", "user": user, "namespace": namespace}}],
        }))
        return path

    def __enter__(self) -> ControlPlane:
        bin_dir = binaries()
        self.folder.mkdir(parents=True, exist_ok=True)
        _certificates(self.folder)
        etcd_port, etcd_peer, api_port = free_port(), free_port(), free_port()
        self.url = f"https://127.0.0.1:{api_port}"
        components = secrets.token_hex(16)
        (self.folder / "tokens.csv").write_text(
            f'{self.admin_token},admin,admin,"system:masters"\n'
            f'{components},system:kube-components,components,"system:masters"\n')
        (self.folder / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))
        components_config = self.kubeconfig(self.folder / "components.kubeconfig", components, "components")
        f = self.folder
        self._start("etcd", [str(bin_dir / "etcd"), "--data-dir", str(f / "etcd"), "--name", "test",
                             "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
                             "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
                             "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
                             "--initial-cluster", f"test=http://127.0.0.1:{etcd_peer}"])
        self._start("kube-apiserver", [
            str(bin_dir / "kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={api_port}",
            "--insecure-port=0", f"--tls-cert-file={f / 'server.crt'}", f"--tls-private-key-file={f / 'server.key'}",
            f"--token-auth-file={f / 'tokens.csv'}", "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={f / 'sa.pub'}", f"--service-account-signing-key-file={f / 'sa.key'}",
            "--service-cluster-ip-range=10.96.0.0/16", "--endpoint-reconciler-type=none",
            # No kube-proxy routes ClusterIPs here: the server dials a webhook Service's endpoint
            # (tests/realapi/webhook.py points the chart's at the in-process operator).
            "--enable-aggregator-routing=true",
            "--disable-admission-plugins=ServiceAccount",
            "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
            f"--audit-policy-file={f / 'audit-policy.yaml'}", f"--audit-log-path={self.audit_log}"])
        self._wait_ready()
        self._start("kube-controller-manager", [
            str(bin_dir / "kube-controller-manager"), f"--kubeconfig={components_config}", "--leader-elect=false",
            "--port=0", "--secure-port=0", "--controllers=*,-csrsigning,-nodeipam,-bootstrapsigner,-tokencleaner",
            f"--service-account-private-key-file={f / 'sa.key'}", f"--root-ca-file={f / 'ca.crt'}",
            # A pod on a node that stops heartbeating is evicted after this long (the default, 5 min,
            # is longer than any test).
            "--pod-eviction-timeout=20s", "--node-monitor-grace-period=20s"])
        self._start("kube-scheduler", [str(bin_dir / "kube-scheduler"), f"--kubeconfig={components_config}",
                                       "--leader-elect=false", "--port=0", "--secure-port=0"])
        return self

    def _start(self, name: str, argv: list[str]) -> None:
        log = open(self.folder / f"{name}.log", "wb")  # noqa: SIM115 (the process keeps it)
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            cwd=self.folder)

    def _wait_ready(self, timeout: float = 60.0) -> None:
        import urllib3

        pool = urllib3.PoolManager(ca_certs=str(self.ca_file), cert_reqs="CERT_REQUIRED", retries=False,
                                   timeout=urllib3.Timeout(connect=1.0, read=5.0))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    tail = (self.folder / f"{name}.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")
            try:
                r = pool.request("GET", f"{self.url}/readyz",
                                 headers={"Authorization": f"Bearer {self.admin_token}"})
                if r.status == 200:
                    return
            except urllib3.exceptions.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"kube-apiserver was not ready within {timeout:.0f} s")

    def pause(self, name: str = "kube-apiserver") -> None:
        """Stop a component where it stands (SIGSTOP): an API server so paused accepts connections
        (the kernel's backlog) and answers nothing, as one that hangs or sits behind a dead link."""
        os.kill(self.procs[name].pid, signal.SIGSTOP)

    def resume(self, name: str = "kube-apiserver") -> None:
        """Let a paused component go on (SIGCONT)."""
        os.kill(self.procs[name].pid, signal.SIGCONT)

    def alive(self) -> list[str]:
        """Components that have exited (a test that ends with a dead controller is suspect)."""
        return [name for name, proc in self.procs.items() if proc.poll() is not None]

    def __exit__(self, *exc: object) -> None:
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)  # a paused one (pause) would not act on SIGTERM
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        shutil.rmtree(self.folder / "etcd", ignore_errors=True)
