"""The train step's and the eval's compiled executables, kept beside JAX's compilation cache.

A restarted learner's first step would trace the model, its gradient and AdamW in Python, lower
them to StableHLO, hash the module for the persistent compilation cache and load the executable
from it. The first process of a job compiles each program once and serialises the executable
(`jax.experimental.serialize_executable`); a restart loads it back and runs it, with no trace,
lowering or cache lookup: the same program, so the same bits. On the quickstart model that cut a
restart's load of the step from 0.25 s of CPU to 0.1 s (docs/BENCHMARKS.md §6, "A learner's
restart"); the trace alone grows with the model's depth.

The file is named by everything the executable depends on (the model and training spec, the
arguments' shapes, dtypes and shardings, the JAX, jaxlib, optax and Flax versions, the learner's
model and recipe code, the machine: the backend's platform and version, the device kind and the
CPU's instruction set, which XLA:CPU compiles for, and XLA's flags), carries a SHA-256 and is written
atomically (trainer/cache_file.py). A file that fails its checksum, does not load, or takes other
arguments is ignored and the program compiled again. Like JAX's own compilation cache, the
directory must be writable by the job alone: an executable is code. A user's own module
(`spec.model.module`) and a mesh over several processes are never cached: that code can change
without its spec changing, and an executable sharded over processes is not serialised here.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax
import jax
import jaxlib
import numpy as np
import optax
from jax.experimental import serialize_executable

from diloco.trainer import cache_file

log = logging.getLogger("diloco.learner")
MAX_CACHED_BYTES = 256 << 20  # a serialised executable; far larger means something is off


@functools.cache
def _code() -> str:
    """The learner's model and recipe code, read once per process (the step and the eval both ask)."""
    from diloco.trainer import gpt, llama, model, recipe, sharding

    return cache_file.source_digest(model, gpt, llama, recipe, sharding)


@functools.cache
def _machine() -> list[str]:
    """What an executable is compiled for: the backend, its device kind, and the CPU's features
    (XLA:CPU emits code for the host's instruction set; a cache on a volume shared by two kinds
    of node must not hand one the other's code)."""
    device = jax.devices()[0]
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            flags = next((line for line in fh if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return [device.platform, device.client.platform_version, device.device_kind, platform.machine(),
            hashlib.sha256(flags.encode()).hexdigest()[:16],
            *(os.environ.get(v, "") for v in ("XLA_FLAGS", "LIBTPU_INIT_ARGS"))]  # what XLA compiled with


def _key(spec: dict[str, Any], specs: list[jax.ShapeDtypeStruct], tree: Any) -> str:
    what = {"spec": spec, "args": [f"{s.shape}|{s.dtype}|{s.sharding}" for s in specs], "tree": str(tree),
            "versions": [jax.__version__, jaxlib.__version__, optax.__version__, flax.__version__],
            "code": _code(), "machine": _machine()}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _compile(jitted: Any, example: tuple[Any, ...]) -> Any:
    """Trace, lower and compile (the persistent compilation cache may answer the last)."""
    return jitted.lower(*example).compile()


def cached(name: str, fn: Callable[..., Any], example: tuple[Any, ...], shardings: tuple[Any, ...],
           out_shardings: Any, out_like: Any, spec: dict[str, Any], cache_dir: str | os.PathLike[str]) -> Any:
    """`fn` jitted with `shardings` and `out_shardings` and compiled for `example`, loaded
    from `cache_dir` as `name` when a valid executable is there, else compiled and kept there.
    `example`: abstract arguments (ShapeDtypeStruct trees); `out_like`: any tree shaped like
    fn's result (so its structure is known without tracing fn); `spec`: the model and training
    settings as plain data, part of the file's name. Call the result with arguments of exactly
    the example's dtypes (a Python float is not an fp32 scalar to an executable)."""
    leaves, in_tree = jax.tree_util.tree_flatten(example)
    # `shardings` is a prefix of `example` (one sharding may stand for a whole subtree): one per leaf.
    per_leaf = jax.tree_util.tree_map(lambda s, sub: jax.tree_util.tree_map(lambda _: s, sub), shardings, example,
                                      is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    flat_shardings = jax.tree_util.tree_leaves(per_leaf, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(leaves, flat_shardings, strict=True)]
    path = Path(cache_dir) / f"{name}-{_key({'fn': name, **spec}, specs, in_tree)}.npz"
    args_tree = jax.tree_util.tree_structure((example, {}))  # how a Compiled holds its arguments
    out_tree = jax.tree_util.tree_structure(out_like)

    compiled = _load(path, name, args_tree, out_tree, specs)
    if compiled is None:
        compiled = _compile(jax.jit(fn, in_shardings=shardings, out_shardings=out_shardings), example)
        _keep(path, name, compiled, args_tree)
    return compiled


def _keep(path: Path, name: str, compiled: Any, args_tree: Any) -> None:
    try:
        payload, in_tree, _ = serialize_executable.serialize(compiled)
    except (ValueError, NotImplementedError) as exc:  # a program XLA cannot serialise: compile at every start
        log.info("the %s program is not cached (%s)", name, exc)
        return
    if in_tree == args_tree and len(payload) <= MAX_CACHED_BYTES:
        cache_file.write(path, {"executable": np.frombuffer(payload, np.uint8)}, f"{name} program")


def _load(path: Path, name: str, args_tree: Any, out_tree: Any, specs: list[jax.ShapeDtypeStruct]) -> Any:
    stored = cache_file.read(path, f"{name} program")
    if stored is None or "executable" not in stored:
        return None
    try:
        compiled = serialize_executable.deserialize_and_load(stored["executable"].tobytes(), args_tree, out_tree)
    except Exception as exc:  # checksummed, so written whole: another build's or another machine's
        log.warning("ignoring the cached %s program at %s (%s); compiling it", name, path, exc)
        return None
    takes = [(tuple(a.shape), a.dtype) for a in jax.tree_util.tree_leaves(compiled.args_info)]
    if takes != [(s.shape, s.dtype) for s in specs]:
        log.warning("ignoring the cached %s program at %s: it is another model's; compiling it", name, path)
        return None
    return compiled
