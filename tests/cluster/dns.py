"""The cluster's DNS for a real node: Service names to addresses, read from the API server.

No CoreDNS image can be pulled here, so this small UDP server stands in for it. It answers what
our pods ask: `<service>.<namespace>.svc.<domain>` (a Service's ClusterIP, or a headless
Service's ready and not-ready endpoint addresses) and `<hostname>.<service>.<namespace>.svc.<domain>`
(a StatefulSet pod behind its headless Service). Every other name in the cluster domain is
NXDOMAIN, so a resolver walks the kubelet-written search list quickly; names outside it are
REFUSED (pods reach nothing outside the machine). A and AAAA only (AAAA: always empty).
"""

from __future__ import annotations

import socket
import struct
import threading
from typing import Any

from diloco.operator.kube import Kube

A, AAAA, IN = 1, 28, 1
NOERROR, NXDOMAIN, REFUSED, FORMERR = 0, 3, 5, 1


def parse_question(packet: bytes) -> tuple[int, int, str, int, int]:
    """(id, flags, name, qtype, end offset of the question) of a query with one question."""
    ident, flags, qdcount = struct.unpack("!HHH", packet[:6])
    if qdcount != 1:
        raise ValueError("one question per query")
    labels, at = [], 12
    while True:
        length = packet[at]
        at += 1
        if length == 0:
            break
        if length & 0xC0:
            raise ValueError("compressed names in a question")
        labels.append(packet[at:at + length].decode("ascii").lower())
        at += length
    qtype, _qclass = struct.unpack("!HH", packet[at:at + 4])
    return ident, flags, ".".join(labels), qtype, at + 4


def response(packet: bytes, rcode: int, addresses: list[str], ttl: int = 5) -> bytes:
    ident, flags, _name, _qtype, end = parse_question(packet)
    rd = flags & 0x0100
    header = struct.pack("!HHHHHH", ident, 0x8000 | 0x0400 | rd | 0x0080 | rcode, 1, len(addresses), 0, 0)
    answers = b"".join(struct.pack("!HHHIH", 0xC00C, A, IN, ttl, 4) + socket.inet_aton(a) for a in addresses)
    return header + packet[12:end] + answers


class ClusterDNS:
    """`with ClusterDNS(admin, "10.99.0.1"):` serves UDP port 53 on that address in a thread."""

    def __init__(self, admin: Kube, address: str, domain: str = "cluster.local", port: int = 53):
        self.admin, self.address, self.domain, self.port = admin, address, domain, port
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.thread = threading.Thread(target=self._serve, name="cluster-dns", daemon=True)
        self.stopping = threading.Event()
        self.answered: list[tuple[str, list[str]]] = []

    def __enter__(self) -> ClusterDNS:
        self.sock.bind((self.address, self.port))
        self.sock.settimeout(0.5)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(5)
        self.sock.close()

    def _get(self, path: str) -> dict[str, Any] | None:
        try:
            return self.admin.request("GET", path)
        except Exception:  # 404 or a passing API error: the name does not exist
            return None

    def resolve(self, name: str) -> list[str] | None:
        """Addresses of a cluster name; None: no such name."""
        suffix = f".svc.{self.domain}"
        if not name.endswith(suffix):
            return None
        parts = name[: -len(suffix)].split(".")
        if len(parts) == 2:
            service, namespace = parts
            svc = self._get(f"api/v1/namespaces/{namespace}/services/{service}")
            if not svc:
                return None
            ip = svc["spec"].get("clusterIP")
            if ip and ip != "None":
                return [ip]
            return self._endpoints(namespace, service, None)
        if len(parts) == 3:
            hostname, service, namespace = parts
            return self._endpoints(namespace, service, hostname) or None
        return None

    def _endpoints(self, namespace: str, service: str, hostname: str | None) -> list[str]:
        eps = self._get(f"api/v1/namespaces/{namespace}/endpoints/{service}") or {}
        out = []
        for subset in eps.get("subsets") or []:
            for addr in (subset.get("addresses") or []) + (subset.get("notReadyAddresses") or []):
                if hostname is None or addr.get("hostname") == hostname:
                    out.append(addr["ip"])
        return sorted(set(out))

    def answer(self, packet: bytes) -> bytes:
        try:
            _ident, _flags, name, qtype, _end = parse_question(packet)
        except (ValueError, IndexError, struct.error, UnicodeDecodeError):
            return packet[:2] + struct.pack("!HHHHH", 0x8000 | FORMERR, 0, 0, 0, 0)
        if not name.endswith("." + self.domain) and name != self.domain:
            return response(packet, REFUSED, [])
        addresses = self.resolve(name)
        if addresses is None:
            return response(packet, NXDOMAIN, [])
        self.answered.append((name, addresses))
        return response(packet, NOERROR, addresses if qtype == A else [])

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                packet, peer = self.sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                self.sock.sendto(self.answer(packet), peer)
            except OSError:
                pass
