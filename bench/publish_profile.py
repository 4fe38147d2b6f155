"""Where one publish of a large fragment spends its time, step by step, on one core.

    taskset -c 0 python bench/publish_profile.py [--params 1e9] [--fragments 24] [--learners 2]

The syncer's own calls on arrays of one fragment's size: admitting an int4 push, the RDA of a
round, the outer step, the fused broadcast pass (delta encode and view update) and the
provenance tag; and the round again into a fresh accumulator, side by side. Milliseconds,
best of 2 after a warm-up. Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import numpy as np

from diloco.core.codecs import encode_delta_tensors, encode_tensors
from diloco.core.merge import merge_updates
from diloco.core.outer import NesterovSGD
from diloco.syncer import provenance
from diloco.syncer.acceptance import outer_gradient


def ms(fn: Callable[[], object]) -> float:
    fn()
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return round(best * 1e3, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=1e9)
    parser.add_argument("--fragments", type=int, default=24)
    parser.add_argument("--learners", type=int, default=2, help="contributions in the round")
    args = parser.parse_args()
    n = int(args.params / args.fragments)
    shapes = {"a": (n // 2,), "b": (n - n // 2,)}
    rng = np.random.default_rng(0)
    theta = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    view = {k: v + np.float32(1e-3) for k, v in theta.items()}
    blob = encode_tensors({k: np.float32(1e-3) * v for k, v in theta.items()}, "int4")
    packed, _ = outer_gradient(blob, 0, shapes)
    merged = merge_updates([packed], [1.0], "rda")
    grads, factors = {n: u.values for n, u in merged.items()}, {n: u.factor for n, u in merged.items()}
    lent = {k: np.empty(s, np.float32) for k, s in shapes.items()}  # the accumulator the syncer lends each round
    k = args.learners
    rows = {
        "admit_push": ms(lambda: outer_gradient(blob, 0, shapes)),
        "rda_round": ms(lambda: merge_updates([packed] * k, [1.0] * k, "rda", out=lent)),
        "outer_step": ms(lambda: NesterovSGD(0.8, 0.0).step(theta, grads, factors)),  # applies RDA's factor
        "broadcast_pass": ms(lambda: encode_delta_tensors(theta, view, "int8")),
        "provenance_tag": ms(lambda: provenance.tag(b"k" * 32, 0, 1, view, names=["a", "b"])),
        # The round into a fresh accumulator, as before the syncer lent it one (its own process
        # keeps freed memory, diloco/launch.py keep_freed_memory; this one does not):
        "rda_round_fresh": ms(lambda: merge_updates([packed] * k, [1.0] * k, "rda")),
    }
    for name, value in rows.items():
        print(f"{name:16} {value:8.1f} ms")
    print(json.dumps({"bench": "publish_profile", "fragment_params": n, "push_mb": len(blob) / 1e6, **rows}))


if __name__ == "__main__":
    main()
