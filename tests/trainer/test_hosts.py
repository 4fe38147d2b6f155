"""A learner's hosts share host 0's news through JAX's collectives as typed arrays, never pickles.

Two real processes of one JAX program (jax.distributed, gloo on loopback, two CPU devices each,
as `diloco run` starts a `hostsPerLearner: 2` learner), with `pickle` made to raise in both once
JAX is up: a scripted syncer client on host 0 answers a join, step boundaries with no news, with
published fragments (NaN and -0.0 included: bit for bit), answers, refusals, an overflowing
record, a syncer shard's re-join, the end's flags and a refused join; both hosts must see the same,
and a push's fragment sharded over both hosts' devices must come back whole on each.
"""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import hashlib, json, os, sys, threading
pid, port = int(sys.argv[1]), int(sys.argv[2])
os.sched_setaffinity(0, {pid % os.cpu_count()})
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
import numpy as np
from diloco.core.ledger import Arrival
from diloco.trainer.hosts import Hosts
from diloco.trainer.sync.mirrored import MirroredClient
from diloco.trainer.sync.messages import JoinRefused, JoinState, Updates

import pickle, _pickle  # from here on (every import done), any pickling raises

def refuse(*a, **k):
    raise AssertionError("pickle used on the hosts' sharing path")

for module in (pickle, _pickle):
    for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
        setattr(module, name, refuse)

fragments = [["a", "b"], ["c"], ["d", "e"]]
shapes = {"a": (3, 4), "b": (5,), "c": (2, 2, 2), "d": (7,), "e": ()}

def tensors(p, seed):
    rng = np.random.default_rng(seed)
    out = {n: rng.standard_normal(shapes[n]).astype(np.float32) for n in fragments[p]}
    first = next(iter(out.values())).reshape(-1)
    first[:2] = [np.nan, -0.0]  # bits, not values, must arrive
    return out

def state(owned, incarnation):
    params = {n: v for p in owned for n, v in tensors(p, 10 + p).items()}
    return JoinState(incarnation, [4, 5, 6], [list(f) for f in fragments], params, "int4", 64, 17, list(owned),
                     shard=1, shards=2, tokens_merged=2**40, job_tokens=12345)

script = [
    Updates(None, {}, [], []),
    Updates(None, {2: Arrival(9, tensors(2, 1), 11, 77), 0: Arrival(3, tensors(0, 2), 12, 78)},
            [(0, 7, 3, True), (2, 300000, 9, False)], [(1, 9)], share_state=True),
    Updates(None, {}, [(p % 3, 1000 + p, p, p % 2 == 0) for p in range(20)], [(p % 3, p) for p in range(30)]),
    Updates(state([0, 2], "inc-ß"), {1: Arrival(2, tensors(1, 3), 13, 79)}, [], []),
]

class Scripted:
    def __init__(self):
        self.stopping, self.resync, self.steps = threading.Event(), threading.Event(), iter(script)
        self.joins = iter([state([0, 1, 2], "first"), JoinRefused("another model: ü")])

    def join_with_retry(self, shapes, initial=None):
        answer = next(self.joins)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def take_updates(self):
        u = next(self.steps)
        self.resync.set() if u.share_state else self.resync.clear()
        return u

    def flush(self, timeout):
        return True

stop = threading.Event()
client = MirroredClient(Hosts(pid, 2), Scripted() if pid == 0 else None, stop, fragments=fragments, shapes=shapes)

def arrays(d):
    for v in d.values():
        assert v.dtype == np.float32 and v.flags.writeable, v
    return {n: [list(v.shape), hashlib.sha256(v.tobytes()).hexdigest()] for n, v in sorted(d.items())}

def js(s):
    return None if s is None else {"incarnation": s.incarnation, "versions": s.versions, "fragments": s.fragments,
            "params": arrays(s.params), "codec": s.codec, "block_size": s.block_size, "slot": s.slot,
            "owned": s.owned, "shard": s.shard, "shards": s.shards, "merged": s.tokens_merged, "job": s.job_tokens}

seen = {"join": js(client.join_with_retry(shapes)), "steps": []}
for i in range(len(script)):
    if i == 2:
        stop.set()
    u = client.take_updates()
    seen["steps"].append({"rejoined": js(u.rejoined), "share_state": u.share_state, "accepted": u.accepted,
                          "refused": u.refused, "stop": client.stop_requested, "resync": client.resync.is_set(),
                          "published": [[p, a.version, a.next_slot, a.job_tokens, arrays(a.tensors)]
                                        for p, a in u.published.items()]})
seen["until"] = client.until(float("inf"))
seen["flush"] = client.flush(1.0)
try:
    client.join_with_retry(shapes)
except JoinRefused as exc:
    seen["refused"] = str(exc)
# A push's fragment, sharded over every device of both hosts (rows, columns) or replicated: whole on each.
from jax.sharding import Mesh, NamedSharding, PartitionSpec as Spec
mesh = Mesh(np.array(jax.devices()).reshape(1, 4), ("data", "fsdp"))
whole = {"w": np.arange(48, dtype=np.float32).reshape(8, 6), "v": -np.arange(48, dtype=np.float32).reshape(6, 8),
         "b": np.float32([1, -0.0, np.nan]), "s": np.array(3.5, np.float32)}
specs = {"w": Spec("fsdp"), "v": Spec(None, "fsdp"), "b": Spec(), "s": Spec()}
placed = {n: jax.make_array_from_callback(v.shape, NamedSharding(mesh, specs[n]), lambda i, v=v: v[i])
          for n, v in whole.items()}
seen["host_copy"] = arrays(client.hosts.host_copy(placed))
expected = {"join": js(state([0, 1, 2], "first")), "host_copy": arrays(whole), "rejoined": js(script[3].rejoined),
            "published": [arrays(a.tensors) for u in script for a in u.published.values()]}
print(json.dumps({"seen": seen, "expected": expected}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("module", ["hosts.py", "sync/mirrored.py"])
def test_the_sharing_modules_do_not_import_pickle(module: str) -> None:
    tree = ast.parse((ROOT / "trainer" / module).read_text())
    imported = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not imported & {"pickle", "_pickle", "cloudpickle", "dill", "marshal"}, imported


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_two_hosts_see_host_0s_news_bit_for_bit_without_pickle() -> None:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-P", "-c", CHILD, str(pid), str(port)], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for pid in (0, 1)]
    outs = [proc.communicate(timeout=150) for proc in procs]
    for proc, (_, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, err[-3000:]
    host0, host1 = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    assert host0["seen"] == host1["seen"]
    seen, expected = host1["seen"], host1["expected"]
    assert seen["join"] == expected["join"]
    steps = seen["steps"]
    assert steps[0] == {"rejoined": None, "share_state": False, "accepted": [], "refused": [], "stop": False,
                        "resync": False, "published": []}
    assert [p[:4] for p in steps[1]["published"]] == [[2, 9, 11, 77], [0, 3, 12, 78]]  # host 0's order
    assert steps[1]["accepted"] == [[0, 7, 3, True], [2, 300000, 9, False]] and steps[1]["refused"] == [[1, 9]]
    assert steps[1]["share_state"] and steps[1]["resync"] and not steps[1]["stop"]
    assert len(steps[2]["accepted"]) == 20 and len(steps[2]["refused"]) == 30 and steps[2]["stop"]
    assert steps[2]["accepted"][19] == [1, 1019, 19, False] and steps[2]["refused"][29] == [2, 29]
    assert steps[3]["rejoined"] == expected["rejoined"] and steps[3]["rejoined"]["incarnation"] == "inc-ß"
    assert [p[4] for s in steps for p in s["published"]] == expected["published"]
    assert seen["until"] is True and seen["flush"] is True
    assert seen["refused"] == "another model: ü"
    assert seen["host_copy"] == expected["host_copy"]
