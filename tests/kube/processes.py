"""A container runtime for the full-system test: each pod's container runs as a local process.

What a node would provide is emulated from the pod spec itself: `$(VAR)` expansion of the
args from env (values, pod labels, Secrets), ConfigMap and Secret volumes written to a
directory, persistent volumes as directories that outlive pods, Service names resolved to
127.0.0.1 with each Service port mapped to a free local port (stable, so a re-created syncer
pod keeps its address; every Service in front of the same port shares it), and readiness
when the process says so on stdout (the syncer's SYNCER_READY, a learner's `joined` event).
Two live pods behind one Service (an active syncer and its standby, spec.syncer.standby) share
the port their readiness probe checks: only the ready one listens on it (the standby opens its
gRPC port once it holds the lease), so the Service follows the active pod as in a cluster; a
Service port the other pod already listens on (metrics) is the second pod's own, as a pod IP's
would be. The pod's host name is its name ($HOSTNAME, and `socket.gethostname()` through
tests/kube/podhost/sitecustomize.py), and `envFrom` Secrets and ConfigMaps are read as `env` ones.
Each container start gets a fresh, empty termination-message file at its terminationMessagePath
(the kubelet's per-start file; `message` reads back its last 4096 bytes, as the kubelet does);
a path under a mount, in args or env values (the compilation cache's variables), is the
mount's local one, as a bind mount makes it.
Learners are pinned to alternating CPUs (docs/DEVELOPMENT.md).

Names outside the cluster: `hosts` maps a `host:port` that DNS would resolve elsewhere (another
cluster's exposed syncer, `shard-<i>.<host>:50051`) to a local address, as a resolver would; the
process dials the local address but still checks the syncer's certificate for the dialled host
(`--tls-server-name`, unless the pod gives one), as it would after a DNS lookup. A pod of a
StatefulSet is also reached by its own name under its headless Service
(`<pod>.<service>.<namespace>.svc`, a sharded syncer's shards), and an argument listing several
addresses (comma-separated, one per shard) maps each. `dial` is that mapping for the test's and
the operator's own clients.
"""

from __future__ import annotations

import base64
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from diloco.contract import ALTERNATE, READY_PREFIX, Event
from diloco.operator.kube import Kube
from tests.kube.controllers import Runtime

POD_HOST = Path(__file__).with_name("podhost")  # its sitecustomize: gethostname() is the pod's name
READY_MARKS = {"syncer": READY_PREFIX, "learner": f'"event": "{Event.JOINED}"'}
STOP_GRACE = 15.0  # seconds from SIGTERM to SIGKILL
TERMINATION_MESSAGE_PATH = "/dev/termination-log"  # what the API server defaults a container's to
MAX_TERMINATION_MESSAGE = 4096  # bytes: the kubelet's MaxContainerTerminationMessageLength (the file's tail)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VolumeMissing(Exception):
    """A pod's ConfigMap or Secret is not there (yet, or any more: its job is being deleted). The
    kubelet then retries the mount and the pod stays in ContainerCreating; it does not crash."""


class ProcessRuntime(Runtime):
    def __init__(self, api: Kube, namespace: str, root: Path, cpus: int = 2, first_cpu: int = 0):
        """`first_cpu`: where this runtime's learners start pinning (two clusters share one machine)."""
        super().__init__()
        self.api, self.namespace, self.root, self.cpus = api, namespace, root, cpus
        self.ports: dict[str, int] = {}  # "svc.ns.svc:port" -> local port
        self.procs: dict[str, subprocess.Popen[bytes]] = {}  # pod uid -> process
        self.logs: dict[str, Path] = {}
        self.stopping: dict[str, float] = {}
        self.messages: dict[str, Path] = {}  # pod uid -> its container's current start's termination-message file
        self.holders: dict[int, str] = {}  # a Service's local port -> the pod uid that got it last
        self._starting = threading.Lock()  # several kubelets (Nodes) may share this runtime
        self._learners_started = first_cpu
        self.hosts: dict[str, str] = {}  # "host:port" outside the cluster -> "127.0.0.1:port" (see above)

    # -- addresses --------------------------------------------------------------------------

    def local(self, address: str) -> str:
        """A Service address (`name.namespace.svc:port`) as a stable local one."""
        if address not in self.ports:
            self.ports[address] = free_port()
        return f"127.0.0.1:{self.ports[address]}"

    def _mapped(self, address: str) -> bool:
        """`address`, or each of its alternates (`a|b`: a shard's syncer and its standby elsewhere), is ours to map."""
        return all(a in self.hosts or re.fullmatch(r"[\w.-]+\.svc:\d+", a) is not None for a in address.split(ALTERNATE))

    def dial(self, address: str) -> str:
        """Where a process here reaches `address` (a Service's, a pod's under a headless Service,
        or one of `hosts`), one by one for a comma-separated list and each shard's alternates;
        any other address as it is."""
        return ",".join(ALTERNATE.join(self.hosts.get(a) or (self.local(a) if self._mapped(a) else a)
                                       for a in shard.split(ALTERNATE)) for shard in address.split(","))

    def _container_port(self, pod: dict[str, Any], container: dict[str, Any], port: dict[str, Any]) -> int:
        """The local port for a container port: a Service's stable one if a Service targets it."""
        labels = pod["metadata"].get("labels") or {}
        hostname, subdomain = pod["spec"].get("hostname"), pod["spec"].get("subdomain")
        addresses = []
        for svc in self.api.list("Service", self.namespace):
            selector = svc["spec"].get("selector") or {}
            if not selector or not selector.items() <= labels.items():
                continue
            name = svc["metadata"]["name"]
            if svc["spec"].get("clusterIP") == "None":  # headless: each pod by its own name, no shared port
                if not hostname or subdomain != name:
                    continue
                name = f"{hostname}.{name}"
            addresses += [f"{name}.{self.namespace}.svc:{sp['port']}" for sp in svc["spec"]["ports"]
                          if sp.get("targetPort") in (port.get("name"), port["containerPort"])]
        if not addresses:
            return free_port()
        local = next((self.ports[a] for a in addresses if a in self.ports), None)
        probed = ((container.get("readinessProbe") or {}).get("tcpSocket") or {}).get("port")
        if local is not None and probed not in (port.get("name"), port["containerPort"]) and \
                self._held_by_another(local, pod["metadata"]["uid"]):
            return free_port()  # a second live pod behind the Service: its own port, as its own IP's
        local = local or free_port()
        self.ports.update(dict.fromkeys(addresses, local))
        self.holders[local] = pod["metadata"]["uid"]
        return local

    def _held_by_another(self, local: int, uid: str) -> bool:
        """Whether another pod's live process, not being stopped, was given this Service port."""
        holder = self.holders.get(local)
        proc = self.procs.get(holder) if holder is not None and holder != uid else None
        return proc is not None and proc.poll() is None and holder not in self.stopping

    # -- environment --------------------------------------------------------------------------

    @staticmethod
    def _local_path(value: str, mounts: dict[str, Path]) -> str:
        """A container path as the process sees it: under the mount that holds it, if any."""
        for mount_path, local in sorted(mounts.items(), key=lambda m: -len(m[0])):
            if value.startswith(mount_path + "/") or value == mount_path:
                return str(local) + value[len(mount_path):]
        return value

    def _env(self, pod: dict[str, Any], container: dict[str, Any], home: Path,
             mounts: dict[str, Path]) -> dict[str, str]:
        """`mounts`: container paths of what is mounted into it (volumes, the termination-message file)."""
        env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(POD_HOST),
               "HOSTNAME": pod["spec"].get("hostname") or pod["metadata"]["name"]}
        for source in container.get("envFrom") or []:  # before `env`, which overrides it
            kind = "Secret" if "secretRef" in source else "ConfigMap"
            ref = source.get("secretRef") or source["configMapRef"]
            found = self.api.get(kind, self.namespace, ref["name"])
            if not found:
                raise VolumeMissing(f"{kind} {ref['name']} is missing")
            env.update({source.get("prefix", "") + k: base64.b64decode(v).decode() if kind == "Secret" else v
                        for k, v in (found.get("data") or {}).items()})
        for item in container.get("env") or []:
            source = item.get("valueFrom") or {}
            if "value" in item:
                env[item["name"]] = self._local_path(item["value"], mounts)
            elif "fieldRef" in source:
                path = source["fieldRef"]["fieldPath"]
                key = re.fullmatch(r"metadata\.labels\['(.+)'\]", path)
                assert key or path in ("metadata.name", "metadata.namespace"), source
                env[item["name"]] = pod["metadata"]["labels"][key.group(1)] if key else pod["metadata"][path[9:]]
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                secret = self.api.get("Secret", self.namespace, ref["name"])
                if not secret:
                    raise VolumeMissing(f"Secret {ref['name']} is missing")
                env[item["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
        env["HOME"] = str(home)
        return env

    def _mounts(self, pod: dict[str, Any], container: dict[str, Any], pod_dir: Path) -> dict[str, Path]:
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        out: dict[str, Path] = {}
        for mount in container.get("volumeMounts") or []:
            vol = volumes[mount["name"]]
            if "configMap" in vol:
                path = pod_dir / mount["name"]
                path.mkdir(parents=True, exist_ok=True)
                cm = self.api.get("ConfigMap", self.namespace, vol["configMap"]["name"])
                if not cm:
                    raise VolumeMissing(f"ConfigMap {vol['configMap']['name']} is missing")
                for key, text in cm["data"].items():
                    (path / key).write_text(text)
            elif "secret" in vol:  # the listed items only, as the kubelet projects them
                path = pod_dir / mount["name"]
                path.mkdir(parents=True, exist_ok=True)
                secret = self.api.get("Secret", self.namespace, vol["secret"]["secretName"])
                if not secret:
                    raise VolumeMissing(f"Secret {vol['secret']['secretName']} is missing")
                for item in vol["secret"].get("items") or [{"key": k, "path": k} for k in secret["data"]]:
                    (path / item["path"]).write_bytes(base64.b64decode(secret["data"][item["key"]]))
            elif "persistentVolumeClaim" in vol:  # outlives the pod, like a real volume
                path = self.root / "volumes" / vol["persistentVolumeClaim"]["claimName"]
            else:
                path = pod_dir / mount["name"]
            path.mkdir(parents=True, exist_ok=True)
            out[mount["mountPath"]] = path
        return out

    # -- Runtime ------------------------------------------------------------------------------

    def start(self, pod: dict[str, Any]) -> None:
        with self._starting:  # ports are handed out and the process started before another start
            self._start(pod)

    def _start(self, pod: dict[str, Any]) -> None:
        (container,) = pod["spec"]["containers"]
        uid = pod["metadata"]["uid"]
        pod_dir = self.root / "pods" / f"{pod['metadata']['name']}-{uid[:8]}"
        pod_dir.mkdir(parents=True, exist_ok=True)
        mounts = self._mounts(pod, container, pod_dir)
        # The kubelet makes a new file for every container start and mounts it at terminationMessagePath.
        message = pod_dir / f"termination-log-{len(list(pod_dir.glob('termination-log-*')))}"
        message.write_bytes(b"")
        files = {container.get("terminationMessagePath") or TERMINATION_MESSAGE_PATH: message}
        self.messages[uid] = message
        mounts.update(files)
        self.stopping.pop(uid, None)  # a restarted container is not being stopped
        env = self._env(pod, container, mounts.get("/tmp", pod_dir), mounts)
        ports = {str(p["containerPort"]): str(self._container_port(pod, container, p))
                 for p in container.get("ports") or []}
        argv: list[str] = []
        resolved: list[str] = []  # hosts outside the cluster, dialled by name
        for arg in [*container["command"], *container.get("args", [])]:
            arg = self._local_path(re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg), mounts)
            if all(self._mapped(a) for a in arg.split(",")):
                first = [a.split(ALTERNATE)[0] for a in arg.split(",")]  # a shard's first syncer
                if all(a in self.hosts for a in first):
                    resolved = [a.rsplit(":", 1)[0] for a in first]
                arg = self.dial(arg)
            argv.append(ports.get(arg, arg) if argv and argv[-1].endswith("port") else arg)
        if resolved and "--tls-ca" in argv and "--tls-server-name" not in argv:
            argv += ["--tls-server-name", ",".join(resolved)]  # the certificate is checked for the name dialled
        if container["name"] == "learner":
            argv += ["--cpus", str(self._learners_started % self.cpus)]
            self._learners_started += 1
        argv[0] = str(Path(sys.executable).parent / argv[0])
        self.logs[uid] = pod_dir / "stdout.log"
        with open(self.logs[uid], "wb") as out:
            self.procs[uid] = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                               cwd=pod_dir, start_new_session=True)

    def ready(self, pod: dict[str, Any]) -> bool:
        uid = pod["metadata"]["uid"]
        mark = READY_MARKS[pod["spec"]["containers"][0]["name"]]
        proc = self.procs.get(uid)
        return proc is not None and proc.poll() is None and mark in self.logs[uid].read_text(errors="replace")

    def exited(self, pod: dict[str, Any]) -> int | None:
        proc = self.procs.get(pod["metadata"]["uid"])
        return None if proc is None else proc.poll()

    def message(self, pod: dict[str, Any]) -> str:
        """The termination message of the container's latest start: its file's last 4096 bytes."""
        path = self.messages.get(pod["metadata"]["uid"])
        if path is None or not path.exists():
            return ""
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - MAX_TERMINATION_MESSAGE))
            return f.read().decode("utf-8", "replace")

    def kill(self, pod: dict[str, Any], sig: int) -> None:
        proc = self.procs.get(pod["metadata"]["uid"])
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)

    def stop(self, pod: dict[str, Any]) -> bool:
        uid = pod["metadata"]["uid"]
        proc = self.procs.get(uid)
        if proc is None or proc.poll() is not None:
            self.procs.pop(uid, None)
            return True
        if uid not in self.stopping:
            self.stopping[uid] = time.monotonic()
            proc.send_signal(signal.SIGTERM)
        elif time.monotonic() - self.stopping[uid] > STOP_GRACE:
            proc.kill()
        return False

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs.values():
            proc.wait(10)

    def logs_of(self, pod_name: str) -> list[str]:
        """What each incarnation of the named pod printed, oldest first."""
        dirs = sorted((self.root / "pods").glob(f"{pod_name}-*"), key=lambda d: d.stat().st_mtime)
        return [(d / "stdout.log").read_text(errors="replace") for d in dirs if (d / "stdout.log").exists()]
