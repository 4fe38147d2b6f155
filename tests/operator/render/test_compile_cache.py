"""The compilation cache every learner pod gets (spec.training.compilationCache), and that what
the operator renders is what JAX and the learner then use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from diloco.contract import STEP_CACHE_ENV
from diloco.operator.render import compile_cache
from diloco.operator.render import job as render
from diloco.spec import DecoupledDiLoCoJob, parse_job
from tests.helpers import TINY_MODEL

OWNER = render.Owner("demo", "research", "uid-1")
TOKEN = "t" * 43


def job(training: dict[str, Any] | None = None) -> DecoupledDiLoCoJob:
    groups = [{"name": "us", "region": "us-central1", "replicas": 2},
              {"name": "tpu", "region": "us-east5", "replicas": 1, "hostsPerLearner": 2}]
    return parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "demo"},
                      "spec": {"learnerGroups": groups, "model": TINY_MODEL, "training": training or {}}})


def pod_specs(j: DecoupledDiLoCoJob) -> dict[str, dict[str, Any]]:
    """Every pod template the running job's children carry, by the child's kind/name."""
    out = {}
    for obj in render.children(j, OWNER, TOKEN, started=True, finished=False):
        template = obj.get("spec", {}).get("template")
        if template:
            out[f"{obj['kind']}/{obj['metadata']['name']}"] = template["spec"]
    return out


def cache_of(pod: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any] | None, dict[str, str]]:
    volume = next((v for v in pod["volumes"] if v["name"] == compile_cache.VOLUME), None)
    container = pod["containers"][0]
    mount = next((m for m in container["volumeMounts"] if m["name"] == compile_cache.VOLUME), None)
    return volume, mount, {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def test_every_learner_pod_has_a_cache_volume_and_the_variables_and_the_syncer_none() -> None:
    pods = pod_specs(job())
    learners = {k: v for k, v in pods.items() if "syncer" not in k}
    assert len(learners) == 2, pods.keys()  # the one-host group's StatefulSet and the two-host gang's
    for name, pod in learners.items():
        volume, mount, env = cache_of(pod)
        assert volume == {"name": "compilation-cache", "emptyDir": {}}, name
        assert mount == {"name": "compilation-cache", "mountPath": "/var/cache/diloco"}, name
        assert env["JAX_COMPILATION_CACHE_DIR"] == "/var/cache/diloco/jax", name
        assert env[STEP_CACHE_ENV] == "/var/cache/diloco/steps", name
        assert env["NUMBA_CACHE_DIR"] == "/var/cache/diloco/numba", name  # the image's install is read-only
        assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0", name
    for name, pod in pods.items():
        if "syncer" in name:  # the syncer runs no JAX
            assert cache_of(pod)[0] is None and "JAX_COMPILATION_CACHE_DIR" not in cache_of(pod)[2], name


def test_a_shared_claim_backs_every_learners_cache() -> None:
    for name, pod in pod_specs(job({"compilationCache": {"persistentVolumeClaim": "jax-cache"}})).items():
        if "syncer" not in name:
            volume, _, env = cache_of(pod)
            assert volume == {"name": "compilation-cache", "persistentVolumeClaim": {"claimName": "jax-cache"}}
            assert env["JAX_COMPILATION_CACHE_DIR"] == "/var/cache/diloco/jax"


@pytest.mark.slow
def test_an_object_store_url_reaches_jaxs_configuration() -> None:
    """The learner container's variables, as the kubelet would set them, in a fresh interpreter:
    JAX's configuration holds the bucket, and the learner keeps its local files in the volume."""
    url = "gs://fleet-cache/jax"
    pod = next(p for k, p in pod_specs(job({"compilationCache": {"url": url}})).items() if "syncer" not in k)
    volume, _, env = cache_of(pod)
    assert volume == {"name": "compilation-cache", "emptyDir": {}}  # the lowered step stays local
    assert env["JAX_COMPILATION_CACHE_DIR"] == url
    probe = ("import json, jax; from diloco.trainer.caches import compile_cache as c; "
             "print(json.dumps([jax.config.jax_compilation_cache_dir, c.files_dir()]))")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "DILOCO_"))}
    done = subprocess.run([sys.executable, "-P", "-c", probe], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120, check=True)
    assert json.loads(done.stdout.splitlines()[-1]) == [url, "/var/cache/diloco/steps"]


@pytest.mark.parametrize("bad, field", [
    ({"url": "/mnt/cache"}, "compilationCache.url"),
    ({"url": "gs://a", "persistentVolumeClaim": "b"}, "not both"),
    ({"persistentVolumeClaim": "Not_A_Name"}, "persistentVolumeClaim"),
])
def test_a_bad_cache_is_refused_naming_the_field(bad: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        job({"compilationCache": bad})


@pytest.mark.slow
def test_a_second_start_reads_what_the_first_compiled(tmp_path: Any) -> None:
    """What the learner's joined line reports: misses on a cold start, only hits on the next."""
    program = ("import json, jax, jax.numpy as jnp; from diloco.trainer.caches import compile_cache as c; c.watch(); "
               "jax.jit(lambda x: jnp.tanh(x @ x.T).sum())(jnp.ones((8, 8))).block_until_ready(); "
               "print(json.dumps(c.tally()))")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("JAX_")},
           "JAX_COMPILATION_CACHE_DIR": str(tmp_path), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}

    def start() -> dict[str, int]:
        done = subprocess.run([sys.executable, "-P", "-c", program], env=env, capture_output=True, text=True,
                              timeout=120, check=True)
        return dict(json.loads(done.stdout.splitlines()[-1]))

    cold, warm = start(), start()
    assert cold["misses"] > 0 and cold["hits"] == 0, cold
    assert warm == {"hits": cold["misses"], "misses": 0}, (cold, warm)
