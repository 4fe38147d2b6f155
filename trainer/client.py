"""The learner's side of the wire: join, a background sender and a background subscriber.

The training loop never waits on the network: it queues outer gradients for the sender
(each carries progress no other push carries, so none replaces another) and picks up,
at step boundaries, the fragments published since and what the syncer said of each
push (accepted into which version, or refused). Both threads reconnect with capped
exponential backoff while the loop keeps training.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import numpy as np

from diloco.contract import Event
from diloco.core.codecs import CODECS, CodecError, decode_tensors, encode_tensors
from diloco.core.fragments import owned_by
from diloco.core.ledger import Arrival
from diloco.core.seed import InitialModel

# Re-exported: callers import the client's vocabulary from here.
from diloco.trainer.messages import JoinRefused, JoinState, Outgoing, Unauthenticated, Updates
from diloco.wire import auth_metadata, channel, chunks, parse_unseeded, pb, push, rpc, seed_chunks

log = logging.getLogger("diloco.learner")
FATAL = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}


@dataclass
class Backoff:
    """Capped exponential backoff with jitter, so restarted learners do not stampede."""

    base: float = 0.2
    cap: float = 5.0
    attempt: int = 0
    rng: random.Random = field(default_factory=random.Random)

    def next(self) -> float:
        self.attempt += 1
        return min(self.cap, self.base * 2 ** (self.attempt - 1)) * (0.5 + self.rng.random() / 2)

    def reset(self) -> None:
        self.attempt = 0


class SyncerClient:
    """One syncer (or one shard of it), as the learner loop uses it (trainer/link.py, `SyncerLink`)."""

    # The first four stay positional: the tests pass them so. The defaults: events go nowhere (a
    # test or a tool, not a learner process); plaintext (TLS is opt-in: the learner's --tls-ca); and no
    # takeover of a live learner id (only the learner's first Join after a restart asks for one).
    def __init__(self, address: str, token: str, learner: str, region: str, *,
                 on_event: Callable[..., None] = lambda *a, **k: None,
                 tls_ca: bytes | None = None, tls_server_name: str | None = None, supersede: bool = False,
                 data: pb.DataListing | None = None):
        self.address, self.learner, self.region = address, learner, region
        self.data = data  # our copy's files, which every Join shows the syncer (diloco/copies.py)
        self.metadata = auth_metadata(token)
        self.channel = channel(address, tls_ca, tls_server_name)
        self.stub = rpc.SyncerStub(self.channel)
        self.emit = on_event
        self.incarnation = ""
        self.lock = threading.Condition()
        self.session = int.from_bytes(os.urandom(7), "little") | 1  # this process, as an origin of pushes
        # The first Join may take the learner id over from a live process (a restarted pod's dead
        # predecessor whose stream the syncer has not yet seen close); re-joins never do.
        self.supersede = supersede
        self.secret = b""  # the session secret of our latest Join
        self.push_one = True  # until a syncer without PushOne answers UNIMPLEMENTED
        self.outbox: deque[Outgoing] = deque()
        self.inbox: dict[int, Arrival] = {}
        self.accepted: list[tuple[int, int, int, bool]] = []
        self.refused: list[tuple[int, int]] = []
        self.share_state = False  # a push reply asked for our optimizer state (a peer re-joins)
        self.rejoined: JoinState | None = None
        self.known_versions: list[int] = []
        self.stopping = threading.Event()
        self.resync = threading.Event()
        self.wake = threading.Event()  # cuts the subscriber's backoff short after a re-join or at close
        self.sending = False
        self.bytes_sent = 0
        self.bytes_received = 0
        self.acked_train_seconds = 0.0
        self.expected_shapes: dict[str, tuple[int, ...]] = {}
        self.threads: list[threading.Thread] = []
        self._rejoining = threading.Lock()
        # Our copy of the global model as the syncer sent it (keyframes plus decoded deltas;
        # arrays are replaced, never mutated). It is also what we offer a restarted syncer.
        self.view: dict[str, np.ndarray] = {}
        self.view_exact = False  # True from a join until the first subscription uses it
        self.fragments: list[list[str]] = []
        self.owned: list[int] = []  # the fragments of the syncer (shard) we are connected to
        self.tags: list[bytes] = []  # per fragment: the provenance tag our copy came with
        # Which syncer shard this client talks to (the sharded client sets it), and our Θ₀: an
        # unseeded syncer (syncer/seeding.py) gets its part of it, every Join proves its hash.
        self.position = (0, 1)
        self.initial: InitialModel | None = None

    # -- join ------------------------------------------------------------------------

    def join(self, shapes: dict[str, tuple[int, ...]], timeout: float = 30.0) -> JoinState:
        try:
            return self._join(shapes, timeout)
        except grpc.RpcError as exc:
            where = parse_unseeded(exc.details() or "") if exc.code() == grpc.StatusCode.FAILED_PRECONDITION else None
            if where is None or self.initial is None:
                raise
        self._seed(shapes, *where)
        if self.view:  # a syncer that lost its state: hand it the newer fragments we hold first
            self._offer_recovery()
        return self._join(shapes, timeout)

    def _seed(self, shapes: dict[str, tuple[int, ...]], shard: int, shards: int) -> None:
        """Give an unseeded syncer (shard) our Θ₀ of its fragments; a learner that lost the race
        to seed it hears the seed is in."""
        assert self.initial is not None
        if (shard, shards) != self.position:
            raise JoinRefused(f"the syncer at {self.address} is shard {shard} of {shards}, not {self.position[0]} "
                              f"of {self.position[1]}: list every shard's address, in shard order")
        stream = seed_chunks(self.learner, shapes, self.initial.held_by(shard, shards))
        reply = self.stub.Seed(stream, metadata=self.metadata, timeout=600)
        log.info("seeded the syncer with Θ₀ (%s)", "adopted" if reply.adopted else "already seeded by a peer")

    def _join(self, shapes: dict[str, tuple[int, ...]], timeout: float) -> JoinState:
        request = pb.JoinRequest(
            learner=self.learner, region=self.region,
            tensors=[pb.TensorShape(name=n, shape=list(s)) for n, s in sorted(shapes.items())],
            process=self.session, supersede=self.supersede,
            init_hash=self.initial.hash_for(*self.position) if self.initial is not None else b"",
            data=self.data,
        )
        header, buf = None, bytearray()
        for chunk in self.stub.Join(request, metadata=self.metadata, timeout=timeout):
            if chunk.HasField("header"):
                header = chunk.header
            buf += chunk.data
        if header is None or len(buf) != header.total_bytes:
            raise ConnectionError("join stream ended early")
        codec = next((c for c in CODECS if c == header.codec), None)
        if codec is None:
            raise ConnectionError(f"the syncer asked for codec {header.codec!r}; this learner knows {', '.join(CODECS)}")
        shards = header.shards or 1
        if header.shard >= shards:
            raise ConnectionError(f"the syncer calls itself shard {header.shard} of {shards}")
        owned = list(owned_by(header.shard, len(header.fragments), shards))
        names = {n for p in owned for n in header.fragments[p].names}
        params = decode_tensors(bytes(buf), {n: s for n, s in shapes.items() if n in names})
        self.bytes_received += len(buf)
        self.expected_shapes = dict(shapes)
        with self.lock:
            self.supersede, self.secret = False, header.session_secret
            self.incarnation = header.incarnation
            self.known_versions = list(header.versions)
            self.fragments = [list(f.names) for f in header.fragments]
            self.owned = owned
            self.view, self.view_exact = dict(params), True
            self.tags = list(header.tags) + [b""] * (len(header.fragments) - len(header.tags))
            self.inbox.clear()
            self.outbox.clear()
        return JoinState(header.incarnation, list(header.versions), [list(f.names) for f in header.fragments],
                         params, codec, header.block_size, int(header.slot), owned, header.shard, shards,
                         int(header.resume_tokens), int(header.job_tokens))

    def join_with_retry(self, shapes: dict[str, tuple[int, ...]], initial: InitialModel | None = None) -> JoinState:
        if initial is not None:
            self.initial = initial
        backoff = Backoff()
        while not self.stopping.is_set():
            try:
                return self.join(shapes)
            except grpc.RpcError as exc:
                if exc.code() in FATAL:
                    raise Unauthenticated(exc.details()) from None
                if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
                    raise JoinRefused(f"syncer refused to admit this learner: {exc.details()}") from None
                wait = backoff.next()  # ALREADY_EXISTS: the id's live holder may be on its way out
                log.warning("join failed (%s); retrying in %.1fs", exc.code().name, wait)
            except ConnectionError as exc:
                wait = backoff.next()
                log.warning("join failed (%s); retrying in %.1fs", exc, wait)
            self.stopping.wait(wait)
        raise RuntimeError("stopped before joining")

    # -- background threads ----------------------------------------------------------

    def start(self) -> None:
        for target, name in ((self._send_loop, "sender"), (self._subscribe_loop, "subscriber")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self.threads.append(t)

    def submit(self, item: Outgoing) -> None:
        with self.lock:
            self.outbox.append(item)
            self.lock.notify_all()

    def take_updates(self) -> Updates:
        """Everything that arrived since the last step boundary: a full re-join, fragments,
        and the syncer's answers to our pushes."""
        with self.lock:
            out = Updates(self.rejoined, self.inbox, self.accepted, self.refused, self.share_state)
            self.rejoined, self.inbox, self.accepted, self.refused, self.share_state = None, {}, [], [], False
        return out

    def has_news(self) -> bool:
        with self.lock:
            return self._news()

    def wait_for_news(self, timeout: float) -> None:
        """Block until something arrives for the loop (used while flushing at the end)."""
        with self.lock:
            if not self._news():
                self.lock.wait(timeout)

    def _news(self) -> bool:  # the caller holds the lock
        return bool(self.inbox or self.accepted or self.refused or self.rejoined)

    def flush(self, timeout: float) -> bool:
        """Wait until the outbox is empty and nothing is in flight (used on SIGTERM)."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while self.outbox or self.sending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.lock.wait(remaining)
        return True

    def close(self) -> None:
        self.stopping.set()
        self.wake.set()
        with self.lock:
            self.lock.notify_all()
        self.channel.close()

    def _send_loop(self) -> None:
        backoff = Backoff()
        while not self.stopping.is_set():
            with self.lock:
                while not self.outbox and not self.stopping.is_set():
                    self.lock.wait(0.5)
                if self.stopping.is_set():
                    return
                item = self.outbox.popleft()
                if item.incarnation != self.incarnation:
                    continue  # made against a syncer that has since restarted: the re-join resets it
                self.sending = True
            try:
                reply = self._push(item)
                backoff.reset()
                self.bytes_sent += len(item.blob)
                with self.lock:
                    if reply.accepted:
                        self.acked_train_seconds = max(self.acked_train_seconds, item.train_seconds)
                        self.accepted.append((item.fragment, item.push_id, int(reply.merged_into), reply.late))
                        self.share_state |= reply.share_state
                    else:
                        self.refused.append((item.fragment, item.push_id))
                    self.lock.notify_all()
                if not reply.accepted:
                    self.emit(Event.PUSH_REFUSED, fragment=item.fragment, reason=reply.reason)
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.FAILED_PRECONDITION:
                    self._request_rejoin(item.incarnation)
                elif code in FATAL:
                    self.emit(Event.FATAL, reason=f"syncer refused this learner: {exc.details()}")
                    self.stopping.set()
                elif code == grpc.StatusCode.INVALID_ARGUMENT:
                    # The syncer found our outer gradient malformed or non-finite: our weights
                    # are suspect, so the loop starts over from the global model.
                    self.emit(Event.PUSH_REFUSED, fragment=item.fragment, reason=exc.details())
                    with self.lock:
                        self.refused.append((item.fragment, item.push_id))
                    self.resync.set()
                else:  # unreachable: send it again later (the syncer ignores a repeat it holds)
                    with self.lock:
                        self.outbox.appendleft(item)
                    self.stopping.wait(backoff.next())
            finally:
                with self.lock:
                    self.sending = False
                    self.lock.notify_all()

    def _push(self, item: Outgoing) -> pb.PushReply:
        """Through PushOne when it fits (wire.push); to a syncer that predates PushOne, through
        Push from the first UNIMPLEMENTED on."""
        header = pb.PushHeader(
            learner=self.learner, region=self.region, incarnation=item.incarnation, fragment=item.fragment,
            base_version=item.base_version, steps=item.steps, tokens=item.tokens,
            step_seconds=item.step_seconds, total_bytes=len(item.blob), loss=item.loss,
            session=self.session, push_id=item.push_id, slot=item.slot, trained_tokens=item.trained_tokens,
            session_secret=self.secret,
        )
        try:
            return push(self.stub, header, item.blob, self.metadata, timeout=60, unary=self.push_one)
        except grpc.RpcError as exc:
            if not self.push_one or exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            self.push_one = False
        return push(self.stub, header, item.blob, self.metadata, timeout=60, unary=False)

    def _request_rejoin(self, stale: str) -> None:
        """The syncer restarted: pull its whole state; the loop adopts it at a step boundary.
        Sender and subscriber may both notice; the second finds the work done."""
        with self._rejoining:
            if self.incarnation != stale:
                return
            self._rejoin()

    def _offer_recovery(self) -> None:
        """Give a restarted syncer the newest global fragments we hold (see Recover)."""
        with self.lock:
            view, versions, owned, tags = dict(self.view), list(self.known_versions), list(self.owned), list(self.tags)
        if not view or not owned or len(versions) != len(tags):
            return
        blob = encode_tensors(view, "fp32")  # the view holds the owned fragments' tensors only
        header = pb.RecoverHeader(learner=self.learner, fragments=owned, versions=[versions[p] for p in owned],
                                  total_bytes=len(blob), tags=[tags[p] for p in owned])
        msgs = (pb.RecoverChunk(header=header if i == 0 else None, data=bytes(part)) for i, part in enumerate(chunks(blob)))
        try:
            reply = self.stub.Recover(msgs, metadata=self.metadata, timeout=60)
        except grpc.RpcError as exc:
            log.warning("recovery offer failed: %s", exc.details())
            return
        if reply.adopted:
            self.emit(Event.RECOVERED, fragments=list(reply.adopted), versions=list(reply.versions))

    def _rejoin(self) -> None:
        self._offer_recovery()
        try:
            state = self.join_with_retry(self.expected_shapes)
        except RuntimeError as exc:  # Unauthenticated, JoinRefused, or stopped
            self.emit(Event.FATAL, reason=str(exc))
            self.stopping.set()
            return
        with self.lock:
            self.rejoined = state
        self.wake.set()  # the subscriber may be backing off from the old syncer: resubscribe now
        self.emit(Event.REJOINED, incarnation=state.incarnation)

    def _subscribe_loop(self) -> None:
        backoff = Backoff()
        while not self.stopping.is_set():
            with self.lock:
                incarnation = self.incarnation
                request = pb.SubscribeRequest(learner=self.learner, incarnation=incarnation,
                                              known_versions=list(self.known_versions), exact=self.view_exact,
                                              session_secret=self.secret)
                self.view_exact = False  # after this stream, our copy may hold decoded deltas
            try:
                self._consume(self.stub.Subscribe(request, metadata=self.metadata), backoff)
            except ConnectionError as exc:
                self.emit(Event.DISCONNECTED, reason=str(exc), retry_seconds=0)
            except grpc.RpcError as exc:
                if self.stopping.is_set():
                    return
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    self._request_rejoin(incarnation)
                    continue
                if exc.code() in FATAL:
                    self.emit(Event.FATAL, reason=f"syncer refused this learner: {exc.details()}")
                    self.stopping.set()
                    return
                wait = backoff.next()
                self.emit(Event.DISCONNECTED, reason=exc.code().name, retry_seconds=round(wait, 2))
                if self.wake.wait(wait):
                    self.wake.clear()
                    backoff.reset()

    def _consume(self, stream, backoff: Backoff) -> None:
        """Assemble each fragment's chunks, apply keyframe or delta to our copy, hand it to the loop."""
        parts: list[bytes] = []
        current = None
        for msg in stream:
            backoff.reset()
            if current != (msg.fragment, msg.version):
                parts, current = [], (msg.fragment, msg.version)
            parts.append(msg.data)
            if not msg.last:
                continue
            blob = parts[0] if len(parts) == 1 else b"".join(parts)  # one chunk (most publishes): no copy
            parts = []
            self.bytes_received += len(blob)
            with self.lock:
                if msg.incarnation != self.incarnation or msg.fragment not in self.owned:
                    continue
                names = self.fragments[msg.fragment]
            expect = {n: self.expected_shapes[n] for n in names}
            try:
                tensors = decode_tensors(blob, expect)
            except CodecError as exc:  # resubscribing gets fresh keyframes
                raise ConnectionError(f"malformed published fragment {msg.fragment}: {exc}") from None
            with self.lock:
                if msg.delta:  # Θ + δ into the freshly decoded δ where it is ours to write (the same bits)
                    tensors = {n: np.add(t, self.view[n], out=t) if t.flags.writeable else self.view[n] + t
                               for n, t in tensors.items()}
                self.view.update(tensors)
                self.known_versions[msg.fragment] = msg.version
                self.tags[msg.fragment] = msg.tag
                self.inbox[msg.fragment] = Arrival(int(msg.version), tensors, int(msg.slot), int(msg.job_tokens))
                self.lock.notify_all()
