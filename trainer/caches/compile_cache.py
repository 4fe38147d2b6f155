"""The learner's compiled programs across restarts: where they are kept and whether this start
found them.

JAX's persistent compilation cache (`JAX_COMPILATION_CACHE_DIR`: a folder or an object-store
URL) holds the compiled programs; Θ₀ (trainer/caches/theta0.py) and the lowered train step
(trainer/caches/step_cache.py) are local files, kept in `$DILOCO_STEP_CACHE_DIR` (the operator's cache
volume, operator/render/compile_cache.py) or beside a local JAX cache (`diloco run`). `watch()` counts
JAX's own cache events from here on, so the `joined` line says whether the start compiled
(misses) or read what an earlier start left (hits): the check that a re-admission is cheap.
"""

from __future__ import annotations

import os
from collections import Counter

from diloco.contract import STEP_CACHE_ENV

# JAX's monitoring events (jax/_src/compiler.py, compilation_cache.py): one per program looked up.
EVENTS = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}
_seen: Counter[str] = Counter()
_watching = False


def files_dir() -> str | None:
    """The local folder for Θ₀ and the lowered step, or None (nothing is kept: a cold start each time)."""
    import jax

    explicit = os.environ.get(STEP_CACHE_ENV)
    if explicit:
        return explicit
    jax_dir = getattr(jax.config, "jax_compilation_cache_dir", None)
    return jax_dir if jax_dir and "://" not in jax_dir else None


def _count(event: str, **_: object) -> None:
    if event in EVENTS:
        _seen[EVENTS[event]] += 1


def watch() -> None:
    """Count JAX's compilation-cache hits and misses from now on (once per process)."""
    global _watching
    if not _watching:
        import jax

        jax.monitoring.register_event_listener(_count)
        _watching = True


def tally() -> dict[str, int]:
    """Programs this process found in the cache and programs it compiled and stored, so far."""
    return {"hits": _seen["hits"], "misses": _seen["misses"]}
