"""RDA merge of a round and the Nesterov outer step: throughput as a ratio to a memory copy.

    python bench/merge.py [--mib 4 64] [--learners 4]    # --mib: the round's whole input

A round is a list of contributions (separate arrays, as pushes arrive), merged per tensor.
Measured: RDA and the weighted average on fp32 arrays (`rda_ratio_to_memcpy`, the target
>= 0.5), RDA on int4 payloads as the syncer really holds them (decoded straight into the
accumulator, their norms known from admission), and the fused Nesterov step. Input bytes are
the contributions' fp32 total (M x tensor size, 4-64 MiB as the target says; for the outer
step Θ, momentum and Δ); each memcpy copies the same number of bytes, its repeats taken in turn with the kernels'. Last line: one JSON object; top-level ratios are the worst over sizes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import side_by_side

from diloco.core.codecs import encode, parse
from diloco.core.merge import rda, weighted_average
from diloco.core.outer import NesterovSGD
from diloco.launch import keep_freed_memory


def measure(mib: float, learners: int) -> dict[str, float]:
    n = int(mib * (1 << 20) / 4 / learners)
    rng = np.random.default_rng(0)
    deltas = [rng.standard_normal(n).astype(np.float32) for _ in range(learners)]
    weights = rng.uniform(0.5, 2.0, learners)
    src = np.concatenate(deltas)
    dst = np.empty_like(src)
    packed = [parse(encode(d, "int4")) for d in deltas]
    for p in packed:
        p.sumsq()  # admission measured each push's norm already
    opt = NesterovSGD(0.7, 0.9)
    theta = {"w": deltas[0].copy()}
    opt.step(theta, {"w": deltas[1]})  # momentum buffers exist, as in a running job
    three = src[: 3 * n] if learners >= 3 else np.concatenate([deltas[0]] * 3)
    t = side_by_side({
        "memcpy": lambda: np.copyto(dst, src),
        "rda": lambda: rda(deltas, weights),
        "average": lambda: weighted_average(deltas, weights),
        "rda_int4": lambda: rda(packed, weights),
        "step_memcpy": lambda: np.copyto(dst[: three.size], three),  # the step reads θ, m and Δ
        "nesterov": lambda: opt.step(theta, {"w": deltas[1]}),
    })
    return {
        "memcpy_gb_s": src.nbytes / t["memcpy"] / 1e9,
        "rda_ratio_to_memcpy": t["memcpy"] / t["rda"],
        "average_ratio_to_memcpy": t["memcpy"] / t["average"],
        "rda_int4_ratio_to_memcpy": t["memcpy"] / t["rda_int4"],
        "nesterov_ratio_to_memcpy": t["step_memcpy"] / t["nesterov"],
    }


def main() -> None:
    keep_freed_memory()  # the allocator the syncer and the learners run with (diloco/launch.py)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, nargs="+", default=[4.0, 64.0], help="the round's input: all contributions, fp32")
    parser.add_argument("--learners", type=int, default=4)
    args = parser.parse_args()
    rows = {f"{mib:g}": measure(mib, args.learners) for mib in args.mib}
    names = ["rda", "average", "rda_int4", "nesterov"]
    print(f"{'MiB':>5} {'memcpy GB/s':>12} " + " ".join(f"{k + ' / memcpy':>20}" for k in names))
    for mib, row in rows.items():
        print(f"{mib:>5} {row['memcpy_gb_s']:12.2f} " + " ".join(f"{row[f'{k}_ratio_to_memcpy']:20.3f}" for k in names))
    result: dict[str, object] = {"learners": args.learners}
    result.update({f"{k}_ratio_to_memcpy": min(r[f"{k}_ratio_to_memcpy"] for r in rows.values()) for k in names})
    result["by_mib"] = rows
    print(json.dumps(result))


if __name__ == "__main__":
    main()
