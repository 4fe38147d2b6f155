"""Syncer checkpoints: our single-file format against orbax-checkpoint, same state, one run.

    python bench/checkpoint.py [--mib 16]

Measures, each in a fresh interpreter so import costs count: import time, save time and
restore time of the syncer's state (fp32 fragments plus Nesterov momentum). Last line JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap

OURS = """
import time, sys, numpy as np
t0 = time.perf_counter()
from diloco.checkpoint import CheckpointStore
t1 = time.perf_counter()
n = int({mib} * (1 << 20) / 8)
arrays = {{f"param/t{{i}}": np.random.default_rng(i).standard_normal(n // 8).astype(np.float32) for i in range(8)}}
arrays.update({{f"momentum/0/t{{i}}": a.copy() for i, a in enumerate(arrays.values())}})
store = CheckpointStore("{d}")
t2 = time.perf_counter(); store.save(arrays, {{"versions": [1]}}); t3 = time.perf_counter()
loaded, _ = store.load_latest(); t4 = time.perf_counter()
assert all(np.array_equal(loaded.arrays[k], v) for k, v in arrays.items())
print(t1 - t0, t3 - t2, t4 - t3)
"""

ORBAX = """
import time, numpy as np
t0 = time.perf_counter()
import orbax.checkpoint as ocp
t1 = time.perf_counter()
n = int({mib} * (1 << 20) / 8)
arrays = {{f"param_t{{i}}": np.random.default_rng(i).standard_normal(n // 8).astype(np.float32) for i in range(8)}}
arrays.update({{f"momentum_t{{i}}": a.copy() for i, a in enumerate(list(arrays.values()))}})
ckpt = ocp.StandardCheckpointer()
t2 = time.perf_counter(); ckpt.save("{d}/state", arrays); ckpt.wait_until_finished(); t3 = time.perf_counter()
restored = ckpt.restore("{d}/state"); t4 = time.perf_counter()
assert all(np.array_equal(np.asarray(restored[k]), v) for k, v in arrays.items())
print(t1 - t0, t3 - t2, t4 - t3)
"""


def measure(code: str, mib: float) -> list[float]:
    with tempfile.TemporaryDirectory() as d:
        out = subprocess.run([sys.executable, "-P", "-c", textwrap.dedent(code.format(mib=mib, d=d))],
                             capture_output=True, text=True, check=True)
    return [float(x) for x in out.stdout.split()[-3:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=float, default=16.0, help="size of the fp32 parameters")
    args = parser.parse_args()
    ours, orbax = measure(OURS, args.mib), measure(ORBAX, args.mib)
    print(f"{'':8} {'import s':>9} {'save s':>8} {'restore s':>10}")
    for name, row in (("ours", ours), ("orbax", orbax)):
        print(f"{name:8} {row[0]:9.3f} {row[1]:8.3f} {row[2]:10.3f}")
    print(json.dumps({"state_mib": 2 * args.mib, "ours": dict(zip(["import_s", "save_s", "restore_s"], ours)),
                      "orbax": dict(zip(["import_s", "save_s", "restore_s"], orbax)),
                      "save_ratio_orbax_over_ours": orbax[1] / ours[1],
                      "import_ratio_orbax_over_ours": orbax[0] / ours[0]}))


if __name__ == "__main__":
    main()
