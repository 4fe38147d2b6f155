"""A multi-host learner's step boundary: host 0's news pickled, or shared as typed arrays.

    python bench/multihost_share.py [--preset llama-125m] [--vocab 8192] [--fragments 24] [--rounds 20] [--smoke]

At every step boundary host 0 of a `hostsPerLearner: H` learner shares what its syncer client
gathered (trainer/sync/mirrored.py, `MirroredClient.take_updates`): most steps nothing but its stop
flags, some a push's answer, a few a published fragment. Two ways, side by side in one run:

- **pickle** (trainer/hosts.py before issue 44): the snapshot (updates, three flags) pickled
  on host 0, its length broadcast, then the bytes as a uint8 array; the others unpickle.
- **typed** (what the learner does now): one int64 record of flags, counts and rows (one
  broadcast of 32 words when it fits), then each published fragment's tensors as one int32
  vector of their float32 bits, laid out by the fragment plan every host holds; each
  through `multihost_utils.broadcast_one_to_all`, as the pickle path's bytes were.

Two processes of two CPU devices each form one JAX program (jax.distributed, gloo collectives
on loopback, one pinned core each), as `diloco run` starts a `hostsPerLearner: 2` learner. Three
kinds of step, each way first in turn, both hosts starting together: no news, one push's answer,
and one published fragment of the model's fragment plan (with an answer), round robin over the
fragments; the two cheap kinds five times a round. The time is each host's, from the start to holding the news; a step costs what the
slower host took. Then 50 step boundaries with no news back to back, as a learner's hosts
reach them in lock step (no barrier between; four runs a way, the median, per boundary). A
first pass over every fragment (its compiles) is timed apart. Last line: JSON with each way's
median milliseconds per kind and the ratios pickle / typed.
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
import json, os, pickle, statistics, sys, threading, time
pid, port, args = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
os.sched_setaffinity(0, {pid % os.cpu_count()})
from diloco.launch import learner_runtime
learner_runtime()
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
import numpy as np
from jax.experimental import multihost_utils
from diloco.core.fragments import plan_fragments, specs_from_shapes
from diloco.core.ledger import Arrival
from diloco.spec import TransformerModel
from diloco.trainer import model
from diloco.trainer.hosts import HEADER, Hosts
from diloco.trainer.sync.mirrored import MirroredClient
from diloco.trainer.sync.messages import Updates

cfg = TransformerModel.model_validate({"preset": args["preset"], "vocab_size": args["vocab"]})
shapes = model.parameter_shapes(cfg)
plan = plan_fragments(specs_from_shapes(shapes), args["fragments"], "balanced")
P = plan.num_fragments
hosts = Hosts(pid, 2)
stop = threading.Event()

class Scripted:  # host 0's syncer client: hands out this step's news
    def __init__(self):
        self.stopping, self.resync, self.news = threading.Event(), threading.Event(), None

    def take_updates(self):
        return self.news

real = Scripted() if pid == 0 else None
typed = MirroredClient(hosts, real, stop, fragments=plan.fragments, shapes=shapes)
blob_bytes = []

def pickled_share(value):  # trainer/hosts.py's Hosts.share before issue 44, verbatim
    blob = np.frombuffer(pickle.dumps(value), np.uint8) if hosts.leader else np.zeros(0, np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.array([blob.size], np.int64))[0])
    padded = blob if hosts.leader else np.zeros(size, np.uint8)
    data = np.asarray(multihost_utils.broadcast_one_to_all(padded))
    blob_bytes.append(size)
    return value if hosts.leader else pickle.loads(data.tobytes())

def pickled_take():  # and its MirroredClient.take_updates
    snapshot = None
    if real is not None:
        snapshot = (real.take_updates(), real.stopping.is_set(), real.resync.is_set(), stop.is_set())
    updates, stopping, resync, stop_requested = pickled_share(snapshot)
    return updates

fragments = {}

def fragment(p):
    if p not in fragments:
        rng = np.random.default_rng(p)
        fragments[p] = {n: rng.standard_normal(shapes[n], dtype=np.float32) for n in plan.fragments[p]}
    return fragments[p]

def news(kind, r):
    p, push_id = r % P, 1000 + r
    if kind == "none":
        return Updates(None, {}, [], [])
    if kind == "answer":
        return Updates(None, {}, [(p, push_id, 40 + r, False)], [])
    return Updates(None, {p: Arrival(40 + r, fragment(p), 200 + r, 4096 * r)}, [(p, push_id, 40 + r, False)], [])

ways = [("pickle", pickled_take), ("typed", typed.take_updates)]
kinds = ("none", "answer", "fragment")

def step(name, fn, kind, r):
    if real is not None:
        real.news = news(kind, r)
        if kind == "fragment":
            fragment(r % P)  # made before the clock starts
    multihost_utils.sync_global_devices(f"{name}{kind}{r}")  # both hosts start together
    t = time.perf_counter()
    u = fn()
    ms = 1e3 * (time.perf_counter() - t)
    if kind == "fragment":  # what arrived is what host 0 sent
        (p, a), = u.published.items()
        first = plan.fragments[p][0]
        assert p == r % P and a.version == 40 + r and np.array_equal(a.tensors[first], fragment(p)[first] if pid == 0
               else np.random.default_rng(p).standard_normal(shapes[first], dtype=np.float32)), (p, r)
    return ms

first = {name: 0.0 for name, _ in ways}
for r in range(P):  # the first pass: every fragment's (and every record's) first sight, compiles included
    for name, fn in ways:
        for kind in kinds:
            first[name] += step(name, fn, kind, r) / 1e3
times = {(name, kind): [] for name, _ in ways for kind in kinds}
for r in range(P, P + args["rounds"]):
    for name, fn in ways[r % 2:] + ways[: r % 2]:  # each way first in turn
        for kind in kinds:
            for _ in range(1 if kind == "fragment" else 5):  # the cheap steps, five times a round
                times[name, kind].append(step(name, fn, kind, r))
loop = {}  # back to back, as a learner's steps reach their boundaries: no barrier between them
for r in range(4):
    for name, fn in ways[r % 2:] + ways[: r % 2]:
        if real is not None:
            real.news = news("none", 0)
        multihost_utils.sync_global_devices(f"loop{name}{r}")
        t = time.perf_counter()
        for _ in range(50):
            fn()
        loop.setdefault(name, []).append(1e3 * (time.perf_counter() - t) / 50)
frag = sum(int(np.prod(shapes[n])) for f in plan.fragments for n in f) / P
print(json.dumps({"pid": pid, "median_ms": {f"{name}_{kind}": statistics.median(v) for (name, kind), v in times.items()},
                  "first_pass_s": first, "loop_ms": {name: statistics.median(v) for name, v in loop.items()},
                  "parameters": sum(int(np.prod(s)) for s in shapes.values()),
                  "fragment_parameters": frag, "fragments": P, "header_bytes": 8 * HEADER,
                  "pickle_blob_bytes_max": max(blob_bytes), "pickle_blob_bytes_min": min(blob_bytes)}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-125m")
    parser.add_argument("--vocab", type=int, default=8192, help="the vocabulary (issue 44's real-size run: 8,192)")
    parser.add_argument("--fragments", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="a tiny model and a few rounds (the test suite's check)")
    args = parser.parse_args()
    if args.smoke:
        args.preset, args.vocab, args.fragments, args.rounds = "llama-tiny", 256, 4, 4
    opts = json.dumps({"preset": args.preset, "vocab": args.vocab, "fragments": args.fragments, "rounds": args.rounds})
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-P", "-c", CHILD, str(pid), str(port), opts], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT) for pid in (0, 1)]
    outs = [proc.communicate(timeout=900) for proc in procs]
    for proc, (_, err) in zip(procs, outs, strict=True):
        if proc.returncode != 0:
            raise SystemExit(f"bench/multihost_share.py: a host failed:\n{err[-3000:]}")
    rows = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    host0 = rows[0]
    ms = {key: max(r["median_ms"][key] for r in rows) for key in host0["median_ms"]}  # the slower host's
    print(f"{args.preset} (vocab {args.vocab}): {host0['parameters'] / 1e6:.2f}M parameters, {host0['fragments']} "
          f"fragments of {host0['fragment_parameters'] / 1e6:.2f}M on average; 2 hosts x 2 CPU devices, gloo; "
          f"median of {args.rounds} rounds, the slower host's")
    print(f"{'step boundary':<24}{'pickle ms':>11}{'typed ms':>10}{'pickle/typed':>14}")
    ratios = {}
    for kind, label in (("none", "no news"), ("answer", "one push's answer"), ("fragment", "a published fragment")):
        ratios[kind] = ms[f"pickle_{kind}"] / ms[f"typed_{kind}"]
        print(f"{label:<24}{ms[f'pickle_{kind}']:>11.2f}{ms[f'typed_{kind}']:>10.2f}{ratios[kind]:>14.2f}")
    loop = {name: max(r["loop_ms"][name] for r in rows) for name in ("pickle", "typed")}
    print(f"{'no news, back to back':<24}{loop['pickle']:>11.2f}{loop['typed']:>10.2f}"
          f"{loop['pickle'] / loop['typed']:>14.2f}")
    first = {name: max(r["first_pass_s"][name] for r in rows) for name in ("pickle", "typed")}
    print(f"first pass over every fragment (compiles included): pickle {first['pickle']:.2f} s, "
          f"typed {first['typed']:.2f} s")
    print(json.dumps({"bench": "multihost_share", "median_ms": ms,
                      "pickle_over_typed_none": ratios["none"], "pickle_over_typed_answer": ratios["answer"],
                      "pickle_over_typed_fragment": ratios["fragment"], "loop_ms": loop,
                      "pickle_over_typed_loop": loop["pickle"] / loop["typed"],
                      "first_pass_s": first,
                      "parameters": host0["parameters"], "fragment_parameters": host0["fragment_parameters"],
                      "fragments": host0["fragments"], "preset": args.preset, "vocab": args.vocab,
                      "pickle_blob_bytes_max": host0["pickle_blob_bytes_max"],
                      "pickle_blob_bytes_min": host0["pickle_blob_bytes_min"], "typed_header_bytes": host0["header_bytes"],
                      "rounds": args.rounds, "hosts": 2, "devices_per_host": 2}))


if __name__ == "__main__":
    main()
