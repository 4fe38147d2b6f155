"""RDA merge of 4 contributions: throughput as a ratio to a plain memory copy of the same input.

    python bench/merge.py [--mib 4] [--learners 4]

Input bytes are the contributions' total (M x tensor size); the memory copy copies
the same number of bytes. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import best_seconds

from diloco.core.merge import rda, weighted_average


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=float, default=4.0, help="size of one contribution (fp32)")
    parser.add_argument("--learners", type=int, default=4)
    args = parser.parse_args()
    n = int(args.mib * (1 << 20) / 4)
    rng = np.random.default_rng(0)
    deltas = [rng.standard_normal(n).astype(np.float32) for _ in range(args.learners)]
    weights = rng.uniform(0.5, 2.0, args.learners)
    src = np.concatenate(deltas)
    dst = np.empty_like(src)
    copy_s = best_seconds(lambda: np.copyto(dst, src))
    stacked = np.stack(deltas)  # the syncer's layout when contributions decode into one slab
    rda_s = best_seconds(lambda: rda(deltas, weights), repeats=5)
    rda_stacked_s = best_seconds(lambda: rda(stacked, weights), repeats=5)
    avg_s = best_seconds(lambda: weighted_average(deltas, weights), repeats=5)
    total = src.nbytes
    print(f"{'op':18} {'GB/s':>8} {'ratio to memcpy':>16}")
    rows = [("memcpy", copy_s), ("rda (list)", rda_s), ("rda (stacked)", rda_stacked_s), ("weighted average", avg_s)]
    for name, s in rows:
        print(f"{name:18} {total / s / 1e9:8.2f} {copy_s / s:16.3f}")
    print(json.dumps({
        "learners": args.learners, "mib_per_contribution": args.mib,
        "memcpy_gb_s": total / copy_s / 1e9, "rda_gb_s": total / rda_s / 1e9,
        "rda_ratio_to_memcpy": copy_s / rda_s,
        "rda_stacked_ratio_to_memcpy": copy_s / rda_stacked_s, "average_ratio_to_memcpy": copy_s / avg_s,
    }))


if __name__ == "__main__":
    main()
