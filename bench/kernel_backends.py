"""Why the codec and merge loops are numba kernels: the same work in numpy, XLA and numba.

    python bench/kernel_backends.py [--mib 4]

int4 encode + decode of one tensor (block 64) and a 4-contribution weighted sum, each as a
ratio to a memcpy of the same input in the same run: numpy as the first release wrote it,
`jax.jit` on the CPU (XLA fuses the element-wise work; the block max is a reduction; inputs
already on the device, which favours it: the syncer's arrive as bytes), and the kernels in
`diloco/core/kernels.py`. Each is run once before timing (compilation is not measured).
Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import best_seconds

from diloco.core.codecs import decode, encode
from diloco.core.merge import weighted_average


def numpy_int4(x: np.ndarray) -> np.ndarray:
    """The first release's int4 round trip (pairs of values per byte, table decode)."""
    blocks = x.reshape(-1, 64)
    scale = (np.abs(blocks).max(axis=1) / np.float32(7)).astype(np.float32)
    inv = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale > 0)
    u = (blocks * inv[:, None] + np.float32(8.5)).astype(np.uint8).reshape(-1, 2)
    packed = (u[:, 1] << 4) | u[:, 0]
    pairs = np.stack([(packed & 15), (packed >> 4)], axis=1).astype(np.float32) - 8
    return (pairs.reshape(-1, 64) * scale[:, None]).reshape(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=4.0)
    args = parser.parse_args()
    import jax
    import jax.numpy as jnp

    n = int(args.mib * (1 << 20) / 4) // 64 * 64
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n).astype(np.float32)
    deltas = [rng.standard_normal(n).astype(np.float32) for _ in range(4)]
    weights = [1.0, 2.0, 0.5, 1.5]
    dst = np.empty_like(x)
    copy_s = best_seconds(lambda: np.copyto(dst, x))
    stack = np.concatenate(deltas)
    dst4 = np.empty_like(stack)
    copy4_s = best_seconds(lambda: np.copyto(dst4, stack))

    @jax.jit
    def xla_int4(v: jax.Array) -> jax.Array:
        blocks = v.reshape(-1, 64)
        scale = jnp.max(jnp.abs(blocks), axis=1) / 7
        inv = jnp.where(scale > 0, 1 / scale, 0)
        q = jnp.floor(blocks * inv[:, None] + 8.5).astype(jnp.uint8)
        packed = q[:, :32] | (q[:, 32:] << 4)
        lo, hi = (packed & 15).astype(jnp.float32) - 8, (packed >> 4).astype(jnp.float32) - 8
        return (jnp.concatenate([lo, hi], axis=1) * scale[:, None]).reshape(-1)

    @jax.jit
    def xla_sum(a: jax.Array, b: jax.Array, c: jax.Array, d: jax.Array) -> jax.Array:
        return (weights[0] * a + weights[1] * b + weights[2] * c + weights[3] * d) / sum(weights)

    xj, dj = jnp.asarray(x), [jnp.asarray(d) for d in deltas]
    rows = {
        "int4_numpy": copy_s / best_seconds(lambda: numpy_int4(x), repeats=5),
        "int4_xla": copy_s / best_seconds(lambda: xla_int4(xj).block_until_ready(), repeats=5),
        "int4_numba": copy_s / best_seconds(lambda: decode(encode(x, "int4"), out=dst), repeats=5),
        "sum4_numpy": copy4_s / best_seconds(lambda: sum(w * d for w, d in zip(weights, deltas)) / sum(weights), repeats=5),
        "sum4_xla": copy4_s / best_seconds(lambda: xla_sum(*dj).block_until_ready(), repeats=5),
        "sum4_numba": copy4_s / best_seconds(lambda: weighted_average(deltas, weights), repeats=5),
    }
    for name, ratio in rows.items():
        print(f"{name:12} {ratio:6.3f} of memcpy")
    print(json.dumps({"bench": "kernel_backends", "input_mib": args.mib, **rows}))


if __name__ == "__main__":
    main()
