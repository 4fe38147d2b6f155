"""An in-process syncer on loopback with a small numpy model, for RPC-level tests."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import numpy as np

from diloco.checkpoint import CheckpointStore
from diloco.core.codecs import encode_tensors
from diloco.spec import Syncer as SyncerSpec
from diloco.syncer.core import SyncerCore
from diloco.syncer.global_model import GlobalModel
from diloco.syncer.metrics import SyncerMetrics
from diloco.syncer.servicer import SyncerServicer
from diloco.wire import GRPC_OPTIONS, add_syncer, auth_metadata, pb, push_chunks, rpc, server_options

TOKEN = "test-token-0123456789"
TOKENS_PER_STEP = 512  # the harness job's batchSize x context: pushes report steps x this
SHAPES = {"embed/embedding": (16, 8), "layers_0/up/kernel": (8, 32), "layers_0/down/kernel": (32, 8), "head/kernel": (8, 16)}


def params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


class FakeClock:
    """Injected time: grace windows elapse when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Harness:
    core: SyncerCore
    clock: FakeClock
    server: grpc.Server
    channel: grpc.Channel
    stub: rpc.SyncerStub
    push_ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    secrets: dict[str, bytes] = field(default_factory=dict)
    port: int = 0

    def secret(self, learner: str) -> bytes:
        """The session secret of `learner`, opening a session as its Join would."""
        if learner not in self.secrets:
            self.secrets[learner] = self.core.open_session(learner, process=1, supersede=True)
        return self.secrets[learner]

    def push(self, fragment: int, tensors: dict[str, np.ndarray] | None = None, blob: bytes | None = None,
             token: str = TOKEN, learner: str = "a-0", base_version: int | None = None, steps: int = 4,
             total_bytes: int | None = None, codec: str = "int4", session: int = 1, push_id: int | None = None,
             slot: int | None = None, session_tokens: int | None = None, secret: bytes | None = None,
             unary: bool = False, tokens: int | None = None) -> pb.PushReply:
        """A push as the learner's client makes it; `unary`: through PushOne (one chunk)."""
        if blob is None:
            blob = encode_tensors(tensors or {}, codec)  # type: ignore[arg-type]
        header = pb.PushHeader(
            learner=learner, region="r", incarnation=self.core.incarnation, fragment=fragment,
            base_version=(self.core.model.versions + [0] * 8)[fragment] if base_version is None else base_version,
            steps=steps, tokens=steps * TOKENS_PER_STEP if tokens is None else tokens, step_seconds=0.05,
            total_bytes=len(blob) if total_bytes is None else total_bytes, session=session,
            push_id=next(self.push_ids) if push_id is None else push_id,
            slot=fragment // self.core.spec.shards if slot is None else slot,  # core/schedule.py due_fragments
            session_tokens=steps * TOKENS_PER_STEP if session_tokens is None else session_tokens,
            session_secret=self.secret(learner) if secret is None else secret,
        )
        msgs = list(push_chunks(header, blob))
        if unary:
            assert len(msgs) == 1, "PushOne carries one chunk"
            return self.stub.PushOne(msgs[0], metadata=auth_metadata(token), timeout=10)
        return self.stub.Push(iter(msgs), metadata=auth_metadata(token), timeout=10)

    def fragment_tensors(self, p: int, fill: float = 0.01) -> dict[str, np.ndarray]:
        return {n: np.full(s, fill, np.float32) for n, s in self.core.model.shapes(p).items()}

    def close(self) -> None:
        self.channel.close()
        self.server.stop(0)


def start(spec: SyncerSpec | None = None, checkpoint_dir: str | None = None, model: GlobalModel | None = None,
          shard: int = 0) -> Harness:
    spec = spec or SyncerSpec(fragments=2)
    store = CheckpointStore(checkpoint_dir) if checkpoint_dir else None
    clock = FakeClock()
    core = SyncerCore(spec=spec, model=model or GlobalModel.fresh(spec, params()), store=store, metrics=SyncerMetrics(),
                      clock=clock, shard=shard, tokens_per_step=TOKENS_PER_STEP)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=server_options())
    add_syncer(SyncerServicer(core, TOKEN), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
    return Harness(core, clock, server, channel, rpc.SyncerStub(channel), port=port)
