"""The real images, run as the operator runs them: a syncer and two learners train together
in podman containers on one podman network (docs/IMAGES.md).

`scripts/images.sh` builds the base image (debootstrap) and both Dockerfiles with buildah. The
containers' command, args, user, security settings and mounts are translated from the pod
templates the operator renders for a tiny job, so a change there is tested here: non-root
(uid 10001), read-only root filesystem, /tmp an empty writable mount, the rendered config as a
read-only file, a checkpoint volume, and the learner finding the syncer by its Service name.
The token is a mounted file (`--token-file`), not an env value that `podman inspect` would show.

Minutes, and needs root, buildah, podman and PyPI (the first build): run with `make test-images`,
or set DILOCO_TEST_IMAGES=1; DILOCO_IMAGES_REUSE=1 runs the images already built, as they are.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest

from diloco.checkpoint import CheckpointStore
from diloco.contract import SYNCER_GRPC_PORT, Exit
from diloco.operator.render import job as render
from diloco.spec import parse_job
from diloco.wire import GRPC_OPTIONS, auth_metadata, pb, rpc
from tests.helpers import TINY_MODEL, wait_for

pytestmark = [
    pytest.mark.images, pytest.mark.e2e,
    pytest.mark.timeout(1800),  # a first build downloads JAX and the rest from PyPI (about 5 minutes)
    pytest.mark.skipif(os.environ.get("DILOCO_TEST_IMAGES") != "1",
                       reason="builds and runs the images (minutes, root): `make test-images` or DILOCO_TEST_IMAGES=1"),
]

ROOT = Path(__file__).resolve().parents[2]
STATE = Path(os.environ.get("DILOCO_IMAGES_STATE", "/var/tmp/diloco-images"))
RUNTIME = os.environ.get("DILOCO_OCI_RUNTIME", "/usr/sbin/runc")
LEARNER_IMAGE = os.environ.get("DILOCO_LEARNER_IMAGE", "localhost/diloco/learner:dev")
SYNCER_IMAGE = os.environ.get("DILOCO_SYNCER_IMAGE", "localhost/diloco/syncer:dev")
NAME, NAMESPACE = "images", "default"
TOKEN_DIR, TOKEN_FILE = "/etc/diloco-token", "/etc/diloco-token/token"
STEPS = 400


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CONTAINERS_CONF": str(STATE / "containers.conf")}
    done = subprocess.run(["podman", "--runtime", RUNTIME, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args[:3])}... failed ({done.returncode}): {done.stderr[-2000:]}")
    return done


@pytest.fixture(scope="module")
def images() -> None:
    """Both images, built (or reused through buildah's layer cache) by the script users run."""
    if os.geteuid() != 0:
        # Asked for (make test-images) and impossible here: a failure, never a silent pass.
        pytest.fail("make test-images needs root: rootful podman and buildah (debootstrap, runc)")
    reuse = ["--reuse"] if os.environ.get("DILOCO_IMAGES_REUSE") == "1" else []  # iterating on this test
    done = subprocess.run(["bash", str(ROOT / "scripts" / "images.sh"), *reuse], capture_output=True, text=True,
                          timeout=1700)
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def manifest() -> dict[str, Any]:
    return {
        "apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": NAME},
        "spec": {
            "learnerGroups": [{"name": "local", "region": "local", "replicas": 2, "image": LEARNER_IMAGE}],
            "syncer": {"image": SYNCER_IMAGE, "fragments": 4, "checkpointIntervalSeconds": 2},
            "model": dict(TINY_MODEL),
            "training": {"batchSize": 8, "learningRate": 0.003, "warmupSteps": 20, "decaySteps": 3000,
                         "steps": STEPS, "evalIntervalSteps": 20, "evalBatches": 2},
        },
    }


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion of container args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def run_args(pod: dict[str, Any], name: str, pod_name: str, network: str, volumes: dict[str, str],
             labels: dict[str, str] | None = None, aliases: tuple[str, ...] = ()) -> list[str]:
    """`podman run` arguments for a rendered pod's one container, as pod `pod_name` (its
    hostname). `volumes` maps each volume name to a host path ("tmpfs": an emptyDir)."""
    fields = {"metadata.name": pod_name, "metadata.namespace": NAMESPACE,
              **{f"metadata.labels['{k}']": v for k, v in (labels or {}).items()}}
    (c,) = pod["containers"]
    pod_sec, sec = pod["securityContext"], c["securityContext"]
    assert pod_sec["runAsNonRoot"] and sec["readOnlyRootFilesystem"] and not sec["allowPrivilegeEscalation"]
    out = ["run", "--detach", "--name", name, "--network", network, "--hostname", pod_name,
           "--user", f"{pod_sec['runAsUser']}:{pod_sec['runAsGroup']}", "--group-add", str(pod_sec["fsGroup"]),
           "--read-only", "--read-only-tmpfs=false", "--security-opt", "no-new-privileges",
           *[f"--cap-drop={cap}" for cap in sec["capabilities"]["drop"]],
           "--entrypoint", json.dumps(c["command"]), "--volume", f"{volumes['token']}:{TOKEN_DIR}:ro"]
    out += [f"--network-alias={a}" for a in aliases]
    for m in c["volumeMounts"]:
        source = volumes[m["name"]]  # a volume the operator added and this test does not know: KeyError
        if source == "tmpfs":
            out += ["--tmpfs", f"{m['mountPath']}:rw,mode=1777"]
        else:
            out += ["--volume", f"{source}:{m['mountPath']}:{'ro' if m.get('readOnly') else 'rw'}"]
    env: dict[str, str] = {}
    for e in c["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e["valueFrom"]:
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            assert "secretKeyRef" in e["valueFrom"], e  # the token: a mounted file here (--token-file)
    out += [x for k, v in env.items() for x in ("--env", f"{k}={v}")]
    return [*out, c["image"], *(expand(a, env) for a in c["args"]), "--token-file", TOKEN_FILE]


def events(container: str) -> list[dict[str, Any]]:
    """A learner's JSON event lines (its stdout; podman logs interleaves stderr's other lines)."""
    lines = podman("logs", container).stdout.splitlines()
    return [e for e in (json.loads(ln) for ln in lines if ln.startswith("{")) if isinstance(e, dict)]


def state(container: str) -> dict[str, Any]:
    return json.loads(podman("inspect", "--format", "{{json .State}}", container).stdout)


def process_uids(container: str) -> set[str]:
    """Real, effective, saved and filesystem uid of the container's main process, from the host."""
    pid = state(container)["Pid"]
    line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("Uid:"))
    return set(line.split()[1:])


def address(container: str, network: str) -> str:
    return json.loads(podman("inspect", "--format", "{{json .NetworkSettings.Networks}}", container).stdout)[
        network]["IPAddress"]


def ready(pod: dict[str, Any], ip: str) -> bool:
    """The rendered readiness probe, done from the host as a kubelet would do it."""
    (c,) = pod["containers"]
    probe = c["readinessProbe"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    if "httpGet" in probe:
        port = ports.get(probe["httpGet"]["port"], probe["httpGet"]["port"])
        try:
            with urllib.request.urlopen(f"http://{ip}:{port}{probe['httpGet']['path']}", timeout=5) as r:
                return bool(r.status == 200)
        except urllib.error.HTTPError:  # /readyz answers 503 until the learner has joined
            return False
    port = ports.get(probe["tcpSocket"]["port"], probe["tcpSocket"]["port"])
    with socket.create_connection((ip, port), timeout=5):
        return True


def root_is_read_only(container: str) -> bool:
    probe = "import os; print(os.statvfs('/').f_flag & os.ST_RDONLY)"
    return podman("exec", container, "python", "-c", probe).stdout.strip() == "1"


@pytest.fixture
def job(images: None, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The job's host-side pieces (network, config, token, checkpoint folder); removes every
    container and the network it created, whatever the test did."""
    suffix = secrets.token_hex(3)
    network = f"diloco-images-{suffix}"
    config_dir, token_dir, checkpoints = tmp_path / "config", tmp_path / "token", tmp_path / "checkpoints"
    for d in (config_dir, token_dir, checkpoints):
        d.mkdir()
    token = secrets.token_hex(16)
    parsed = parse_job(manifest())
    children = render.children(parsed, render.Owner(NAME, NAMESPACE, "uid-images"), token, started=True,
                               finished=False)
    by_kind = {(o["kind"], o["metadata"]["name"]): o for o in children}
    (config_dir / "job.yaml").write_text(by_kind[("ConfigMap", f"{NAME}-config")]["data"]["job.yaml"])
    (token_dir / "token").write_text(token)
    # What a Secret volume and fsGroup give the pod: root-owned files its group may read, and a
    # checkpoint volume the group may write.
    for path, mode in ((token_dir, 0o750), (token_dir / "token", 0o440), (config_dir, 0o755),
                       (config_dir / "job.yaml", 0o444), (checkpoints, 0o2770)):
        os.chown(path, 0, 10001)
        path.chmod(mode)
    tmp_path.chmod(0o755)
    podman("network", "create", network)
    made: list[str] = []
    try:
        yield {"suffix": suffix, "network": network, "token": token, "checkpoints": checkpoints, "made": made,
               "volumes": {"config": str(config_dir), "tmp": "tmpfs", "checkpoints": str(checkpoints),
                           "token": str(token_dir), "compilation-cache": "tmpfs"},  # the learners' default emptyDir
               "syncer": by_kind[("Deployment", f"{NAME}-syncer")]["spec"]["template"]["spec"],
               "learners": by_kind[("StatefulSet", f"{NAME}-local")]["spec"]["template"]["spec"]}
    finally:
        for name in made:
            podman("rm", "--force", "--time", "0", name, check=False)
        podman("network", "rm", "--force", network, check=False)


def test_a_syncer_and_two_learners_train_in_their_images(job: dict[str, Any]) -> None:
    t0 = time.monotonic()
    args = job["learners"]["containers"][0]["args"]
    service = args[args.index("--syncer") + 1].rsplit(":", 1)[0]  # the Service: images-syncer.default.svc
    syncer = f"syncer-{job['suffix']}"
    job["made"].append(syncer)
    podman(*run_args(job["syncer"], syncer, f"{NAME}-syncer-5d8f7c9b6-x2x7q", job["network"], job["volumes"],
                     aliases=(service,)))
    ip = address(syncer, job["network"])
    channel = grpc.insecure_channel(f"{ip}:{SYNCER_GRPC_PORT}", options=GRPC_OPTIONS)
    stub = rpc.SyncerStub(channel)

    def status() -> Any:
        try:
            return stub.Status(pb.StatusRequest(), metadata=auth_metadata(job["token"]), timeout=2)
        except grpc.RpcError:
            assert state(syncer)["Running"], podman("logs", syncer).stderr[-3000:]
            return None

    wait_for(status, timeout=90, period=0.5, what="the syncer container to answer Status")
    learners = [f"learner-{i}-{job['suffix']}" for i in range(2)]
    for i, name in enumerate(learners):
        job["made"].append(name)
        podman(*run_args(job["learners"], name, f"{NAME}-local-{i}", job["network"], job["volumes"],
                         labels={"apps.kubernetes.io/pod-index": str(i)}))
    t_start = time.monotonic()

    def joined(name: str) -> dict[str, Any]:
        """Its `joined` event, once there ({} until then); fails at once if it exited first."""
        evs = events(name)
        assert state(name)["Running"] or evs, podman("logs", name).stderr[-3000:]
        return next((e for e in evs if e["event"] == "joined"), {})

    def finished(name: str) -> bool:
        return not state(name)["Running"]

    firsts = [wait_for(partial(joined, n), timeout=120, period=0.5, what=f"{n} to join") for n in learners]
    for name, pod in ((syncer, job["syncer"]), *((n, job["learners"]) for n in learners)):
        # While they run: the user the pod asks for, a read-only root, ready by the pod's own probe.
        assert process_uids(name) == {"10001"}, name
        assert root_is_read_only(name), name
        assert ready(pod, address(name, job["network"])), name
    assert sorted(e["learner"] for e in firsts) == ["local-0", "local-1"]

    for name in learners:
        wait_for(partial(finished, name), timeout=240, period=1.0, what=f"{name} to finish {STEPS} steps")
    t_trained = time.monotonic()
    final = status()
    assert final is not None
    podman("stop", "--time", str(job["syncer"]["terminationGracePeriodSeconds"]), syncer, timeout=90)
    channel.close()

    initial = max(f["eval_loss"] for f in firsts)  # Θ₀'s: random weights, about 6.2 nats/byte
    for name in learners:
        evs = events(name)
        assert state(name)["ExitCode"] == 0, podman("logs", name).stderr[-3000:]
        exit_event = evs[-1]
        assert exit_event["event"] == "exit" and exit_event["reason"] == "finished", exit_event
        assert exit_event["slot"] >= STEPS and exit_event["flushed"], exit_event  # steps: slots of the shared schedule
        evals = [e["eval_loss"] for e in evs if e["event"] == "eval"]
        # Both end on the shared model (a learner that joined late, or was starved of CPU and
        # skipped slots, took fewer steps itself): each ends far below where the job started.
        assert evals and evals[-1] < initial - 1.0, (initial, evals, exit_event)
        assert any(e["event"] == "progress" and e["bytes_sent"] > 0 for e in evs)
    assert final.tokens_merged > 0 and sum(final.versions) > 0, final
    seen = {ls.learner: ls for ls in final.learners}
    assert set(seen) == {"local-0", "local-1"} and all(ls.contributions > 0 for ls in seen.values()), final.learners

    assert state(syncer)["ExitCode"] == 0, podman("logs", syncer).stderr[-3000:]
    ckpt = job["checkpoints"]
    files = sorted(ckpt.iterdir())
    assert files and all(f.stat().st_uid == 10001 for f in files), [(f.name, f.stat().st_uid) for f in files]
    loaded, problems = CheckpointStore(ckpt).load_latest()
    assert loaded is not None and not problems, problems
    assert int(loaded.meta["tokens_merged"]) >= final.tokens_merged and int(loaded.meta["outer_steps"]) > 0, loaded.meta
    print(f"\nimages test: syncer up and learners started {t_start - t0:.1f} s, trained {STEPS} slots in "
          f"{t_trained - t_start:.1f} s, total {time.monotonic() - t0:.1f} s; tokens merged {final.tokens_merged}, "
          f"versions {sum(final.versions)}, eval loss {[round(f['eval_loss'], 2) for f in firsts]} -> "
          f"{[round([e for e in events(n) if e['event'] == 'eval'][-1]['eval_loss'], 2) for n in learners]}; "
          f"own steps {[events(n)[-1]['step'] for n in learners]}; checkpoint {loaded.path.name}")


def test_the_syncer_image_has_no_jax_and_the_learner_image_has_it(images: None) -> None:
    """The syncer image is the base install (no `learner` extra): smaller, and no model code."""
    probe = "import importlib.util as u; print(u.find_spec('jax') is not None)"
    for image, has_jax in ((SYNCER_IMAGE, "False"), (LEARNER_IMAGE, "True")):
        done = podman("run", "--rm", "--network", "none", "--entrypoint", "python", image, "-c", probe)
        assert done.stdout.strip() == has_jax, (image, done.stdout, done.stderr[-2000:])
    refused = podman("run", "--rm", "--network", "none", "--entrypoint", "diloco", SYNCER_IMAGE, "learner", "--config",
                     "/tmp/job.yaml", "--group", "a", "--index", "0", "--syncer", "x:1", check=False)
    assert refused.returncode == Exit.CONFIG and "decoupled-diloco[learner]" in refused.stderr, refused.stderr[-2000:]
