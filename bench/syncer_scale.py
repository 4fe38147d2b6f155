"""How many learners one syncer keeps up with, and its merge throughput against memory bandwidth.

    python bench/syncer_scale.py [--models 2x128,4x512,12x768] [--fragments 24] [--step-seconds 0.05,0.2,1]
                                 [--quorums 1,4,16] [--smoke]

Measured in one run, on the syncer's own code (`SyncerCore`: admission, rounds, merge, outer
step, publish encoding) with synthetic int4 outer gradients, no network:

* a: admitting one push (int4 decode, shape and NaN/Inf checks, round bookkeeping);
* m(K): closing a round of K contributions (token weights, RDA per tensor, Nesterov step);
* c: publishing one merged fragment to one subscriber (the delta against what that subscriber
  holds, encoded in `broadcastCompression`, int8 by default, decoded again for error feedback:
  the syncer does this per subscriber) and its size b;
* g: gRPC loopback throughput of the syncer's chunked streams (a real server in this process
  serving `Join`, a client in this process too: both ends share one interpreter, so this is
  pessimistic);
* memcpy bandwidth of this machine, for the ratios.

Each learner pushes one fragment (1/P of the model) per step, and every merge is published to
every learner. One syncer core then keeps up with M learners at step time T while
  worst case (K = 1, every push closes its own round): M/T x (a + m(1) + M x (c + b/g)) <= 1,
  best case (each round gathers all M):               1/T x (M a + m(M) + M x (c + b/g)) <= 1.
Last line: JSON.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from _timing import best_seconds


def model_params(layers: int, d_model: int) -> dict[str, np.ndarray]:
    import jax

    from diloco.spec import TransformerModel
    from diloco.trainer import model

    cfg = TransformerModel(layers=layers, d_model=d_model, heads=max(1, d_model // 64), context=128)
    shapes = jax.eval_shape(lambda: model.init_params(cfg, 0))
    rng = np.random.default_rng(0)
    return {k: (0.02 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in shapes.items()}


def make_core(params: dict[str, np.ndarray], fragments: int, quorum: int) -> Any:
    from diloco.spec import Syncer
    from diloco.syncer.metrics import SyncerMetrics
    from diloco.syncer.service import SyncerCore
    from diloco.syncer.state import GlobalModel

    spec = Syncer(quorum=quorum, fragments=fragments, outer_learning_rate=1.0, outer_momentum=0.0)
    return SyncerCore(spec, GlobalModel.fresh(spec, params), None, SyncerMetrics())


def time_rounds(params: dict[str, np.ndarray], fragments: int, k: int, rounds: int) -> tuple[float, float, int]:
    """Seconds per admitted push and per closed round of k contributions, averaged over fragments;
    and the mean fp32 bytes of one fragment."""
    from diloco.core.codecs import encode_tensors
    from diloco.wire import pb

    core = make_core(params, fragments, k)
    plan = core.model.plan
    rng = np.random.default_rng(1)
    blobs = [[encode_tensors({n: (1e-3 * rng.standard_normal(params[n].shape)).astype(np.float32)
                              for n in plan.fragments[p]}, "int4") for _ in range(k)] for p in range(fragments)]
    secrets = [core.open_session(f"l{j}", process=j + 1, supersede=False) for j in range(k)]
    admit_total, merge_total, pushes, merges = 0.0, 0.0, 0, 0
    for _ in range(rounds):
        for p in range(fragments):
            for j in range(k):
                h = pb.PushHeader(learner=f"l{j}", region="r", incarnation=core.incarnation, fragment=p,
                                  base_version=core.model.versions[p], steps=4, tokens=4096, step_seconds=0.0,
                                  total_bytes=len(blobs[p][j]), loss=2.0, session_secret=secrets[j])
                t0 = time.perf_counter()
                reply = core.admit(h, blobs[p][j])
                admit_total += time.perf_counter() - t0
                pushes += 1
                assert reply.accepted, reply.reason
            t0 = time.perf_counter()
            done = core.merge_ready()
            merge_total += time.perf_counter() - t0
            merges += len(done)
            assert done == [p], done
    frag_bytes = 4 * sum(v.size for v in params.values()) // fragments
    return admit_total / pushes, merge_total / merges, frag_bytes


def time_publish(params: dict[str, np.ndarray], fragments: int) -> tuple[float, float, str]:
    """Seconds and bytes to publish one fragment to one subscriber, as `SyncerCore.updates` does:
    encode Θ_p − held in the broadcast codec, decode it, advance held by what was decoded."""
    from diloco.core.codecs import decode_tensors, encode_tensors
    from diloco.spec import Syncer

    spec = Syncer(fragments=fragments)
    core = make_core(params, fragments, 1)
    rng = np.random.default_rng(2)
    seconds, size = 0.0, 0
    for p in range(fragments):
        values = core.model.fragment(p)
        held = {n: v - (1e-3 * rng.standard_normal(v.shape)).astype(np.float32) for n, v in values.items()}

        def publish() -> int:
            blob = encode_tensors({n: values[n] - held[n] for n in values}, spec.broadcast_compression,
                                  spec.block_size)
            decoded = decode_tensors(blob)
            _ = {n: held[n] + decoded[n] for n in values}
            return len(blob)

        size += publish()
        seconds += best_seconds(publish, repeats=3, min_seconds=0.0)
    return seconds / fragments, size / fragments, spec.broadcast_compression


def grpc_throughput(params: dict[str, np.ndarray]) -> float:
    """Bytes/s of a full-model Join from a real gRPC server (both ends in this process)."""
    from concurrent import futures

    import grpc

    from diloco.local.procs import free_port
    from diloco.syncer.servicer import SyncerServicer
    from diloco.wire import GRPC_OPTIONS, auth_metadata, pb, rpc

    core = make_core(params, 4, 1)
    token = secrets.token_hex(16)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    rpc.add_SyncerServicer_to_server(SyncerServicer(core, token), server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
    stub = rpc.SyncerStub(channel)
    req = pb.JoinRequest(learner="bench", region="r",
                         tensors=[pb.TensorShape(name=n, shape=list(v.shape)) for n, v in sorted(params.items())])
    try:
        def join() -> int:
            return sum(len(c.data) for c in stub.Join(req, metadata=auth_metadata(token), timeout=120))

        size = join()
        seconds = best_seconds(join, repeats=3, min_seconds=0.0)
    finally:
        channel.close()
        server.stop(0)
    return size / seconds


def capacity(step: float, a: float, m_of_k: Any, pub: float, best: bool) -> int:
    """Largest M a single syncer core keeps up with at step time `step` (capped at 100000);
    `pub` is the cost of publishing one fragment to one subscriber (CPU plus transfer)."""
    m = 0
    while m < 100_000:
        nxt = m + 1
        load = (nxt * a + m_of_k(nxt) + nxt * pub) / step if best else nxt / step * (a + m_of_k(1) + nxt * pub)
        if load > 1.0:
            break
        m = nxt
    return m


def memcpy_bytes_per_second() -> float:
    """This machine's copy bandwidth on 64 MiB, the yardstick every figure is a ratio to."""
    big = np.ones(64 << 18, dtype=np.float32)
    dst = np.empty_like(big)
    return big.nbytes / best_seconds(lambda: np.copyto(dst, big), repeats=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="2x128,4x512,12x768", help="LAYERSxDMODEL, comma separated")
    parser.add_argument("--fragments", type=int, default=24, help="P (capped at the model's tensor count)")
    parser.add_argument("--step-seconds", default="0.05,0.2,1.0")
    parser.add_argument("--quorums", default="1,4,16", help="round sizes K measured")
    parser.add_argument("--rounds", type=int, default=2, help="passes over all fragments per K")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.models, args.quorums, args.rounds, args.step_seconds = "2x64", "1,2", 1, "0.05"
    t_start = time.monotonic()
    ks = [int(k) for k in args.quorums.split(",")]
    steps = [float(s) for s in args.step_seconds.split(",")]

    memcpy = memcpy_bytes_per_second()

    models, caps = [], []
    for spec in args.models.split(","):
        layers, d_model = (int(x) for x in spec.split("x"))
        params = model_params(layers, d_model)
        n = sum(v.size for v in params.values())
        p = min(args.fragments, len(params))
        timings = {k: time_rounds(params, p, k, args.rounds) for k in ks}
        a = float(np.mean([timings[k][0] for k in ks]))
        f = timings[ks[0]][2]
        mk = {k: timings[k][1] for k in ks}
        # m(K) is linear in K: fit through the measured round sizes.
        slope, intercept = np.polyfit(ks, [mk[k] for k in ks], 1) if len(ks) > 1 else (0.0, mk[ks[0]])

        def m_of_k(k: int, slope: float = float(slope), intercept: float = float(intercept)) -> float:
            return max(intercept + slope * k, 0.0)

        g = grpc_throughput(params)
        c, b, codec = time_publish(params, p)
        pub = c + b / g
        kmax = max(ks)
        row = {"model": f"{layers}L d{d_model}", "parameters": int(n), "fragments": p,
               "fragment_mib": f / 2**20, "admit_ms": 1e3 * a,
               **{f"merge_k{k}_ms": 1e3 * mk[k] for k in ks},
               "publish_ms": 1e3 * c, "publish_kib": b / 1024, "broadcast_codec": codec,
               "grpc_gb_s": g / 1e9, "memcpy_gb_s": memcpy / 1e9,
               # fp32 input each path reads (int4 admission decodes into fp32 of the same size)
               "admit_ratio_to_memcpy": (f / a) / memcpy,
               "merge_ratio_to_memcpy": (kmax * f / mk[kmax]) / memcpy}
        models.append(row)
        for step in steps:
            caps.append({"model": row["model"], "parameters": int(n), "fragments": p, "step_seconds": step,
                         "max_learners_worst": capacity(step, a, m_of_k, pub, best=False),
                         "max_learners_best": capacity(step, a, m_of_k, pub, best=True)})
        print(f"{row['model']}: measured", flush=True)

    cols = [("model", "model", ""), ("parameters", "params", ",d"), ("fragments", "P", "d"),
            ("fragment_mib", "frag MiB", ".2f"), ("admit_ms", "admit ms", ".2f")]
    cols += [(f"merge_k{k}_ms", f"merge K={k} ms", ".2f") for k in ks]
    cols += [("publish_ms", "publish ms", ".2f"), ("publish_kib", "publish KiB", ",.0f"), ("grpc_gb_s", "gRPC GB/s", ".2f"), ("admit_ratio_to_memcpy", "admit/memcpy", ".3f"),
             ("merge_ratio_to_memcpy", f"merge K={max(ks)}/memcpy", ".3f")]
    print(f"memcpy {memcpy / 1e9:.2f} GB/s")
    print(common.table(models, cols))
    print()
    print("learners one syncer core keeps up with (worst: every push its own round; best: rounds gather all M)")
    print(common.table(caps, [("model", "model", ""), ("fragments", "P", "d"), ("step_seconds", "step s", ".2f"),
                              ("max_learners_worst", "max M (worst)", ",d"),
                              ("max_learners_best", "max M (best)", ",d")]))
    common.emit({"bench": "syncer_scale", "memcpy_gb_s": memcpy / 1e9, "models": models, "capacity": caps,
                 "seconds": round(time.monotonic() - t_start, 1), **common.machine()})


if __name__ == "__main__":
    main()
