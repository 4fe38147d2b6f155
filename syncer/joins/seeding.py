"""Before the first learner arrives: a syncer without a checkpoint holds no model.

The syncer runs no model code (its image needs no JAX, and a user's own model never has to be
importable there), so Θ₀ comes from the first learner that joins: its Join fails with
FAILED_PRECONDITION "unseeded shard S of N", it sends the tensors this syncer holds (`Seed`),
and joins again. The seed is checked as any outside input is: shapes, sizes, a fragment plan
they yield, finite values, and a hash the syncer recomputes; every later learner's Θ₀ must
hash the same (docs/ALGORITHM.md, "Models, devices and hosts").
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np

from diloco.core.codecs import CodecError, bundle_size, decode_tensors
from diloco.core.fragments import owned_by, plan_fragments, specs_from_shapes
from diloco.core.seed import seed_hash
from diloco.spec import Syncer as SyncerSpec
from diloco.syncer.acceptance import MAX_ID, Refused
from diloco.syncer.global_model import GlobalModel, placeholders
from diloco.wire import Chunk, authenticate, pb, unseeded_message

ANOTHER_SEED = "seed: the syncer was seeded with another Θ₀ (different spec.model or spec.data.seed)"
MAX_TENSORS = 1 << 16
MAX_ELEMENTS = 1 << 36  # 256 GiB of fp32: far above any model one syncer shard could hold


def _bad(why: str) -> Refused:
    return Refused(grpc.StatusCode.INVALID_ARGUMENT, f"seed: {why}", outcome="malformed")


def seed_layout(spec: SyncerSpec, shard: int, header: pb.SeedHeader
                ) -> tuple[dict[str, tuple[int, ...]], list[int], dict[str, tuple[int, ...]]]:
    """(every tensor's shape, this shard's fragments, the shapes of the tensors it holds) that a
    Seed's header describes, or Refused naming what is wrong with it: checked before a byte of
    the model is received, so the syncer knows the bundle's exact size."""
    if not header.learner or len(header.learner) > MAX_ID:
        raise _bad("learner id must be 1-128 characters")
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in header.tensors}
    if not shapes or len(shapes) != len(header.tensors) or len(shapes) > MAX_TENSORS:
        raise _bad(f"{len(header.tensors)} tensors with {len(shapes)} distinct names; send each tensor once")
    if any(not n or not s or min(s) < 1 for n, s in shapes.items()):
        raise _bad("every tensor needs a name and a shape of positive sizes")
    if sum(math.prod(s) for s in shapes.values()) > MAX_ELEMENTS:
        raise _bad("the model is larger than one syncer can hold")
    try:
        plan = plan_fragments(specs_from_shapes(shapes), spec.plan_size, spec.fragmentation)
    except ValueError as exc:
        raise _bad(f"the tensors give no plan of spec.syncer.fragments {spec.fragments} x shards {spec.shards}: "
                   f"{exc}") from None
    owned = list(owned_by(shard, plan.num_fragments, spec.shards))
    return shapes, owned, {n: shapes[n] for p in owned for n in plan.fragments[p]}


def seeded_model(spec: SyncerSpec, shard: int, header: pb.SeedHeader, blob: bytes | memoryview) -> GlobalModel:
    """The global model Θ₀ a Seed describes, or Refused naming what is wrong with it."""
    shapes, owned, held = seed_layout(spec, shard, header)
    try:
        values = decode_tensors(blob, held)
    except CodecError as exc:
        raise _bad(f"the bundle does not hold this shard's tensors as fp32: {exc}") from None
    if not all(np.isfinite(v).all() for v in values.values()):
        raise _bad("Θ₀ has non-finite values")
    digest = seed_hash(values)
    if digest != header.init_hash:
        raise _bad("init_hash does not match the tensors sent")
    model = GlobalModel.fresh(spec, {**placeholders(shapes), **values}, owned, copy=False)  # the decoded arrays are ours
    model.init_hash = digest
    return model


def receive_seed(first: pb.SeedChunk, rest: Iterator[pb.SeedChunk], size: int) -> memoryview:
    """A Seed's bundle, written into one buffer of the size its header implies: no growing buffer
    and no copy into `bytes` (for a 1e9-parameter model those were 8-12 GB beside the 4 GB
    model, and a syncer keeps freed memory, so they stayed its resident size)."""
    buf = np.empty(size, np.uint8)
    pos = 0
    for data in itertools.chain([first.data], (chunk.data for chunk in rest)):
        if pos + len(data) > size:
            raise _bad(f"larger than the {size} bytes its header implies")
        buf[pos : pos + len(data)] = np.frombuffer(data, np.uint8)
        pos += len(data)
    if pos != size:
        raise _bad(f"{pos} of {size} bytes")
    return buf.data


class Unseeded:
    """The servicer while no model exists: Seed builds one (once) and hands it to `on_seed`,
    which starts the syncer proper and switches the RPCs to it before the seed is answered (so
    the seeding learner's next Join finds it); Join says the model is missing; the rest wait."""

    def __init__(self, spec: SyncerSpec, shard: int, token: str, *, on_seed: Callable[[GlobalModel], Any],
                 incarnation: str = "") -> None:
        self.spec, self.shard, self.token, self.on_seed = spec, shard, token, on_seed
        self.incarnation = incarnation
        self.lock = threading.Lock()
        self.model: GlobalModel | None = None
        self.started: Any = None  # what on_seed returned
        self.seeded = threading.Event()

    def _auth(self, context: grpc.ServicerContext) -> None:
        authenticate(context, self.token)

    def Seed(self, request_iterator: Iterator[pb.SeedChunk], context: grpc.ServicerContext) -> pb.SeedReply:
        self._auth(context)
        first = next(request_iterator, None)
        if first is None or not first.HasField("header"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a seed starts with a header")
        declared = first.header.total_bytes
        if declared > 4 * MAX_ELEMENTS + MAX_TENSORS * 1024:  # fp32 values plus the bundle's headers
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"seed: {declared} bytes is more than one syncer holds")
        try:
            _, _, held = seed_layout(self.spec, self.shard, first.header)
            size = bundle_size(held, "fp32")
            if declared != size:
                raise _bad(f"the bundle does not hold this shard's tensors as fp32: {declared} bytes declared, "
                           f"{size} expected from the shapes")
            model = seeded_model(self.spec, self.shard, first.header, receive_seed(first, request_iterator, size))
        except Refused as exc:
            context.abort(exc.code, exc.reason)
        with self.lock:
            if self.model is None:
                self.started = self.on_seed(model)
                self.model = model
                self.seeded.set()
                return pb.SeedReply(adopted=True)
            same = self.model.init_hash == model.init_hash
        if not same:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, ANOTHER_SEED)
        return pb.SeedReply(adopted=False)

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> Iterator[pb.JoinChunk]:
        self._auth(context)
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, unseeded_message(self.shard, self.spec.shards))
        yield from ()

    def _waiting(self, context: grpc.ServicerContext) -> Any:
        self._auth(context)
        context.abort(grpc.StatusCode.UNAVAILABLE, "the syncer waits for its first learner's initial model")

    def Push(self, request_iterator: Iterator[Chunk], context: grpc.ServicerContext) -> pb.PushReply:
        return self._waiting(context)

    def PushOne(self, request: Chunk, context: grpc.ServicerContext) -> pb.PushReply:
        return self._waiting(context)

    def Subscribe(self, request: pb.SubscribeRequest, context: grpc.ServicerContext) -> Iterator[pb.Published]:
        self._waiting(context)
        yield from ()

    def Recover(self, request_iterator: Iterator[Chunk], context: grpc.ServicerContext) -> pb.RecoverReply:
        return self._waiting(context)

    def FetchState(self, request: pb.FetchStateRequest, context: grpc.ServicerContext) -> Iterator[pb.StateChunk]:
        self._waiting(context)
        yield from ()

    def ShareState(self, request_iterator: Iterator[Chunk], context: grpc.ServicerContext) -> pb.ShareStateReply:
        return self._waiting(context)

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        """Up, and saying what it waits for: dashboards and the operator show it, nothing is merged."""
        self._auth(context)
        return pb.StatusReply(incarnation=self.incarnation, versions=[0] * self.spec.plan_size, shard=self.shard,
                              shards=self.spec.shards, unseeded=True)


FENCED = "this syncer's lease has lapsed (spec.syncer.standby): it publishes nothing; try its standby"


class Switch:
    """The servicer gRPC holds: every call goes to the current one (Unseeded, then the syncer's),
    looked up per call, since gRPC binds a servicer's methods once at registration.

    `gate` (a syncer with a standby: its leader lease's `valid`, syncer/durable/leader.py) is
    asked at every call and before every message of a stream: while it says no, calls end
    UNAVAILABLE, so a syncer whose lease lapsed (frozen, cut off) sends nothing, and learners
    try their other address."""

    def __init__(self, current: Any, gate: Callable[[], bool] | None = None) -> None:
        self.current = current
        self.gate = gate
        self.withheld = 0  # calls and stream messages the gate stopped

    def _check(self, context: Any) -> None:
        if self.gate is not None and not self.gate():
            self.withheld += 1
            context.abort(grpc.StatusCode.UNAVAILABLE, FENCED)

    def _unary(self, method: str, request: Any, context: Any) -> Any:
        self._check(context)
        return getattr(self.current, method)(request, context)

    def _stream(self, method: str, request: Any, context: Any) -> Iterator[Any]:
        self._check(context)
        for message in getattr(self.current, method)(request, context):
            self._check(context)
            yield message

    def Join(self, request: Any, context: Any) -> Any:
        return self._stream("Join", request, context)

    def Push(self, request_iterator: Any, context: Any) -> Any:
        return self._unary("Push", request_iterator, context)

    def PushOne(self, request: Any, context: Any) -> Any:
        return self._unary("PushOne", request, context)

    def Subscribe(self, request: Any, context: Any) -> Any:
        return self._stream("Subscribe", request, context)

    def Status(self, request: Any, context: Any) -> Any:
        return self._unary("Status", request, context)

    def Recover(self, request_iterator: Any, context: Any) -> Any:
        return self._unary("Recover", request_iterator, context)

    def Seed(self, request_iterator: Any, context: Any) -> Any:
        return self._unary("Seed", request_iterator, context)

    def FetchState(self, request: Any, context: Any) -> Any:
        return self._stream("FetchState", request, context)

    def ShareState(self, request_iterator: Any, context: Any) -> Any:
        return self._unary("ShareState", request_iterator, context)
