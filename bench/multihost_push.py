"""A multi-host learner's push: host 0 gathers the fragment, or each host encodes what it holds.

    python bench/multihost_push.py [--layers 4] [--d-model 256] [--fragments 4] [--rounds 40] [--smoke]

A learner of H hosts keeps its parameters sharded over every device (`spec.training.mesh`
with fsdp). To push fragment p it needs the outer gradient Δ = A_p − θ_p on the host. Two
ways (issue 12: "each host sends only what it holds, or host 0 gathers; measure which"):

- **gather** (what the learner does, `Hosts.host_copy`): each host writes the parts its
  devices hold into a zeroed vector of the whole fragment and one all-reduce (one device per
  host) sums them into the whole on every host; then the push is encoded from the whole
  fragment (every host runs the same program, so each encodes it; host 0 sends it).
- **allgather** (`host_copy` before issue 44): `multihost_utils.process_allgather` of each of
  the fragment's tensors to every device.
- **per host**: each host encodes only the shards its own devices hold, and would send its
  part itself (the syncer would assemble H parts per push; not built).

Two processes of two CPU devices each form one JAX program over a 1 x 4 (data x fsdp) mesh,
as `diloco run` starts a `hostsPerLearner: 2` learner (gloo collectives on loopback), each
pinned to its own core. The two ways alternate round by round on the same arrays. Last line:
JSON with each way's median milliseconds per push on host 0 and the bytes host 0 sends.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, statistics, sys, time
pid, port, args = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
os.sched_setaffinity(0, {pid % os.cpu_count()})
from diloco.launch import learner_runtime
learner_runtime()
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
import numpy as np
from jax.experimental import multihost_utils
from diloco.core.codecs import encode_difference
from diloco.core.fragments import plan_fragments, specs_from_shapes
from diloco.spec import Mesh, TransformerModel
from diloco.trainer import model, sharding
from diloco.trainer.hosts import Hosts

cfg = TransformerModel(layers=args["layers"], d_model=args["d_model"], heads=4, context=128)
shapes = model.parameter_shapes(cfg)
layout = sharding.layout(Mesh(data=1, fsdp=4), shapes, 8)
rng = np.random.default_rng(0)  # the same values on both hosts, as a learner's parameters are
host = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
params = jax.device_put(host, {n: layout.params[n] for n in shapes})
anchors = {n: v + np.float32(1e-3) for n, v in host.items()}
plan = plan_fragments(specs_from_shapes(shapes), args["fragments"], "balanced")

def local_part(v):
    # The rows (or columns) this host's devices hold, in device order; a replicated tensor
    # (too small to shard) only on host 0, which would send it alone.
    shards = sorted(v.addressable_shards, key=lambda s: s.device.id)
    index = shards[0].index
    if all(sh.index == index for sh in shards):
        return (np.asarray(shards[0].data), index) if pid == 0 else (None, None)
    axis = next(d for d, sl in enumerate(index) if sl != slice(None))
    start = min(sh.index[axis].start for sh in shards)
    part = np.concatenate([np.asarray(sh.data) for sh in shards], axis=axis)
    return part, tuple(slice(start, start + part.shape[axis]) if d == axis else slice(None) for d in range(part.ndim))

hosts = Hosts(pid, 2)

def gather(p):
    theta = hosts.host_copy({n: params[n] for n in plan.fragments[p]})  # the learner's own `local(p)`
    return len(encode_difference({n: anchors[n] for n in theta}, theta, "int4")[0])

def allgather(p):
    theta = {n: np.asarray(multihost_utils.process_allgather(params[n], tiled=True)) for n in plan.fragments[p]}
    return len(encode_difference({n: anchors[n] for n in theta}, theta, "int4")[0])

for p in range(plan.num_fragments):  # the whole fragment, bit for bit, either way
    mine = hosts.host_copy({n: params[n] for n in plan.fragments[p]})
    assert all(np.array_equal(mine[n], host[n]) for n in plan.fragments[p]), p

replicated = jax.sharding.NamedSharding(layout.mesh, jax.sharding.PartitionSpec())
gatherers = {}

def gather_once(p):
    # The same all-gather as one compiled program per fragment, kept: a jitted identity onto
    # the replicated sharding, then this host's copy.
    names = plan.fragments[p]
    if p not in gatherers:
        gatherers[p] = jax.jit(lambda xs: xs, out_shardings={n: replicated for n in names})
    full = gatherers[p]({n: params[n] for n in names})
    theta = {n: np.asarray(v.addressable_data(0)) for n, v in full.items()}
    return len(encode_difference({n: anchors[n] for n in theta}, theta, "int4")[0])

def per_host(p):
    theta, anchor = {}, {}
    for n in plan.fragments[p]:
        part, index = local_part(params[n])
        if part is not None:
            theta[n], anchor[n] = part, np.ascontiguousarray(anchors[n][index])
    return len(encode_difference(anchor, theta, "int4")[0])

times = {"gather": [], "allgather": [], "gather_once": [], "per_host": []}
ways = [("gather", gather), ("allgather", allgather), ("gather_once", gather_once), ("per_host", per_host)]
sent = {}
warm = 2 * plan.num_fragments  # every fragment's collectives compiled, twice over
for r in range(args["rounds"] + warm):
    p = r % plan.num_fragments
    for name, fn in ways[r % 4:] + ways[: r % 4]:  # each way first in turn
        multihost_utils.sync_global_devices(f"{name}{r}")  # both hosts start together
        t = time.perf_counter()
        nbytes = fn(p)
        ms = 1e3 * (time.perf_counter() - t)
        if r >= warm:
            times[name].append(ms)
            sent.setdefault(name, []).append(nbytes)
frag = sum(int(np.prod(shapes[n])) for f in plan.fragments for n in f) / plan.num_fragments
print(json.dumps({"pid": pid, "gather_ms": statistics.median(times["gather"]),
                  "allgather_ms": statistics.median(times["allgather"]),
                  "gather_once_ms": statistics.median(times["gather_once"]),
                  "per_host_ms": statistics.median(times["per_host"]),
                  "gather_bytes": statistics.mean(sent["gather"]), "per_host_bytes": statistics.mean(sent["per_host"]),
                  "parameters": sum(int(np.prod(s)) for s in shapes.values()), "fragment_parameters": frag}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--smoke", action="store_true", help="a tiny model and a few rounds (the test suite's check)")
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.d_model, args.rounds = 1, 64, 3
    opts = json.dumps({"layers": args.layers, "d_model": args.d_model, "fragments": args.fragments,
                       "rounds": args.rounds})
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-P", "-c", CHILD, str(pid), str(port), opts], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT) for pid in (0, 1)]
    outs = [proc.communicate(timeout=600) for proc in procs]
    for proc, (_, err) in zip(procs, outs, strict=True):
        if proc.returncode != 0:
            raise SystemExit(f"bench/multihost_push.py: a host failed:\n{err[-3000:]}")
    rows = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    host0 = rows[0]
    # A push is ready when the slower host is done (per host) or when host 0 is (gather).
    per_host = max(r["per_host_ms"] for r in rows)
    print(f"{host0['parameters'] / 1e6:.2f}M parameters, {host0['fragment_parameters'] / 1e6:.2f}M per fragment, "
          f"2 hosts x 2 CPU devices, fsdp 4")
    print(f"gather then encode the whole fragment: {host0['gather_ms']:.2f} ms, host 0 sends {host0['gather_bytes'] / 1e6:.3f} MB")
    print(f"  process_allgather per tensor instead: {host0['allgather_ms']:.2f} ms")
    print(f"  the same, one compiled gather kept:  {host0['gather_once_ms']:.2f} ms")
    print(f"each host encodes what it holds:       {per_host:.2f} ms, host 0 sends {host0['per_host_bytes'] / 1e6:.3f} MB")
    print(json.dumps({"bench": "multihost_push", "gather_ms": host0["gather_ms"], "gather_once_ms": host0["gather_once_ms"], "per_host_ms": per_host,
                      "allgather_ms": host0["allgather_ms"], "allgather_over_gather": host0["allgather_ms"] / host0["gather_ms"],
                      "gather_over_per_host": host0["gather_ms"] / per_host,
                      "gather_once_over_per_host": host0["gather_once_ms"] / per_host,
                      "gather_bytes_host0": host0["gather_bytes"], "per_host_bytes_host0": host0["per_host_bytes"],
                      "parameters": host0["parameters"], "fragment_parameters": host0["fragment_parameters"],
                      "rounds": args.rounds, "hosts": 2, "devices_per_host": 2}))


if __name__ == "__main__":
    main()
