"""Side-by-side timing helpers: benchmarks report ratios measured in one run."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping


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


def side_by_side(fns: Mapping[str, Callable[[], object]], repeats: int = 7, min_seconds: float = 0.05) -> dict[str, float]:
    """Best time per call of each of `fns`, their repeats taken in turn (a, b, c, a, b, c, ...),
    so a slow minute of this shared machine weighs on the memcpy and the kernel it is compared
    with alike, instead of on whichever happened to run then."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            best[name] = min(best[name], best_seconds(fn, repeats=1, min_seconds=min_seconds))
    return best
