"""The slim lane: the syncer image's install, exactly (`pip install '.[cloud]'`, no `learner` extra: no JAX, no
flax), built by `make test` as `.venv-slim`, runs every command that image runs.

Every other operator test runs the operator in-process in the dev venv, which has JAX: an import
of the trainer on the operator's path passes there and fails every job in the image (it did:
sizing the checkpoint volume imported the model). Here each command runs as a process of the
slim venv's own interpreter, from a folder outside the source tree, against the real control
plane where it needs a cluster. pyproject.toml's import-linter contract reads the same rule from the source."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from diloco.contract import TOKEN_ENV
from diloco.operator.kube import Kube
from diloco.operator.render import job as render
from diloco.operator.render import naming as n
from diloco.spec import load_job
from tests.helpers import wait_for
from tests.realapi.controlplane import ROOT, ControlPlane, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]
SLIM = ROOT / ".venv-slim"
CLUSTER_EXAMPLES = sorted([*ROOT.glob("examples/k8s-*.yaml"), *ROOT.glob("examples/multicluster-*.yaml")])
TOKEN = "slim-lane-token-0123456789abcdef"


@pytest.fixture(scope="module")
def slim() -> Path:
    python = SLIM / "bin" / "python"
    assert python.exists(), f"{SLIM} is missing: `make .venv-slim/.installed` builds it (`make test` does)"
    return python


def run_slim(python: Path, *argv: str, cwd: Path, env: dict[str, str] | None = None,
             timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), "-P", *argv], capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env={**os.environ, **(env or {})})


def diloco(python: Path, *argv: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_slim(python, "-m", "diloco.apps.cli", *argv, cwd=cwd, env=env)


def test_the_slim_venv_is_the_image_install(slim: Path, tmp_path: Path) -> None:
    """No learner extra in it, and the package is a copy in its site-packages, not this tree."""
    done = run_slim(slim, "-c", "import importlib.util as u, diloco; "
                    "print(diloco.__file__); print([m for m in ('jax', 'flax', 'optax') if u.find_spec(m)])",
                    cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    where, found = done.stdout.splitlines()
    assert where.startswith(str(SLIM)) and found == "[]", done.stdout


def rendered_children(python: Path, examples: list[Path], cwd: Path) -> dict[str, Any]:
    program = (
        "import json, sys\n"
        "from diloco.operator.reconcile import passes\n"
        "from diloco.operator.render import job as render\n"
        "from diloco.spec import load_job\n"
        "out = {}\n"
        "for path in sys.argv[1:]:\n"
        "    job, problems = passes.load({'apiVersion': 'diloco.dev/v1alpha1', 'kind': 'DecoupledDiLoCoJob',\n"
        "        **__import__('yaml').safe_load(open(path))})\n"
        "    assert job is not None, problems\n"
        "    owner = render.Owner(job.metadata.name, 'research', 'uid-slim')\n"
        "    out[path] = render.children(job, owner, 't' * 43, started=True, finished=False)\n"
        "print(json.dumps(out, sort_keys=True))\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('jax', 'flax')], 'imported JAX'\n")
    done = run_slim(python, "-c", program, *map(str, examples), cwd=cwd)
    assert done.returncode == 0, done.stderr
    rendered: dict[str, Any] = json.loads(done.stdout)
    return rendered


def test_every_cluster_example_renders_without_jax_as_it_does_with_it(slim: Path, tmp_path: Path) -> None:
    assert len(CLUSTER_EXAMPLES) >= 6, CLUSTER_EXAMPLES
    got = rendered_children(slim, CLUSTER_EXAMPLES, tmp_path)
    for path in CLUSTER_EXAMPLES:  # the dev venv, with JAX, renders the same children
        job = load_job(str(path))
        owner = render.Owner(job.metadata.name, "research", "uid-slim")
        want = render.children(job, owner, "t" * 43, started=True, finished=False)
        assert got[str(path)] == json.loads(json.dumps(want)), path.name
        claims = [c for c in want if c["kind"] == "PersistentVolumeClaim"]
        assert not claims or claims[0]["spec"]["resources"]["requests"]["storage"].endswith("Gi")


# What examples/continue-pretraining.yaml's model directory says of itself (SmolLM2-135M's
# config.json as its publisher wrote it): validate reads it, as a user's validate would.
SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
           "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 100000, "rope_scaling": None,
           "rope_interleaved": False, "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "bfloat16"}


def test_crd_and_validate_run_without_jax(slim: Path, tmp_path: Path) -> None:
    crd = diloco(slim, "crd", "--no-cel", cwd=tmp_path)
    assert crd.returncode == 0 and "kind: CustomResourceDefinition" in crd.stdout, crd.stderr
    for example in sorted(ROOT.glob("examples/*.yaml")):
        done = diloco(slim, "validate", str(example), cwd=tmp_path)
        assert done.returncode == 0 and "valid DecoupledDiLoCoJob" in done.stdout, (example.name, done.stderr)
    # A pretrained model's config.json is read without JAX (validate --inputs, as `diloco run` reads it).
    continued = ROOT / "examples" / "continue-pretraining.yaml"
    model = tmp_path / yaml.safe_load(continued.read_text())["spec"]["model"]["pretrained"]
    missing = diloco(slim, "validate", "--inputs", str(continued), cwd=tmp_path)
    assert missing.returncode == 2 and "spec.model.pretrained: no config.json in" in missing.stderr, missing.stderr
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(SMOLLM2))
    done = diloco(slim, "validate", "--inputs", str(continued), cwd=tmp_path)
    assert done.returncode == 0 and "valid DecoupledDiLoCoJob" in done.stdout, done.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text()),
                                   "spec": {"learnerGroups": [{"name": "a", "replicas": 1}], "syncer": {"quorum": 3}}}))
    refused = diloco(slim, "validate", str(bad), cwd=tmp_path)
    assert refused.returncode == 2 and "spec.syncer.quorum" in refused.stderr, refused.stderr


@pytest.fixture
def stopped_at_exit() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_a_syncer_serves_and_status_reads_it_without_jax(slim: Path, tmp_path: Path,
                                                         stopped_at_exit: list[subprocess.Popen[str]]) -> None:
    port = free_port()
    env = {**os.environ, TOKEN_ENV: TOKEN}
    syncer = subprocess.Popen([str(slim), "-P", "-m", "diloco.apps.cli", "syncer", "--config",
                               str(ROOT / "examples" / "quickstart.yaml"), "--port", str(port),
                               "--checkpoint-dir", str(tmp_path / "ckpt")],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stopped_at_exit.append(syncer)

    def answered() -> dict[str, Any] | None:
        assert syncer.poll() is None, syncer.communicate()[0]
        done = diloco(slim, "status", "--syncer", f"127.0.0.1:{port}", cwd=tmp_path, env={TOKEN_ENV: TOKEN})
        return json.loads(done.stdout) if done.returncode == 0 else None

    status = wait_for(answered, timeout=60, period=0.5, what="the slim syncer answering `diloco status`")
    assert status["unseeded"] is True and status["versions"] == ["0"] * 4, status  # waits for a learner's Θ₀
    wrong = diloco(slim, "status", "--syncer", f"127.0.0.1:{port}", cwd=tmp_path, env={TOKEN_ENV: "x" * 32})
    assert wrong.returncode == 1 and "UNAUTHENTICATED" in wrong.stderr, wrong.stderr


def admission_review(admin: Kube, port: int, manifest: dict[str, Any]) -> dict[str, Any]:
    """What the API server would ask the slim operator's webhook about `manifest` with a learner
    template that sets the image, over TLS checked as the API server checks it: against the CA
    in the Secret the operator made, for the Service's DNS name."""
    import base64

    import urllib3

    secret = admin.get("Secret", "slim", "slim-webhook-tls")
    assert secret is not None and secret["type"] == "kubernetes.io/tls", secret
    job = {**manifest, "spec": {**manifest["spec"], "learnerGroups": [
        {**manifest["spec"]["learnerGroups"][0],
         "template": {"spec": {"containers": [{"name": "learner", "image": "mine:1"}]}}}]}}
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "slim-1", "kind": {"group": "diloco.dev", "version": "v1alpha1", "kind": "DecoupledDiLoCoJob"},
        "resource": {"group": "diloco.dev", "version": "v1alpha1", "resource": "decoupleddilocojobs"},
        "operation": "CREATE", "namespace": "slim", "name": job["metadata"]["name"],
        "userInfo": {"username": "admin"}, "object": job, "dryRun": False}}
    pool = urllib3.HTTPSConnectionPool("127.0.0.1", port, cert_reqs="CERT_REQUIRED", retries=False,
                                       ca_cert_data=base64.b64decode(secret["data"]["ca.crt"]).decode(),
                                       server_hostname="slim-webhook.slim.svc", assert_hostname="slim-webhook.slim.svc")
    answer = pool.request("POST", "/validate", body=json.dumps(review).encode(),
                          headers={"Content-Type": "application/json"}, timeout=10)
    assert answer.status == 200, answer.data
    response: dict[str, Any] = json.loads(answer.data)["response"]
    assert response["uid"] == "slim-1"
    return response


@pytest.mark.realapi
def test_the_operator_from_the_slim_install_reconciles_a_job_on_a_real_api_server(
        slim: Path, tmp_path: Path, stopped_at_exit: list[subprocess.Popen[str]]) -> None:
    """`diloco crd --apply` and `diloco operator` from the slim venv, against a real 1.20 API
    server: the job's children are created (the checkpoint volume sized without the model's
    code) and its status is written. No pods run: what is proven is the operator's own process."""
    with ControlPlane(tmp_path / "control-plane") as plane:
        kubeconfig = plane.kubeconfig(tmp_path / "admin.kubeconfig", plane.admin_token)
        env = {"KUBECONFIG": str(kubeconfig), "KUBERNETES_SERVICE_HOST": ""}
        applied = diloco(slim, "crd", "--apply", "--no-cel", cwd=tmp_path, env=env)
        assert applied.returncode == 0, applied.stderr
        admin = Kube(plane.url, token=plane.admin_token, ca_file=str(plane.ca_file), user_agent="diloco-tests")
        admin.request("POST", "api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                    "metadata": {"name": "slim"}})
        # Its admission webhook too, with the certificate it makes (operator/admission/certificates.py: the
        # cryptography package must be in the base install); no webhook configuration to patch.
        webhook_env = {"DILOCO_WEBHOOK_PORT": str(free_port()), "DILOCO_WEBHOOK_ADDR": "127.0.0.1",
                       "DILOCO_WEBHOOK_CERT_DIR": str(tmp_path / "webhook"), "DILOCO_OPERATOR_NAMESPACE": "slim",
                       "DILOCO_WEBHOOK_SERVICE": "slim-webhook", "DILOCO_WEBHOOK_SECRET": "slim-webhook-tls"}
        operator = subprocess.Popen(
            [str(slim), "-P", "-m", "diloco.apps.cli", "operator", "--standalone", "--namespace", "slim"],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, **env, "DILOCO_OPERATOR_METRICS_PORT": str(free_port()),
                 "DILOCO_OPERATOR_HEALTH_PORT": str(free_port()), "DILOCO_STATUS_INTERVAL_SECONDS": "1",
                 **webhook_env})
        stopped_at_exit.append(operator)
        manifest = yaml.safe_load((ROOT / "examples" / "k8s-cpu-kind.yaml").read_text())
        manifest["metadata"]["namespace"] = "slim"
        wait_for(lambda: admin.request("GET", "apis/diloco.dev/v1alpha1/namespaces/slim/decoupleddilocojobs")
                 is not None, timeout=30, what="the CRD served")
        admin.request("POST", "apis/diloco.dev/v1alpha1/namespaces/slim/decoupleddilocojobs", manifest)
        name = manifest["metadata"]["name"]

        def reconciled() -> dict[str, Any] | None:
            assert operator.poll() is None, operator.communicate()[0]
            job = admin.get("DecoupledDiLoCoJob", "slim", name) or {}
            return job if (job.get("status") or {}).get("phase") else None

        job = wait_for(reconciled, timeout=90, period=0.5, what="the slim operator writing the job's status")
        assert job["status"]["phase"] in ("Created", "Running", "Pending"), job["status"]
        want = render.checkpoint_storage(load_job(str(ROOT / "examples" / "k8s-cpu-kind.yaml")).spec)
        claim = admin.get("PersistentVolumeClaim", "slim", n.checkpoints(name)) or {}
        assert claim.get("spec", {}).get("resources", {}).get("requests", {}).get("storage") == want, claim
        assert admin.get("StatefulSet", "slim", n.statefulset(name, "local")), "no learner StatefulSet"
        assert admin.get("Deployment", "slim", n.syncer(name)), "no syncer Deployment"
        time.sleep(2)  # a few more reconcile passes (the status timer) must not crash it either
        assert operator.poll() is None, operator.communicate()[0]
        refused = admission_review(admin, int(webhook_env["DILOCO_WEBHOOK_PORT"]), manifest)
        assert refused["allowed"] is False and refused["status"]["code"] == 422, refused
        assert refused["status"]["message"].startswith(
            "spec.learnerGroups[0].template.spec.containers[0].image: the operator's learner container's"), refused
