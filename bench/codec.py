"""int4 encode+decode throughput as a ratio to a plain memory copy of the same input.

    python bench/codec.py [--mib 4]

The syncer decodes every contribution and learners encode one fragment per step, so
the codec must run near memory speed. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import best_seconds

from diloco.core.codecs import CODECS, decode, encode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=float, default=4.0, help="input size (fp32)")
    args = parser.parse_args()
    n = int(args.mib * (1 << 20) / 4)
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    dst = np.empty_like(x)
    copy_s = best_seconds(lambda: np.copyto(dst, x))
    result: dict[str, float] = {"input_mib": args.mib, "memcpy_gb_s": x.nbytes / copy_s / 1e9}
    print(f"{'codec':6} {'enc+dec GB/s':>13} {'ratio to memcpy':>16} {'rel L2 err':>11}")
    for codec in CODECS:
        payload = encode(x, codec)
        s = best_seconds(lambda: decode(encode(x, codec)), repeats=5)
        err = float(np.linalg.norm(decode(payload) - x) / np.linalg.norm(x))
        gbs = x.nbytes / s / 1e9
        print(f"{codec:6} {gbs:13.2f} {copy_s / s:16.3f} {err:11.4f}")
        result[f"{codec}_encode_decode_gb_s"] = gbs
        result[f"{codec}_ratio_to_memcpy"] = copy_s / s
    print(json.dumps(result))


if __name__ == "__main__":
    main()
