"""Side-by-side timing helpers: benchmarks report ratios measured in one run."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_seconds(fn: Callable[[], object], repeats: int = 7, min_seconds: float = 0.05) -> float:
    """Best-of-`repeats` time per call; each repeat loops until it lasts `min_seconds`."""
    best = float("inf")
    for _ in range(repeats):
        n, start = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                break
        best = min(best, elapsed / n)
    return best
