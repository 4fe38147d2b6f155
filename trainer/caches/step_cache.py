"""The train step's and the eval's lowered programs, kept beside JAX's compilation cache (`jax.export`).

A restarted learner's first step traces the model, its gradient and AdamW in Python and lowers
them to StableHLO before the compile, which the persistent compilation cache answers: on the
quickstart model the trace and the lowering are 0.3 s of a restart's 1.3 s of CPU, and the
trace grows with the model's depth. The first process of a job exports the lowered step; a restart
reads it back and goes straight to the (cached) compile, with the same program, so the same
bits. The file is named by everything the program depends on (the model and training spec, the
arguments' shapes, dtypes and shardings, the JAX, jaxlib, optax and Flax versions, and the
learner's model and recipe code), carries a SHA-256 and is written atomically
(trainer/caches/cache_file.py). A user's own module (`spec.model.module`) and a mesh over several
processes are never cached: that code can change without its spec changing, and a program
sharded over processes is not exported here.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import optax

from diloco.trainer.caches import cache_file

log = logging.getLogger("diloco.learner")
MAX_CACHED_BYTES = 64 << 20  # a program's serialised StableHLO; far larger means something is off


def unimported(*names: str) -> list[Any]:
    """Modules as `cache_file.source_digest` takes them (their source file), found without
    importing them: the model families import Flax, which a warm start never needs (0.1-0.2 s)."""
    found = []
    for name in names:
        where = importlib.util.find_spec(name)
        if where is None or where.origin is None:
            raise ImportError(f"no module {name}")
        found.append(types.SimpleNamespace(__file__=where.origin))
    return found


@functools.cache
def flax_version() -> str:
    """`flax.__version__`, read from its version file: importing Flax to name a cache file costs a
    warm start 0.1-0.2 s, and `importlib.metadata` 0.03 s."""
    where = importlib.util.find_spec("flax")
    if where is None or not where.submodule_search_locations:
        raise ImportError("no module flax")
    text = (Path(next(iter(where.submodule_search_locations))) / "version.py").read_text()
    found = re.search(r"""__version__\s*=\s*['"]([^'"]+)['"]""", text)
    if found is None:  # another layout: the import is the truth
        import flax

        return str(flax.__version__)
    return found.group(1)


# The code that builds the cached programs: the model families and the recipe that jits their step.
# Read as files, never imported: the recipe imports this module, and the families import Flax.
CODE = ("diloco.trainer.model", "diloco.trainer.models.gpt", "diloco.trainer.models.llama", "diloco.trainer.recipe",
        "diloco.trainer.sharding")


@functools.cache
def _code() -> str:
    """The learner's model and recipe code, read once per process (the step and the eval both ask)."""
    return cache_file.source_digest(*unimported(*CODE))


def _key(spec: dict[str, Any], specs: list[jax.ShapeDtypeStruct], tree: Any) -> str:
    what = {"spec": spec, "args": [f"{s.shape}|{s.dtype}|{s.sharding}" for s in specs], "tree": str(tree),
            "versions": [jax.__version__, jaxlib.__version__, optax.__version__, flax_version()],
            "code": _code()}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:32]


def cached(name: str, fn: Callable[..., Any], example: tuple[Any, ...], *, shardings: tuple[Any, ...],
           out_shardings: Any, out_like: Any, spec: dict[str, Any], cache_dir: str | os.PathLike[str]) -> Any:
    """`fn` jitted with `shardings` and `out_shardings`, running the program exported to
    `cache_dir` as `name` (exporting it there first when no valid file exists). `example`:
    abstract arguments (ShapeDtypeStruct trees); `out_like`: any tree shaped like fn's result
    (so the result's structure is known without tracing fn); `spec`: the model and training
    settings as plain data, part of the file's name."""
    leaves, in_tree = jax.tree_util.tree_flatten(example)
    # `shardings` is a prefix of `example` (one sharding may stand for a whole subtree): one per leaf.
    per_leaf = jax.tree_util.tree_map(lambda s, sub: jax.tree_util.tree_map(lambda _: s, sub), shardings, example,
                                      is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    flat_shardings = jax.tree_util.tree_leaves(per_leaf, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(leaves, flat_shardings, strict=True)]
    out_tree = jax.tree_util.tree_structure(out_like)
    path = Path(cache_dir) / f"{name}-{_key({'fn': name, **spec}, specs, in_tree)}.npz"

    exported = _read(path, name)
    if exported is not None and [(a.shape, a.dtype) for a in exported.in_avals] != [(s.shape, s.dtype) for s in specs]:
        log.warning("ignoring the cached %s program at %s: it is another model's; tracing it", name, path)
        exported = None
    if exported is None:
        def flat(*xs: Any) -> tuple[Any, ...]:
            return tuple(jax.tree_util.tree_leaves(fn(*jax.tree_util.tree_unflatten(in_tree, xs))))

        exported = jax.export.export(jax.jit(flat))(*specs)
        blob = exported.serialize()
        if len(blob) <= MAX_CACHED_BYTES:
            cache_file.write(path, {"exported": np.frombuffer(blob, np.uint8)}, f"{name} program")

    def run(*args: Any) -> Any:
        xs = [jnp.asarray(x, s.dtype) for x, s in zip(jax.tree_util.tree_leaves(args), specs, strict=True)]
        return jax.tree_util.tree_unflatten(out_tree, exported.call(*xs))

    return jax.jit(run, in_shardings=shardings, out_shardings=out_shardings)


def _read(path: Path, name: str) -> Any:
    stored = cache_file.read(path, f"{name} program")
    if stored is None or "exported" not in stored:
        return None
    try:
        return jax.export.deserialize(bytearray(stored["exported"].tobytes()))
    except Exception as exc:  # a program this JAX cannot read (the key names the version, so: damage)
        log.warning("ignoring the cached %s program at %s (%s); tracing it", name, path, exc)
        return None
