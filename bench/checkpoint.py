"""Syncer checkpoints: our single-file format against orbax-checkpoint, same state, one run;
or (`--stores`) our checkpoints on a volume (a local directory) against object storage (an S3
server on 127.0.0.1, moto's, reached through s3fs as a bucket would be), same state, same run.

    python bench/checkpoint.py [--mib 16]
    python bench/checkpoint.py --stores [--mib 16] [--repeat 5]

Measures, each in a fresh interpreter so import costs count: import time, save time and
restore time of the syncer's state (fp32 fragments plus Nesterov momentum). `--stores` reports
the median of `--repeat` saves and restores per store (an S3 restore reads the manifest, then
the object, and verifies both). Last line JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
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


STORES = """
import time, sys, numpy as np
t0 = time.perf_counter()
from diloco.checkpoint_objects import open_store
t1 = time.perf_counter()
n = int({mib} * (1 << 20) / 8)
arrays = {{f"param/t{{i}}": np.random.default_rng(i).standard_normal(n // 8).astype(np.float32) for i in range(8)}}
arrays.update({{f"momentum/0/t{{i}}": a.copy() for i, a in enumerate(arrays.values())}})
store = open_store("{d}")
saves, restores = [], []
for _ in range({repeat}):
    t2 = time.perf_counter(); store.save(arrays, {{"versions": [1]}}); t3 = time.perf_counter()
    loaded, _ = store.load_latest(); t4 = time.perf_counter()
    saves.append(t3 - t2); restores.append(t4 - t3)
assert all(np.array_equal(loaded.arrays[k], v) for k, v in arrays.items())
print(t1 - t0, *saves, *restores)
"""


@contextlib.contextmanager
def s3_server() -> object:
    """A moto S3 server on 127.0.0.1 and a bucket; the children reach it through the environment."""
    import logging

    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    os.environ.update(env)
    s3fs.S3FileSystem().mkdir("bench-checkpoints")
    try:
        yield "s3://bench-checkpoints/job"
    finally:
        server.stop()


def stores(mib: float, repeat: int) -> dict[str, dict[str, float]]:
    """Median save and restore on a local directory and on the S3 server, one interpreter each."""
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as d, s3_server() as url:
        for name, where in (("volume", f"{d}/ckpt"), ("s3", url)):
            code = textwrap.dedent(STORES.format(mib=mib, d=where, repeat=repeat))
            run = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True)
            values = [float(x) for x in run.stdout.split()[-(1 + 2 * repeat):]]
            saves, restores = values[1:1 + repeat], values[1 + repeat:]
            out[name] = {"import_s": values[0], "save_s": statistics.median(saves),
                         "restore_s": statistics.median(restores), "save_max_s": max(saves),
                         "restore_max_s": max(restores)}
    return out


def measure(code: str, mib: float) -> list[float]:
    with tempfile.TemporaryDirectory() as d:
        out = subprocess.run([sys.executable, "-P", "-c", textwrap.dedent(code.format(mib=mib, d=d))],
                             capture_output=True, text=True, check=True)
    return [float(x) for x in out.stdout.split()[-3:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=float, default=16.0, help="size of the fp32 parameters")
    parser.add_argument("--stores", action="store_true",
                        help="a volume (local directory) against object storage (moto's S3 server), not orbax")
    parser.add_argument("--repeat", type=int, default=5, help="--stores: saves and restores per store (median)")
    args = parser.parse_args()
    if args.stores:
        got = stores(args.mib, args.repeat)
        print(f"{'':8} {'save s':>8} {'restore s':>10}   (median of {args.repeat}; {2 * args.mib:g} MiB of state)")
        for name, row in got.items():
            print(f"{name:8} {row['save_s']:8.3f} {row['restore_s']:10.3f}")
        print(json.dumps({"state_mib": 2 * args.mib, "repeat": args.repeat, **got,
                          "save_ratio_s3_over_volume": got["s3"]["save_s"] / got["volume"]["save_s"],
                          "restore_ratio_s3_over_volume": got["s3"]["restore_s"] / got["volume"]["restore_s"]}))
        return
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
