"""Θ₀, the initial parameters every learner starts from, kept beside JAX's compilation cache.

A restarted learner needs Θ₀ before it joins: the syncer checks every learner's Θ₀ hash, and
an unseeded syncer is seeded from it. Computing it means tracing the model's init and running
it, about a third of a restart's CPU on a small model (docs/OPERATIONS.md, startup badput);
reading it back from the file the job's first process left costs milliseconds. The file is
named by everything Θ₀ depends on (the model spec, the seed, the JAX and Flax versions, the
built-in model code), carries a SHA-256 of its arrays, and is written atomically, so a torn,
stale or foreign file is never used: it is recomputed instead. A user's own module
(`spec.model.module`) is always recomputed, since its code can change without its spec changing.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import jax
import numpy as np

from diloco.spec import TransformerModel
from diloco.trainer import model
from diloco.trainer.caches import cache_file
from diloco.trainer.caches.step_cache import flax_version, unimported

MAX_CACHED_BYTES = 256 << 20  # larger models are not copied into the cache directory (their init is not the cost)


def initial_params(cfg: TransformerModel, seed: int, cache_dir: str | os.PathLike[str] | None) -> dict[str, np.ndarray]:
    """Θ₀ as host arrays: a pretrained model's weights (spec.model.pretrained), else from
    `cache_dir` when a process of this job left it there, else computed (and left there when
    `cache_dir` is given). HFError (a ValueError) when pretrained weights do not fit."""
    if cfg.pretrained is not None:
        from diloco.trainer.models import pretrained  # read, not computed: nothing to cache

        return pretrained.initial_params(cfg)
    if cache_dir is None or cfg.module is not None:
        return _compute(cfg, seed)
    path = Path(cache_dir) / f"theta0-{_key(cfg, seed)}.npz"
    theta0 = cache_file.read(path, "Θ₀")
    if theta0 is None:
        theta0 = _compute(cfg, seed)
        if sum(v.nbytes for v in theta0.values()) <= MAX_CACHED_BYTES:
            cache_file.write(path, theta0, "Θ₀")
    return theta0


def _compute(cfg: TransformerModel, seed: int) -> dict[str, np.ndarray]:
    return {n: np.asarray(v) for n, v in model.init_params(cfg, seed).items()}


def _key(cfg: TransformerModel, seed: int) -> str:
    what = {"model": cfg.model_dump(mode="json"), "seed": seed, "jax": jax.__version__, "flax": flax_version(),
            "code": _code_digest()}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


def _code_digest() -> str:
    """The built-in families' source: an edited init is another Θ₀ (caches are shared across
    runs by the benches and the test suite)."""
    gpt, llama = unimported("diloco.trainer.models.gpt", "diloco.trainer.models.llama")  # not imported: they import Flax
    return cache_file.source_digest(model, gpt, llama)
