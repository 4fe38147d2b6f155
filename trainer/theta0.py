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
import logging
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import flax
import jax
import numpy as np

from diloco.spec import TransformerModel
from diloco.trainer import model

log = logging.getLogger("diloco.learner")
MAX_CACHED_BYTES = 256 << 20  # larger models are not copied into the cache directory (their init is not the cost)
DIGEST = "__sha256__"


def initial_params(cfg: TransformerModel, seed: int, cache_dir: str | os.PathLike[str] | None) -> dict[str, np.ndarray]:
    """Θ₀ as host arrays, from `cache_dir` when a process of this job left it there, else
    computed (and left there when `cache_dir` is given)."""
    if cache_dir is None or cfg.module is not None:
        return _compute(cfg, seed)
    path = Path(cache_dir) / f"theta0-{_key(cfg, seed)}.npz"
    theta0 = _read(path)
    if theta0 is None:
        theta0 = _compute(cfg, seed)
        if sum(v.nbytes for v in theta0.values()) <= MAX_CACHED_BYTES:
            _write(path, theta0)
    return theta0


def _compute(cfg: TransformerModel, seed: int) -> dict[str, np.ndarray]:
    return {n: np.asarray(v) for n, v in model.init_params(cfg, seed).items()}


def _key(cfg: TransformerModel, seed: int) -> str:
    what = {"model": cfg.model_dump(mode="json"), "seed": seed, "jax": jax.__version__, "flax": flax.__version__,
            "code": _code_digest()}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


def _code_digest() -> str:
    """The built-in families' source: an edited init is another Θ₀ (caches are shared across
    runs by the benches and the test suite)."""
    from diloco.trainer import gpt, llama

    h = hashlib.sha256()
    for module in (model, gpt, llama):
        h.update(Path(str(module.__file__)).read_bytes())
    return h.hexdigest()


def _digest(arrays: dict[str, np.ndarray]) -> bytes:
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.data)
    return h.digest()


def _read(path: Path) -> dict[str, np.ndarray] | None:
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {n: f[n] for n in f.files}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:  # torn or foreign: recompute
        log.warning("ignoring the cached Θ₀ at %s (%s); computing it", path, exc)
        return None
    stored = arrays.pop(DIGEST, None)
    if stored is None or stored.tobytes() != _digest(arrays):
        log.warning("ignoring the cached Θ₀ at %s: its checksum does not match; computing it", path)
        return None
    return arrays


def _write(path: Path, theta0: dict[str, np.ndarray]) -> None:
    """Atomically, and never fatally: a learner that cannot write the cache still trains."""
    if any(v.dtype.kind != "f" or v.dtype.itemsize not in (4, 8) for v in theta0.values()):
        return  # np.load without pickles reads standard dtypes only
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".theta0-", suffix=".npz")
        try:
            with os.fdopen(fd, "wb") as f:
                entries: dict[str, Any] = {**theta0, DIGEST: np.frombuffer(_digest(theta0), np.uint8)}
                np.savez(f, **entries)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        log.warning("could not cache Θ₀ at %s (%s); restarts will compute it", path, exc)
