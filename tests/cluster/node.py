"""A real Kubernetes node on this machine: containerd, the kubelet and kube-proxy (docs/KUBERNETES.md,
"A real node").

`scripts/node.sh prepare` builds or installs the pieces (the kubelet and kube-proxy from the
control plane's own 1.20 tree, Debian's containerd 1.6, runc and CNI plugins, our images and a
pause image); this module runs them, as root, and cleans up after them:

- the node's address is 10.99.0.1, added to `lo` for the test: local to this machine only, and
  reachable from the pods through their bridge's gateway;
- containerd (its own config, socket, root and state folders under /var/lib/diloco-node and
  /run/diloco-node, so the machine's own containerd settings are untouched) with runc, cgroupfs,
  overlayfs, the pause image as sandbox image, and a bridge CNI network 10.244.0.0/24;
- the kubelet (remote runtime: that containerd; cgroupfs; cluster DNS at the node address);
- kube-proxy in iptables mode, masquerading everything it proxies (pods on one bridge reaching
  each other through a Service address), with its chains removed afterwards (`--cleanup`);
- a small DNS server for `*.svc.cluster.local` (tests/cluster/dns.py): no CoreDNS image here.

The control plane is tests/realapi's, with what a node needs on top (NodeControlPlane): the API
server listens on every address and advertises the node address (so the `kubernetes` Service,
through kube-proxy, reaches it from a pod), its certificate names that address and the Service's
ClusterIP, and the ServiceAccount admission plugin is on again, so the operator's pod gets the
token of its ServiceAccount, as in any cluster.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from diloco.operator.kube import Kube
from tests.cluster.dns import ClusterDNS
from tests.realapi import controlplane
from tests.realapi.controlplane import ROOT, ControlPlane, free_port

NODE_IP = "10.99.0.1"
NODE_NAME = "diloco-node"
POD_SUBNET = "10.244.0.0/24"
SERVICE_IP = "10.96.0.1"  # the `kubernetes` Service (the API server's --service-cluster-ip-range starts there)
STATE = Path(os.environ.get("DILOCO_NODE_STATE", "/var/lib/diloco-node"))
RUN = Path("/run/diloco-node")
SOCKET = RUN / "containerd.sock"
PAUSE_IMAGE = os.environ.get("DILOCO_PAUSE_IMAGE", "localhost/diloco/pause:1")
BRIDGE = "diloco-br0"
# What the kubelet sets (protectKernelDefaults off) and kube-proxy sets: put back afterwards.
SYSCTLS = ["kernel/panic", "kernel/panic_on_oops", "vm/overcommit_memory", "vm/panic_on_oom",
           "net/ipv4/conf/all/route_localnet", "net/bridge/bridge-nf-call-iptables"]


def node_binaries() -> Path:
    """The kubelet and kube-proxy (scripts/control-plane.sh build-node; cached once built)."""
    done = subprocess.run(["bash", str(ROOT / "scripts" / "control-plane.sh"), "node-path"], capture_output=True,
                          text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"scripts/control-plane.sh node-path failed:\n{done.stderr[-4000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def _certificates_for_a_node(folder: Path) -> None:
    """tests/realapi's certificates, with the node address and the `kubernetes` Service's ClusterIP
    among the serving certificate's names (a pod's in-cluster client connects to the ClusterIP)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    original(folder)  # the service-account key pair (and a CA and certificate, replaced below)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    server_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "diloco-node-test-ca")])
    valid = (now - datetime.timedelta(hours=1), now + datetime.timedelta(days=2))
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(valid[0]).not_valid_after(valid[1])
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    names: list[x509.GeneralName] = [
        x509.DNSName(d) for d in ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                                  "kubernetes.default.svc.cluster.local")]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", NODE_IP, SERVICE_IP)]
    server = (x509.CertificateBuilder()
              .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
              .issuer_name(ca_name).public_key(server_key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(valid[0]).not_valid_after(valid[1])
              .add_extension(x509.SubjectAlternativeName(names), critical=False)
              .sign(ca_key, hashes.SHA256()))
    (folder / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (folder / "server.crt").write_bytes(server.public_bytes(serialization.Encoding.PEM))
    (folder / "server.key").write_bytes(server_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()))


original = controlplane._certificates


class NodeControlPlane(ControlPlane):
    """tests/realapi's control plane, reachable from pods on a real node (see the module's doc)."""

    def __enter__(self) -> NodeControlPlane:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(controlplane, "_certificates", _certificates_for_a_node)
            super().__enter__()
        return self

    def _start(self, name: str, argv: list[str]) -> None:
        if name == "kube-apiserver":
            replace = {"--bind-address=127.0.0.1": "--bind-address=0.0.0.0",
                       "--advertise-address=127.0.0.1": f"--advertise-address={NODE_IP}",
                       "--endpoint-reconciler-type=none": "--endpoint-reconciler-type=lease"}
            argv = [replace.get(a, a) for a in argv if a != "--disable-admission-plugins=ServiceAccount"]
            missing = [a for a in replace if a not in argv and replace[a] not in argv]
            assert not missing, f"tests/realapi's API server flags changed: {missing}"
            argv.append("--kubelet-preferred-address-types=InternalIP")
        super()._start(name, argv)


def sh(*argv: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done


def ctr(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return sh("ctr", "--address", str(SOCKET), "--namespace", "k8s.io", *args, check=check)


def mounts_under(folder: Path) -> list[str]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == str(folder) or point.startswith(str(folder) + "/"):
            out.append(point)
    return sorted(out, key=len, reverse=True)


def unmount_all(folder: Path) -> None:
    for point in mounts_under(folder):
        sh("umount", "-l", point, check=False)


class Node:
    """`with Node(plane, folder) as node:` runs containerd, the kubelet, kube-proxy and the DNS
    until the block ends; `node.wait_ready()` waits for the Node object to be Ready."""

    def __init__(self, plane: ControlPlane, folder: Path, admin: Kube):
        self.plane, self.folder, self.admin = plane, folder, admin
        self.name = NODE_NAME
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.saved: dict[str, str] = {}
        self.dns: ClusterDNS | None = None
        self.kubelet_root = STATE / "kubelet"
        self.volumes = STATE / "volumes"
        self.netns_before = set(Path("/run/netns").glob("cni-*"))

    # -- set-up --------------------------------------------------------------------------------

    def __enter__(self) -> Node:
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            self._network()
            self._containerd()
            done = sh("bash", str(ROOT / "scripts" / "node.sh"), "import", str(SOCKET), timeout=1800)
            (self.folder / "import.log").write_text(done.stderr)
            bins = node_binaries()
            self.dns = ClusterDNS(self.admin, NODE_IP).__enter__()
            self._kubelet(bins / "kubelet")
            self._kube_proxy(bins / "kube-proxy")
        except BaseException:
            self.__exit__()
            raise
        return self

    def _network(self) -> None:
        for key in SYSCTLS:
            path = Path("/proc/sys") / key
            if path.exists():
                self.saved[key] = path.read_text().strip()
        if NODE_IP not in sh("ip", "-4", "addr", "show", "dev", "lo").stdout:
            sh("ip", "addr", "add", f"{NODE_IP}/32", "dev", "lo")
        # Pods reach the node address through the bridge: the host must forward. Left on
        # afterwards (podman's networks need it too).
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1")
        # A bridge left by an interrupted run (its addresses would collide with this one's).
        if sh("ip", "link", "show", BRIDGE, check=False).returncode == 0:
            sh("ip", "link", "delete", BRIDGE, check=False)

    def _containerd(self) -> None:
        unmount_all(RUN)
        shutil.rmtree(RUN, ignore_errors=True)
        shutil.rmtree(STATE / "cni-ipam", ignore_errors=True)  # addresses of sandboxes that are gone
        cni = STATE / "cni"
        for d in (RUN, cni, STATE / "containerd"):
            d.mkdir(parents=True, exist_ok=True)
        (cni / "10-diloco.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": "diloco-node",
            "plugins": [{"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False, "hairpinMode": True,
                         "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_SUBNET}]],
                                  "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(STATE / "cni-ipam")}},
                        {"type": "portmap", "capabilities": {"portMappings": True}}]}, indent=1))
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        config = self.folder / "containerd.toml"
        config.write_text(f"""version = 2
root = "{STATE / 'containerd'}"
state = "{RUN / 'containerd'}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "{SOCKET}"
[ttrpc]
  address = "{SOCKET}.ttrpc"
[metrics]
  address = ""
[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  # No CAP_SYS_RESOURCE here: an oom_score_adj below containerd's own (-998 for sandboxes)
  # makes runc's init fail ("can't get final child's PID from pipe: EOF").
  restrict_oom_score_adj = true
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        BinaryName = "/usr/sbin/runc"
        SystemdCgroup = false
  [{cri}.cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{STATE / 'containerd' / 'opt'}"
""")
        self._start("containerd", ["containerd", "--config", str(config)])
        self._wait(lambda: SOCKET.exists() and ctr("version", check=False).returncode == 0, 60, "containerd")

    def _kubelet(self, binary: Path) -> None:
        unmount_all(self.kubelet_root)
        shutil.rmtree(self.kubelet_root, ignore_errors=True)
        self.kubelet_root.mkdir(parents=True)
        self.volumes.mkdir(parents=True, exist_ok=True)
        (self.folder / "resolv.conf").write_text("")  # pods see the cluster DNS only
        self.kubelet_health = free_port()
        config = self.folder / "kubelet.yaml"
        config.write_text(yaml.safe_dump({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": NODE_IP, "port": free_port(), "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": self.kubelet_health,
            "cgroupDriver": "cgroupfs", "failSwapOn": False,
            # The API server's calls (logs, exec) are accepted as they come; the port is on the
            # node address, which only this machine reaches.
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "clusterDomain": "cluster.local", "clusterDNS": [NODE_IP],
            "resolvConf": str(self.folder / "resolv.conf"),
            # A machine shared with other work: evict nothing short of real exhaustion.
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                             "nodefs.inodesFree": "1%"},
            "serializeImagePulls": False, "maxPods": 30,
        }))
        kubeconfig = self.plane.kubeconfig(self.folder / "kubelet.kubeconfig", self.plane.admin_token, "kubelet")
        self._start("kubelet", [
            str(binary), f"--config={config}", f"--kubeconfig={kubeconfig}", f"--root-dir={self.kubelet_root}",
            "--container-runtime=remote", f"--container-runtime-endpoint=unix://{SOCKET}",
            f"--pod-infra-container-image={PAUSE_IMAGE}", f"--hostname-override={NODE_NAME}",
            f"--node-ip={NODE_IP}", "--v=2"])

    def _kube_proxy(self, binary: Path) -> None:
        kubeconfig = self.plane.kubeconfig(self.folder / "kube-proxy.kubeconfig", self.plane.admin_token, "proxy")
        self._start("kube-proxy", [
            str(binary), f"--kubeconfig={kubeconfig}", f"--hostname-override={NODE_NAME}",
            f"--bind-address={NODE_IP}", "--proxy-mode=iptables", "--masquerade-all",
            f"--cluster-cidr={POD_SUBNET}", f"--healthz-bind-address=127.0.0.1:{free_port()}",
            f"--metrics-bind-address=127.0.0.1:{free_port()}", "--conntrack-max-per-core=0",
            "--conntrack-tcp-timeout-established=0", "--conntrack-tcp-timeout-close-wait=0", "--v=2"])
        self.kube_proxy_binary = binary

    def _start(self, name: str, argv: list[str]) -> None:
        log = open(self.folder / f"{name}.log", "wb")  # noqa: SIM115 (the process keeps it)
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            cwd=self.folder)

    def _wait(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log(name)[-3000:]}")
            value = predicate()
            if value:
                return value
            time.sleep(0.5)
        raise RuntimeError(f"{what} not ready within {timeout:.0f} s")

    def log(self, name: str) -> str:
        path = self.folder / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def ready(self) -> bool:
        try:
            node = self.admin.request("GET", f"api/v1/nodes/{NODE_NAME}")
        except Exception:  # not registered yet
            return False
        return any(c["type"] == "Ready" and c["status"] == "True" for c in node.get("status", {}).get("conditions", []))

    def wait_ready(self, timeout: float = 120) -> None:
        self._wait(self.ready, timeout, f"node {NODE_NAME}")

    def alive(self) -> list[str]:
        """Node processes that have exited."""
        return [name for name, proc in self.procs.items() if proc.poll() is not None]

    # -- tear-down -----------------------------------------------------------------------------

    def tasks(self) -> list[str]:
        if "containerd" not in self.procs or self.procs["containerd"].poll() is not None:
            return []
        lines = ctr("tasks", "ls", check=False).stdout.splitlines()[1:]
        return [ln.split()[0] for ln in lines if ln.strip()]

    def container_uids(self) -> dict[str, str]:
        """Each running pod container's (not sandbox's) main process: its real uid, read on the host."""
        kind = 'labels."io.cri-containerd.kind"==container'
        ids = set(ctr("containers", "ls", "--quiet", kind).stdout.split())
        out = {}
        for line in ctr("tasks", "ls").stdout.splitlines()[1:]:
            task, pid, state = line.split()[:3]
            if task in ids and state == "RUNNING":
                status = Path(f"/proc/{pid}/status").read_text().splitlines()
                out[task] = next(ln.split()[1] for ln in status if ln.startswith("Uid:"))
        return out

    def drain(self, timeout: float = 90) -> None:
        """Every pod off the node, through the kubelet (containers stopped, sandboxes' networks
        torn down by CNI): deletes the pods left in every namespace, waits for containerd's tasks."""
        try:
            pods = self.admin.request("GET", "api/v1/pods").get("items") or []
        except Exception:  # the API server is gone: the fallback below cleans up
            pods = []
        for p in pods:
            meta = p["metadata"]
            try:
                self.admin.request("DELETE", f"api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                                   {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 5})
            except Exception:  # gone already
                pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.tasks() and self.procs.get("kubelet") \
                and self.procs["kubelet"].poll() is None:
            time.sleep(1)

    def __exit__(self, *exc: object) -> None:
        for name in ("kube-proxy", "kubelet"):
            self._stop(name)
        if self.dns is not None:
            self.dns.__exit__()
        # Whatever the kubelet left running: killed and removed through containerd.
        for task in self.tasks():
            ctr("tasks", "kill", "--signal", "SIGKILL", task, check=False)
        deadline = time.monotonic() + 15
        while self.tasks() and time.monotonic() < deadline:
            time.sleep(0.5)
        for task in self.tasks():
            ctr("tasks", "delete", "--force", task, check=False)
        self._stop("containerd")
        if hasattr(self, "kube_proxy_binary"):
            sh(str(self.kube_proxy_binary), "--cleanup", check=False)
        self._iptables_cleanup()
        unmount_all(self.kubelet_root)
        unmount_all(RUN)
        for ns in set(Path("/run/netns").glob("cni-*")) - self.netns_before:  # sandboxes CNI never tore down
            sh("umount", "-l", str(ns), check=False)
            ns.unlink(missing_ok=True)
        sh("ip", "link", "delete", BRIDGE, check=False)
        sh("ip", "addr", "del", f"{NODE_IP}/32", "dev", "lo", check=False)
        for key, value in self.saved.items():
            try:
                (Path("/proc/sys") / key).write_text(value)
            except OSError:
                pass

    def _stop(self, name: str) -> None:
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

    @staticmethod
    def _iptables_cleanup() -> None:
        """The kubelet's own chains (KUBE-FIREWALL, KUBE-MARK-*, ...): kube-proxy --cleanup leaves them."""
        for table in ("filter", "nat", "mangle"):
            rules = sh("iptables-save", "-t", table, check=False).stdout.splitlines()
            for rule in rules:
                if rule.startswith("-A ") and "-j KUBE-" in rule and not rule.split()[1].startswith("KUBE-"):
                    sh("iptables", "-t", table, "-D", *shlex.split(rule)[1:], check=False)
            for rule in rules:
                if rule.startswith(":KUBE-"):
                    chain = rule[1:].split()[0]
                    sh("iptables", "-t", table, "-F", chain, check=False)
            for rule in rules:
                if rule.startswith(":KUBE-"):
                    sh("iptables", "-t", table, "-X", rule[1:].split()[0], check=False)
