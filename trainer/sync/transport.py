"""The syncer client's two threads (trainer/sync/client.py): thin transport, no decisions.

Each turns what its RPC did into a session event (trainer/sync/session.py) and has the client carry
out the actions that come back. The sender pushes the outbox in order; the subscriber holds one
Subscribe stream open and feeds what it publishes into the client's copy of the global model.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import grpc

from diloco.contract import Event
from diloco.core.codecs import CODECS, decode_tensors
from diloco.core.fragments import owned_by
from diloco.core.ledger import Push
from diloco.core.seed import InitialModel
from diloco.trainer.sync import session as s
from diloco.trainer.sync.global_copy import GlobalCopy, Offer, decode, recovery
from diloco.trainer.sync.messages import JoinRefused, JoinState
from diloco.wire import channel, pb, push, push_header, rpc, seed_chunks

log = logging.getLogger("diloco.learner")
# What a syncer that is gone, frozen, fenced or a standby answers: try its other address.
UNREACHABLE = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})
RETIRE_SECONDS = 120.0  # a failed-over channel's life: past the longest call timeout here (60 s)


class Driven(Protocol):
    """What the threads use of the client (trainer/sync/client.py, `SyncerClient`)."""

    address: str
    learner: str
    region: str
    session: int  # this process, as an origin of pushes
    supersede: bool
    initial: InitialModel | None
    position: tuple[int, int]
    data: pb.DataListing | None
    incarnation: str
    secret: bytes
    addresses: list[str]  # the syncer's: one, or its active's and standby's
    tls: tuple[bytes | None, str | None]
    channel: Any
    route: int  # which of the syncer's addresses is in use
    push_one: bool
    metadata: Any
    stub: Any
    emit: Callable[..., None]
    machine: s.Session
    lock: threading.Condition
    turn: threading.Condition
    outbox: deque[Push]
    inbox: dict[int, Any]
    accepted: list[tuple[int, int, int, bool]]
    refused: list[tuple[int, int]]
    rejoined: JoinState | None
    share_state: bool
    sending: bool
    bytes_sent: int
    bytes_received: int
    acked_train_seconds: float
    stopping: threading.Event
    resync: threading.Event
    wake: threading.Event
    copy: GlobalCopy

    def feed(self, event: s.Event) -> list[s.Action]: ...

    def rejoin(self) -> None: ...

    def failover(self, route: int) -> None: ...


def failover(client: Driven, route: int) -> None:
    """The syncer at the address of `route` did not answer: use the next address (once per
    route, however many threads noticed). With one address, nothing changes."""
    if len(client.addresses) == 1:
        return
    with client.lock:
        if route != client.route:
            return
        client.route += 1
        old, client.address = client.channel, client.addresses[client.route % len(client.addresses)]
        client.channel = channel(client.address, *client.tls)
        client.stub = rpc.SyncerStub(client.channel)
    # Not closed now: another thread may have just read the old stub, and a call on a closed
    # channel raises ValueError, not an RpcError its loop handles; the subscriber died of it once
    # (its learner saw no new version of that shard again, every push refused as stale). A call
    # on the old channel fails on its own (UNAVAILABLE) and its loop retries on the new stub.
    retire = threading.Timer(RETIRE_SECONDS, old.close)
    retire.daemon = True
    retire.start()
    log.info("syncer unreachable; trying %s", client.address)


def recover_call(client: Driven, offer: Offer) -> None:
    """Offer a restarted syncer the newest global fragments we hold (Recover). With a standby's
    address too, until one of them answers: the one that took over must get them before we join it."""
    backoff = s.Backoff(rng=client.machine.rng)
    for _ in range(4 * len(client.addresses) if len(client.addresses) > 1 else 1):
        route = client.route
        try:
            reply = client.stub.Recover(iter(recovery(client.learner, offer)), metadata=client.metadata, timeout=60)
        except grpc.RpcError as exc:
            log.warning("recovery offer failed: %s", exc.details())
            if exc.code().name not in UNREACHABLE or client.stopping.is_set():
                return
            failover(client, route)
            client.stopping.wait(backoff.next())
            continue
        if reply.adopted:
            client.emit(Event.RECOVERED, fragments=list(reply.adopted), versions=list(reply.versions))
        return


def carry_out(client: Driven, actions: Iterable[s.Action], item: Push | None = None,
              state: JoinState | None = None) -> None:
    """Carry out the session's actions for the threads (those of a join are the join's own)."""
    for a in actions:
        if isinstance(a, s.Emit):
            client.emit(a.event, **dict(a.fields))
        elif isinstance(a, s.Fatal):
            client.emit(Event.FATAL, reason=a.reason)
            client.stopping.set()
        elif isinstance(a, s.Rejoin):
            client.rejoin()
        elif isinstance(a, s.AwaitRejoin):
            with client.turn:
                while client.machine.phase is s.Phase.REJOINING and not client.stopping.is_set():
                    client.turn.wait(0.5)  # a shard's fatal refusal stops us without a word to this one
        elif isinstance(a, s.HandOver):
            with client.lock:
                client.rejoined = state
        elif isinstance(a, s.WakeSubscriber):
            client.wake.set()  # the subscriber may be backing off from the old syncer: resubscribe now
        elif isinstance(a, s.Requeue) and item is not None:
            with client.lock:
                client.outbox.appendleft(item)
        elif isinstance(a, s.RecordRefused) and item is not None:
            with client.lock:
                client.refused.append((item.fragment, item.push_id))
        elif isinstance(a, s.Resync):
            client.resync.set()
        elif isinstance(a, s.Wait) and a.wakeable:
            if client.wake.wait(a.seconds):
                client.wake.clear()
                client.feed(s.Woken())
        elif isinstance(a, s.Wait):
            client.stopping.wait(a.seconds)


def join_call(client: Driven, shapes: dict[str, tuple[int, ...]], timeout: float) -> tuple[Any, JoinState]:
    """One Join: the syncer's header and the state it sent (our fragments of the global model)."""
    request = pb.JoinRequest(
        learner=client.learner, region=client.region,
        tensors=[pb.TensorShape(name=n, shape=list(shape)) for n, shape in sorted(shapes.items())],
        process=client.session, supersede=client.supersede,
        init_hash=client.initial.hash_for(*client.position) if client.initial is not None else b"",
        data=client.data,
    )
    header, buf = None, bytearray()
    for chunk in client.stub.Join(request, metadata=client.metadata, timeout=timeout):
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
    params = decode_tensors(bytes(buf), {n: shape for n, shape in shapes.items() if n in names})
    return header, JoinState(header.incarnation, list(header.versions), [list(f.names) for f in header.fragments],
                             params, codec, header.block_size, int(header.slot), owned, header.shard, shards,
                             tokens_merged=int(header.tokens_merged), job_tokens=int(header.job_tokens))


def seed_call(client: Driven, shapes: dict[str, tuple[int, ...]], shard: int, shards: int) -> None:
    """Give an unseeded syncer (shard) our Θ₀ of its fragments; a learner that lost the race
    to seed it hears the seed is in."""
    assert client.initial is not None
    if (shard, shards) != client.position:
        raise JoinRefused(f"the syncer at {client.address} is shard {shard} of {shards}, not {client.position[0]} "
                          f"of {client.position[1]}: list every shard's address, in shard order")
    stream = seed_chunks(client.learner, shapes, client.initial.held_by(shard, shards))
    reply = client.stub.Seed(stream, metadata=client.metadata, timeout=600)
    log.info("seeded the syncer with Θ₀ (%s)", "adopted" if reply.adopted else "already seeded by a peer")


def push_call(client: Driven, item: Push) -> pb.PushReply:
    """Through PushOne when it fits (wire.push); to a syncer that predates PushOne, through
    Push from the first UNIMPLEMENTED on."""
    header = push_header(item, learner=client.learner, region=client.region, session=client.session,
                         secret=client.secret)
    try:
        return push(client.stub, header, item.blob, client.metadata, timeout=60, unary=client.push_one)
    except grpc.RpcError as exc:
        if not client.push_one or exc.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise
        client.push_one = False
    return push(client.stub, header, item.blob, client.metadata, timeout=60, unary=False)


def _next(client: Driven) -> Push | None:
    """The outbox's next push (marked in flight); None once the client stops."""
    with client.lock:
        while not client.stopping.is_set():
            if not client.outbox:
                client.lock.wait(0.5)
                continue
            item = client.outbox.popleft()
            if item.incarnation == client.incarnation:
                client.sending = True
                return item
            # made against a syncer that has since restarted: the re-join resets it
    return None


def send_loop(client: Driven) -> None:
    """Push the outbox in order; book each answer for the loop."""
    while (item := _next(client)) is not None:
        route = client.route
        try:
            reply = push_call(client, item)
        except grpc.RpcError as exc:
            if exc.code().name in UNREACHABLE:
                client.failover(route)
            carry_out(client, client.feed(s.PushFailed(exc.code().name, exc.details() or "", item.fragment, item.incarnation)),
                       item=item)
        else:
            client.bytes_sent += len(item.blob)
            with client.lock:
                if reply.accepted:
                    client.acked_train_seconds = max(client.acked_train_seconds, item.train_seconds)
                    client.accepted.append((item.fragment, item.push_id, int(reply.merged_into), reply.late))
                    client.share_state |= reply.share_state
                else:
                    client.refused.append((item.fragment, item.push_id))
                client.lock.notify_all()
            answered = s.PushAccepted() if reply.accepted else s.PushRefused(item.fragment, reply.reason)
            carry_out(client, client.feed(answered), item=item)
        finally:
            with client.lock:
                client.sending = False
                client.lock.notify_all()


def subscribe_loop(client: Driven) -> None:
    """Hold a subscription open; when it breaks, subscribe again as the session says."""
    while not client.stopping.is_set():
        with client.lock:
            incarnation, route = client.incarnation, client.route
            request = client.copy.subscription(client.learner, incarnation, client.secret)
        event: s.Event
        try:
            consume(client, client.stub.Subscribe(request, metadata=client.metadata))
            event = s.StreamEnded()
        except ConnectionError as exc:
            event = s.StreamMalformed(str(exc))
        except grpc.RpcError as exc:
            if client.stopping.is_set():
                return
            if exc.code().name in UNREACHABLE:
                client.failover(route)
            event = s.StreamBroken(exc.code().name, exc.details() or "", incarnation)
        carry_out(client, client.feed(event))


def consume(client: Driven, stream: Iterable[Any]) -> None:
    """Assemble each fragment's chunks, apply keyframe or delta to our copy, hand it to the loop."""
    parts: list[bytes] = []
    current = None
    for msg in stream:
        if current is None:
            client.feed(s.StreamData())
        if current != (msg.fragment, msg.version):
            parts, current = [], (msg.fragment, msg.version)
        parts.append(msg.data)
        if not msg.last:
            continue
        blob = parts[0] if len(parts) == 1 else b"".join(parts)  # one chunk (most publishes): no copy
        parts = []
        client.bytes_received += len(blob)
        with client.lock:
            expect = client.copy.expects(msg.fragment) if msg.incarnation == client.incarnation else None
        if expect is None:
            continue
        tensors = decode(blob, expect, msg.fragment)
        with client.lock:
            client.inbox[msg.fragment] = client.copy.apply(msg, tensors)
            client.lock.notify_all()
