"""Pure: the compilation cache every learner pod mounts (`spec.training.compilationCache`).

A learner that starts without its compiled programs traces and compiles its train step again:
seconds on the quickstart model, minutes for a real model on an accelerator, at every
re-admission. So every learner pod gets a cache: JAX's persistent compilation cache
(`JAX_COMPILATION_CACHE_DIR`, which JAX reads at import) and, beside it, the learner's own Θ₀
and lowered train step (`$DILOCO_STEP_CACHE_DIR`, trainer/caches/step_cache.py), and the codec
kernels numba compiles (`NUMBA_CACHE_DIR`). Left unset, an
`emptyDir`: it outlives a container restart in the pod (a crash, a liveness kill), not the
pod. A `persistentVolumeClaim` shared by the job's learners outlives the pod as well; an
object-store `url` holds JAX's cache in the bucket (the lowered step stays in the pod's
`emptyDir`: it is a local file). Programs are keyed by what they compile, so learners of
one job (and jobs of one model) share entries safely. The operator reads none of it.
"""

from __future__ import annotations

from typing import Any

from diloco.contract import CACHE_EVERY_PROGRAM, STEP_CACHE_ENV
from diloco.spec import JobSpec

VOLUME = "compilation-cache"
MOUNT = "/var/cache/diloco"  # a writable mount under the read-only root filesystem


def variables(spec: JobSpec, mount: str = MOUNT) -> dict[str, str]:
    """What points JAX, the learner and numba (the codec kernels, diloco/core/kernels.py, which
    the image's read-only install cannot cache beside itself) at the cache mounted at `mount`."""
    cache = spec.training.compilation_cache
    return {"JAX_COMPILATION_CACHE_DIR": cache.url if cache and cache.url else f"{mount}/jax",
            STEP_CACHE_ENV: f"{mount}/steps", "NUMBA_CACHE_DIR": f"{mount}/numba", **CACHE_EVERY_PROGRAM}


def parts(spec: JobSpec) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, str]]]:
    """The learner pod's cache volume, its container mount and the variables that point at it."""
    cache = spec.training.compilation_cache
    claim = cache.persistent_volume_claim if cache else None
    source: dict[str, Any] = {"persistentVolumeClaim": {"claimName": claim}} if claim else {"emptyDir": {}}
    env = [{"name": k, "value": v} for k, v in variables(spec).items()]
    return {"name": VOLUME, **source}, {"name": VOLUME, "mountPath": MOUNT}, env
