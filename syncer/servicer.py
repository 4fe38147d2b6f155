"""The syncer's gRPC transport: token check, chunk assembly, status. Decisions live in SyncerCore."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator
from typing import TypeVar

import grpc

from diloco.syncer.service import MAX_ID, LearnerInfo, Refused, SyncerCore
from diloco.wire import chunks, pb, token_matches

log = logging.getLogger("diloco.syncer")


Chunk = TypeVar("Chunk", pb.PushChunk, pb.RecoverChunk)


def _assemble(first: pb.PushChunk | pb.RecoverChunk, rest: Iterator, declared: int, what: str) -> bytes:
    """Join a client stream's chunks, refusing a body longer or shorter than its header said."""
    buf = bytearray()
    for chunk in itertools.chain([first], rest):
        buf += chunk.data
        if len(buf) > declared:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{what} is larger than its declared {declared} bytes")
    if len(buf) != declared:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{what} is truncated: {len(buf)} of {declared} declared bytes")
    return bytes(buf)


class SyncerServicer:
    """The transport: token check, chunk assembly, status. All decisions are in SyncerCore."""

    def __init__(self, core: SyncerCore, token: str):
        self.core, self.token = core, token

    def _auth(self, context: grpc.ServicerContext) -> None:
        if not token_matches(context.invocation_metadata(), self.token):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong job token")

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> Iterator[pb.JoinChunk]:
        self._auth(context)
        core = self.core
        if not request.learner or len(request.learner) > MAX_ID:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "learner id must be 1-128 characters")
        theirs = {t.name: tuple(t.shape) for t in request.tensors}
        if theirs != core.model.shapes():
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "the learner's model does not match the syncer's (different spec.model?)")
        with self._refusals(context):
            secret = core.open_session(request.learner, request.process, request.supersede)
        with core.lock:
            info = core.learners.setdefault(request.learner, LearnerInfo())
            info.region, info.last_seen = request.region, core.clock()
            info.joins += 1
        # The broadcast view (what every subscriber holds), so the subscription continues its chain.
        versions, blob, tags = core.publisher.snapshot()
        core.metrics.joins.labels("readmission" if info.joins > 1 else "first").inc()
        log.info("learner %s joined (%s, join #%d)", request.learner, request.region, info.joins)
        header = pb.JoinHeader(
            incarnation=core.incarnation, versions=versions, total_bytes=len(blob),
            fragments=[pb.FragmentNames(names=list(f)) for f in core.model.plan.fragments],
            codec=core.spec.compression, block_size=core.spec.block_size, slot=core.book.next_slot, tags=tags,
            session_secret=secret,
        )
        core.count_sent(len(blob))
        for i, part in enumerate(chunks(blob)):
            yield pb.JoinChunk(header=header if i == 0 else None, data=bytes(part))

    def _opening(self, chunks: Iterator[Chunk], context: grpc.ServicerContext, what: str) -> Chunk:
        """A client stream's first chunk, which must carry the header."""
        self._auth(context)
        first = next(chunks, None)
        if first is None or not first.HasField("header"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"a {what} starts with a header")
        return first

    @contextlib.contextmanager
    def _refusals(self, context: grpc.ServicerContext) -> Iterator[None]:
        """A Refused becomes the RPC's status (counted by outcome); nothing else is caught."""
        try:
            yield
        except Refused as exc:
            self.core.count_refusal(exc.outcome)
            context.abort(exc.code, exc.reason)
            raise  # abort raises; this keeps type checkers honest

    def Push(self, request_iterator: Iterator[pb.PushChunk], context: grpc.ServicerContext) -> pb.PushReply:
        first = self._opening(request_iterator, context, "push")
        header = first.header
        with self._refusals(context):
            self.core.check_header(header)
            return self.core.admit(header, _assemble(first, request_iterator, header.total_bytes, "push"))

    def Subscribe(self, request: pb.SubscribeRequest, context: grpc.ServicerContext) -> Iterator[pb.Published]:
        self._auth(context)
        core = self.core
        if request.incarnation != core.incarnation:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"syncer restarted (incarnation {core.incarnation}); rejoin")
        with self._refusals(context):
            core.check_session(request.learner, request.session_secret)
        with core.lock:
            info = core.learners.setdefault(request.learner, LearnerInfo())
            info.subscriptions += 1
        core.set_active_gauges()
        try:
            for u in core.updates(list(request.known_versions), request.exact, context.is_active):
                sent = 0
                for part in chunks(u.blob):
                    sent += len(part)
                    last = sent >= len(u.blob)
                    yield pb.Published(fragment=u.fragment, version=u.version, total_bytes=len(u.blob),
                                       data=bytes(part), last=last, incarnation=core.incarnation, delta=u.is_delta,
                                       slot=u.slot + 1, tag=u.tag if last else b"")
                core.count_sent(len(u.blob))
        finally:
            with core.lock:
                info.subscriptions -= 1
            core.set_active_gauges()

    def Recover(self, request_iterator: Iterator[pb.RecoverChunk], context: grpc.ServicerContext) -> pb.RecoverReply:
        first = self._opening(request_iterator, context, "recovery")
        header = first.header
        with self._refusals(context):
            if header.total_bytes > self.core.max_recover_bytes:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"recover: {header.total_bytes} bytes is more than the model")
            blob = _assemble(first, request_iterator, header.total_bytes, "recover")
            adopted = self.core.recover(list(header.fragments), list(header.versions), blob, list(header.tags))
        with self.core.lock:
            return pb.RecoverReply(adopted=adopted, versions=list(self.core.model.versions))

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        self._auth(context)
        core = self.core
        with core.lock:
            now = core.clock()
            learners = [
                pb.LearnerStatus(learner=n, region=i.region, joins=i.joins, contributions=i.contributions,
                                 tokens=i.tokens, seconds_since_seen=now - i.last_seen, loss=i.loss,
                                 bytes_received=i.bytes_received)
                for n, i in sorted(core.learners.items())
            ]
            return pb.StatusReply(
                incarnation=core.incarnation, versions=list(core.model.versions),
                outer_steps=core.model.outer_steps, tokens_merged=core.model.tokens_merged,
                active_learners=len(core.active_learners()), learners=learners,
                seconds_since_publish=now - core.last_publish, checkpoint_version=core.checkpoint_version,
                grace_seconds=core.book.timings.grace(core.book.policy), step_seconds=core.book.timings.step.get(),
                contributions_refused=core.refused, bytes_received=core.bytes_received, bytes_sent=core.bytes_sent,
                regions=core.region_status(), max_norm_ratio=core.max_norm_ratio_seen,
            )
