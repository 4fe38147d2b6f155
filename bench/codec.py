"""Codec throughput (encode + decode) as a ratio to a plain memory copy of the same input.

    python bench/codec.py [--mib 4 64]

The syncer checks and merges every contribution and learners encode one fragment per step, so
the codec must run near memory speed (target: int4 and int8 >= 0.5 of memcpy on 4-64 MiB).
Measured as the system runs them: encode to a payload, decode into a buffer the caller owns (the
syncer decodes straight into its merge accumulator); the `_alloc` figures decode into a fresh
array each time, for comparison. Each codec's memcpy copies the same bytes in the same run,
its repeats taken in turn with the codec's (`_timing.side_by_side`).
Last line: one JSON object; the top-level ratios are the worst over the sizes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import side_by_side

from diloco.core.codecs import CODECS, decode, encode, parse
from diloco.launch import keep_freed_memory


def measure(mib: float) -> dict[str, float]:
    n = int(mib * (1 << 20) / 4)
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    dst = np.empty_like(x)
    out = np.empty_like(x)
    row: dict[str, float] = {}
    copies = []
    for codec in CODECS:
        packed = parse(encode(x, codec))
        t = side_by_side({"memcpy": lambda: np.copyto(dst, x), "encode": lambda: encode(x, codec),
                          "decode": lambda: packed.decode(out), "alloc": lambda: decode(encode(x, codec))})
        copy_s, enc_s, dec_s, alloc_s = t["memcpy"], t["encode"], t["decode"], t["alloc"]
        copies.append(copy_s)
        row[f"{codec}_ratio_to_memcpy"] = copy_s / (enc_s + dec_s)
        row[f"{codec}_encode_ratio"] = copy_s / enc_s
        row[f"{codec}_decode_ratio"] = copy_s / dec_s
        row[f"{codec}_alloc_ratio_to_memcpy"] = copy_s / alloc_s
        row[f"{codec}_rel_l2_error"] = float(np.linalg.norm(packed.decode() - x) / np.linalg.norm(x))
    row["memcpy_gb_s"] = x.nbytes / min(copies) / 1e9
    return row


def main() -> None:
    keep_freed_memory()  # the allocator the syncer and the learners run with (diloco/launch.py)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, nargs="+", default=[4.0, 64.0], help="input sizes (fp32 MiB)")
    args = parser.parse_args()
    rows = {f"{mib:g}": measure(mib) for mib in args.mib}
    print(f"{'MiB':>5} {'codec':6} {'enc+dec / memcpy':>17} {'encode':>8} {'decode':>8} {'allocating':>11} {'rel L2 err':>11}")
    for mib, row in rows.items():
        for codec in CODECS:
            print(f"{mib:>5} {codec:6} {row[f'{codec}_ratio_to_memcpy']:17.3f} {row[f'{codec}_encode_ratio']:8.3f} "
                  f"{row[f'{codec}_decode_ratio']:8.3f} {row[f'{codec}_alloc_ratio_to_memcpy']:11.3f} "
                  f"{row[f'{codec}_rel_l2_error']:11.4f}")
        print(f"{mib:>5} memcpy {row['memcpy_gb_s']:.2f} GB/s")
    result: dict[str, object] = {f"{c}_ratio_to_memcpy": min(r[f"{c}_ratio_to_memcpy"] for r in rows.values())
                                 for c in CODECS}
    result["by_mib"] = rows
    print(json.dumps(result))


if __name__ == "__main__":
    main()
