"""The syncer's gRPC transport: token check, chunk assembly, status. Decisions live in SyncerCore."""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator

import grpc
import numpy as np

from diloco.syncer.acceptance import Refused
from diloco.syncer.core import SyncerCore
from diloco.syncer.joins.pacing import Pacer
from diloco.syncer.joins.seeding import ANOTHER_SEED
from diloco.syncer.publisher import Update
from diloco.wire import CHUNK_BYTES, Chunk, authenticate, chunks, framed, pb

log = logging.getLogger("diloco.syncer")


# Serialised deltas kept: a subscriber up to three publishes behind still shares them. One per
# fragment, as before, held a whole model's worth of int8 deltas (1 GB at 1e9 parameters) that
# the publisher's own chain already keeps.
WIRE_CACHE = 4
DATA_FIELD = pb.Published.DESCRIPTOR.fields_by_name["data"].number
JOIN_DATA_FIELD = pb.JoinChunk.DESCRIPTOR.fields_by_name["data"].number
STATE_DATA_FIELD = pb.StateChunk.DESCRIPTOR.fields_by_name["data"].number


def _assemble(first: Chunk, rest: Iterator[Chunk], declared: int, what: str) -> memoryview:
    """Join a client stream's chunks into one buffer of the declared size (bounded by the header
    check before this), refusing a body longer or shorter than the header said, or a malformed
    chunk. One copy per byte: a 1e9-parameter job's pushes are tens of MB each, several per second."""
    buf, got = np.empty(declared, np.uint8).data, 0  # empty: no zero-filling pass
    for chunk in itertools.chain([first], rest):
        if chunk.error:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {chunk.error}")
        data = chunk.data
        n = len(data)
        if got + n > declared:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{what} is larger than its declared {declared} bytes")
        buf[got:got + n] = data
        got += n
    if got != declared:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{what} is truncated: {got} of {declared} declared bytes")
    return buf


class SyncerServicer:
    """The transport: token check, chunk assembly, status. All decisions are in SyncerCore."""

    def __init__(self, core: SyncerCore, token: str):
        self.core, self.token = core, token
        # Each delta's Published messages, serialised once for every subscriber (diloco.wire
        # add_syncer sends bytes as they are): the newest WIRE_CACHE, which every subscriber
        # keeping up takes; one further behind costs a serialisation of its own.
        self._wire: OrderedDict[tuple[int, int, bool], list[bytes]] = OrderedDict()
        self._wire_lock = threading.Lock()
        self.pacer = Pacer(core.spec.join_bytes_per_second)  # Joins and relayed state share it (syncer/joins/pacing.py)

    def _messages(self, u: Update) -> list[bytes]:
        """Deltas are cached: every up-to-date subscriber takes the same one. A keyframe (fp32, 8x
        a delta's size) goes to the rare subscriber that fell behind: serialised for it alone."""
        if not u.is_delta:
            return self._serialise(u)
        key = (u.fragment, u.version, u.is_delta)
        with self._wire_lock:
            if key in self._wire:
                self._wire.move_to_end(key)
                return self._wire[key]
            parts = self._wire[key] = self._serialise(u)
            while len(self._wire) > WIRE_CACHE:
                self._wire.popitem(last=False)
            return parts

    def _serialise(self, u: Update) -> list[bytes]:
        """The update's Published messages: two heads serialised (every chunk but the last, and
        the last, which carries the tag), each chunk's data framed after one (diloco.wire.framed).
        A protobuf message per chunk was 44 arenas freed per 1e9 publish, and upb trims the heap
        every 10,000 (diloco.wire.Chunk says what that costs)."""
        parts, job_tokens = list(chunks(u.blob)), self.core.job_tokens()

        def head(last: bool) -> bytes:
            return pb.Published(fragment=u.fragment, version=u.version, total_bytes=len(u.blob), last=last,
                                incarnation=self.core.incarnation, delta=u.is_delta, slot=u.slot + 1,
                                tag=u.tag if last else b"", job_tokens=job_tokens).SerializeToString()

        middle, final = head(False) if len(parts) > 1 else b"", head(True)
        return [framed(final if i == len(parts) - 1 else middle, DATA_FIELD, part) for i, part in enumerate(parts)]

    def _pace(self, n: int) -> None:
        """A re-admission stream's next `n` bytes: paced while learners push (rounds are waiting),
        at once while nobody does (every learner re-joining a restarted syncer)."""
        if self.core.rounds_running():
            self.pacer.take(n)

    def _auth(self, context: grpc.ServicerContext) -> None:
        authenticate(context, self.token)

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        self._auth(context)
        with self._refusals(context):
            header, model = self.core.join(request)
        self.core.count_sent(model.size)
        first = pb.JoinChunk(header=header).SerializeToString()
        for i, span in enumerate(model.spans(CHUNK_BYTES)):  # framed by hand: one copy, no upb arena per chunk
            self._pace(sum(len(s) for s in span))
            yield framed(first if i == 0 else b"", JOIN_DATA_FIELD, *span)

    def _opening(self, chunks: Iterator[Chunk], context: grpc.ServicerContext, what: str) -> Chunk:
        """A client stream's first chunk, which must be well formed and carry the header."""
        self._auth(context)
        first = next(chunks, None)
        if first is not None and first.error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {first.error}")
        if first is None or first.header is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"a {what} starts with a header")
        return first

    @contextlib.contextmanager
    def _refusals(self, context: grpc.ServicerContext) -> Iterator[None]:
        """A Refused becomes the RPC's status (counted by outcome, if it has one); nothing else is caught."""
        try:
            yield
        except Refused as exc:
            if exc.outcome:
                self.core.count_refusal(exc.outcome)
            context.abort(exc.code, exc.reason)
            raise  # abort raises; this keeps type checkers honest

    def Push(self, request_iterator: Iterator[Chunk], context: grpc.ServicerContext) -> pb.PushReply:
        return self._push(self._opening(request_iterator, context, "push"), request_iterator, context)

    def PushOne(self, request: Chunk, context: grpc.ServicerContext) -> pb.PushReply:
        return self._push(self._opening(iter([request]), context, "push"), iter(()), context)

    def _push(self, first: Chunk, rest: Iterator[Chunk], context: grpc.ServicerContext) -> pb.PushReply:
        header = first.header
        with self._refusals(context):
            return self.core.admit(header, lambda: _assemble(first, rest, header.total_bytes, "push"))

    def Subscribe(self, request: pb.SubscribeRequest, context: grpc.ServicerContext) -> Iterator[pb.Published]:
        self._auth(context)
        core = self.core
        if request.incarnation != core.incarnation:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"syncer restarted (incarnation {core.incarnation}); rejoin")
        with self._refusals(context):
            core.check_session(request.learner, request.session_secret)
        with core.subscribed(request.learner):
            for u in core.updates(list(request.known_versions), request.exact, context.is_active):
                yield from self._messages(u)  # type: ignore[misc]  # bytes: sent as they are (add_syncer)
                core.count_sent(len(u.blob))

    def Recover(self, request_iterator: Iterator[Chunk], context: grpc.ServicerContext) -> pb.RecoverReply:
        first = self._opening(request_iterator, context, "recovery")
        header = first.header
        with self._refusals(context):
            adopted = self.core.recover(header, lambda: _assemble(first, request_iterator, header.total_bytes, "recover"))
        return pb.RecoverReply(adopted=adopted, versions=self.core.versions())

    def Seed(self, request_iterator: Iterator[pb.SeedChunk], context: grpc.ServicerContext) -> pb.SeedReply:
        """Seeded already (syncer/joins/seeding.py): an equal Θ₀ is answered as in, another refused."""
        self._auth(context)
        first = next(request_iterator, None)
        if first is None or not first.HasField("header"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a seed starts with a header")
        if not self.core.seeded_with(first.header.init_hash):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, ANOTHER_SEED)
        return pb.SeedReply(adopted=False)

    def FetchState(self, request: pb.FetchStateRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        self._auth(context)
        with self._refusals(context):
            self.core.check_session(request.learner, request.session_secret)
        got = self.core.fetch_state(request.learner, request.wait_seconds, context.is_active)
        if got is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "no peer shared its optimizer state in time")
            return
        log.info("relaying %s's optimizer state (%d bytes, step %d) to %s", got.donor, len(got.blob), got.count,
                 request.learner)
        first = pb.StateChunk(header=pb.StateHeader(learner=got.donor, count=got.count,
                                                    total_bytes=len(got.blob))).SerializeToString()
        for i, part in enumerate(chunks(got.blob)):  # paced and framed as a Join's model is
            self._pace(len(part))
            yield framed(first if i == 0 else b"", STATE_DATA_FIELD, part)
        self.core.count_sent(len(got.blob))

    def ShareState(self, request_iterator: Iterator[Chunk], context: grpc.ServicerContext) -> pb.ShareStateReply:
        first = self._opening(request_iterator, context, "state upload")
        header = first.header
        with self._refusals(context):
            if not self.core.share_state(header):
                return pb.ShareStateReply(relayed=False)
            blob = _assemble(first, request_iterator, header.total_bytes, "optimizer state")
        return pb.ShareStateReply(relayed=self.core.relay_state(header.learner, int(header.count), bytes(blob)))

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        self._auth(context)
        return self.core.status()
