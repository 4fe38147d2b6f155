"""What one push costs the learner's gRPC client: the unary PushOne against the client-streaming Push.

    python bench/push_rpc.py [--kb 60] [--calls 500] [--rounds 3]

A learner pushes one fragment per step; at the quickstart's size that is a ~60 KB int4 bundle,
one chunk. gRPC's Python client starts a thread to drain the request iterator of every
client-streaming call, a unary call does not. This bench sends the same PushChunk both ways
to a server that answers at once (its own process on core 1; the client on core 0), after a
warm-up, alternating A/B `--rounds` times, and reports the client's CPU time per call (all
its threads: `time.process_time`). Last line: JSON with `stream_over_unary_cpu` and the
per-call figures in ms.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent import futures
from typing import Any

import grpc

from diloco.wire import GRPC_OPTIONS, chunks, pb, rpc

SERVICE = "diloco.v1.Syncer"


def serve(port: int) -> None:
    """Push and PushOne of the real schema, answering `accepted` without admitting anything."""

    def push(request_iterator: Any, context: Any) -> pb.PushReply:
        for _ in request_iterator:
            pass
        return pb.PushReply(accepted=True)

    def push_one(request: pb.PushChunk, context: Any) -> pb.PushReply:
        return pb.PushReply(accepted=True)

    handlers = grpc.method_handlers_generic_handler(SERVICE, {
        "Push": grpc.stream_unary_rpc_method_handler(push, pb.PushChunk.FromString, pb.PushReply.SerializeToString),
        "PushOne": grpc.unary_unary_rpc_method_handler(push_one, pb.PushChunk.FromString, pb.PushReply.SerializeToString),
    })
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((handlers,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


def per_call(call: Any, calls: int) -> float:
    """Client CPU seconds per call, after a warm-up."""
    for _ in range(min(50, calls)):
        call()
    cpu = time.process_time()
    for _ in range(calls):
        call()
    return (time.process_time() - cpu) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kb", type=int, default=60, help="bundle size (default 60: a quickstart fragment at int4)")
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="50 calls, one round")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.calls, args.rounds = 50, 1
    if args.serve is not None:
        serve(args.serve)
        return
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[0]})
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    server = subprocess.Popen(["taskset", "-c", str(cores[-1]), sys.executable, "-P", __file__, "--serve", str(port)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
        stub = rpc.SyncerStub(channel)
        blob = os.urandom(args.kb * 1024)
        header = pb.PushHeader(learner="bench-0", fragment=0, steps=1, total_bytes=len(blob))
        msgs = [pb.PushChunk(header=header if i == 0 else None, data=bytes(c)) for i, c in enumerate(chunks(blob))]
        if len(msgs) != 1:
            raise SystemExit(f"--kb {args.kb}: the bundle is {len(msgs)} chunks; PushOne carries one")
        stream, unary = [], []
        for _ in range(args.rounds):
            stream.append(per_call(lambda: stub.Push(iter(msgs), timeout=10), args.calls))
            unary.append(per_call(lambda: stub.PushOne(msgs[0], timeout=10), args.calls))
        channel.close()
    finally:
        server.kill()
        server.wait()
    s_ms, u_ms = 1e3 * sum(stream) / len(stream), 1e3 * sum(unary) / len(unary)
    print(f"client CPU per push of {args.kb} KB: Push (client stream) {s_ms:.3f} ms, PushOne (unary) {u_ms:.3f} ms")
    print(json.dumps({"bench": "push_rpc", "kb": args.kb, "calls": args.calls, "rounds": args.rounds,
                      "stream_cpu_ms": [round(1e3 * x, 4) for x in stream],
                      "unary_cpu_ms": [round(1e3 * x, 4) for x in unary],
                      "stream_over_unary_cpu": round(s_ms / u_ms, 3)}))


if __name__ == "__main__":
    main()
