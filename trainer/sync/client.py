"""The learner's side of the wire: join, a background sender and a background subscriber.

The training loop never waits on the network: it queues outer gradients for the sender
(each carries progress no other push carries, so none replaces another) and picks up,
at step boundaries, the fragments published since and what the syncer said of each
push (accepted into which version, or refused). Both threads reconnect with capped
exponential backoff while the loop keeps training.

What follows each RPC's outcome (retry, back off, re-join a restarted syncer, stop) is
trainer/sync/session.py's pure `Session`; this module does the I/O and carries out its actions.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable

import grpc

from diloco.contract import ALTERNATE, incarnation_epoch
from diloco.core.ledger import Arrival, Push
from diloco.core.seed import InitialModel
from diloco.trainer.sync import session as s
from diloco.trainer.sync.global_copy import GlobalCopy
from diloco.trainer.sync.link import SyncerLink

# Re-exported: callers import the client's vocabulary from here.
from diloco.trainer.sync.messages import JoinRefused, JoinState, Unauthenticated, Updates
from diloco.trainer.sync.transport import (
    UNREACHABLE,
    carry_out,
    failover,
    join_call,
    recover_call,
    seed_call,
    send_loop,
    subscribe_loop,
)
from diloco.wire import auth_metadata, channel, parse_unseeded, pb, rpc

__all__ = ["JoinRefused", "JoinState", "Push", "SyncerClient", "Unauthenticated", "Updates"]
log = logging.getLogger("diloco.learner")


class SyncerClient:
    """One syncer (or one shard of it), as the learner loop uses it (trainer/sync/link.py, `SyncerLink`)."""

    # The first four stay positional: the tests pass them so. The defaults: events go nowhere (a
    # test or a tool, not a learner process); plaintext (TLS is opt-in: the learner's --tls-ca); no
    # takeover of a live learner id (only the learner's first Join after a restart asks for one);
    # the backoffs' jitter from the OS and the process's monotonic clock (a test passes its own).
    def __init__(self, address: str, token: str, learner: str, region: str, *,
                 on_event: Callable[..., None] = lambda *a, **k: None,
                 tls_ca: bytes | None = None, tls_server_name: str | None = None, supersede: bool = False,
                 data: pb.DataListing | None = None, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic):
        # The syncer's addresses: one, or its active's and standby's (`a|b`, spec.syncer.standby),
        # tried in turn while the one in use is unreachable (`failover`).
        self.addresses = [a.strip() for a in address.split(ALTERNATE) if a.strip()] or [address]
        self.address, self.learner, self.region = self.addresses[0], learner, region
        self.data = data  # our copy's files, which every Join shows the syncer (diloco/copy_listings.py)
        self.metadata = auth_metadata(token)
        self.tls = (tls_ca, tls_server_name)
        self.channel = channel(self.address, tls_ca, tls_server_name)
        self.stub = rpc.SyncerStub(self.channel)
        self.route = 0  # which address is in use: counts failovers
        # The highest lease epoch we have joined: a Join from a lower one is a fenced syncer's.
        self.epoch = 0
        self.emit, self.clock = on_event, clock
        self.machine = s.Session(rng)
        self.incarnation = ""
        self.lock = threading.Condition()  # guards what the threads and the loop share, `copy` included
        self.turn = threading.Condition()  # guards `machine`; a re-join's end is announced on it
        self.session = int.from_bytes(os.urandom(7), "little") | 1  # this process, as an origin of pushes
        # The first Join may take the learner id over from a live process (a restarted pod's dead
        # predecessor whose stream the syncer has not yet seen close); re-joins never do.
        self.supersede = supersede
        self.secret = b""  # the session secret of our latest Join
        self.push_one = True  # until a syncer without PushOne answers UNIMPLEMENTED
        self.outbox: deque[Push] = deque()
        self.inbox: dict[int, Arrival] = {}
        self.accepted: list[tuple[int, int, int, bool]] = []
        self.refused: list[tuple[int, int]] = []
        self.share_state = False  # a push reply asked for our optimizer state (a peer re-joins)
        self.rejoined: JoinState | None = None
        self.stopping = threading.Event()
        self.resync = threading.Event()
        self.wake = threading.Event()  # cuts the subscriber's backoff short after a re-join or at close
        self.sending = False
        self.bytes_sent = 0
        self.bytes_received = 0
        self.acked_train_seconds = 0.0
        self.threads: list[threading.Thread] = []
        self.copy = GlobalCopy()  # the global model as the syncer sent it; offered to a restarted syncer
        # Which syncer shard this client talks to (the sharded client sets it), and our Θ₀: an
        # unseeded syncer (syncer/joins/seeding.py) gets its part of it, every Join proves its hash.
        self.position = (0, 1)
        self.initial: InitialModel | None = None

    def failover(self, route: int) -> None:
        failover(self, route)  # the next of `addresses` (trainer/sync/transport.py)

    def feed(self, event: s.Event) -> list[s.Action]:
        with self.turn:
            actions = self.machine.on(event)
            self.turn.notify_all()
        return actions

    # -- join ------------------------------------------------------------------------

    def join(self, shapes: dict[str, tuple[int, ...]], timeout: float = 30.0) -> JoinState:
        try:
            return self._join(shapes, timeout)
        except grpc.RpcError as exc:
            where = parse_unseeded(exc.details() or "") if exc.code() == grpc.StatusCode.FAILED_PRECONDITION else None
            if where is None:
                raise
            with self.lock:
                holds_view = bool(self.copy.view)
            actions = self.feed(s.Unseeded(*where, can_seed=self.initial is not None, holds_view=holds_view))
            if s.Retry() not in actions:  # Reraise: the refusal stands
                raise
        for a in actions:
            if isinstance(a, s.Seed):
                seed_call(self, shapes, a.shard, a.shards)
            elif isinstance(a, s.RecoverState):  # a syncer that lost its state: the newer fragments we hold first
                self._offer_recovery()
        return self._join(shapes, timeout)

    def _join(self, shapes: dict[str, tuple[int, ...]], timeout: float) -> JoinState:
        header, state = join_call(self, shapes, timeout)
        self.bytes_received += header.total_bytes
        epoch = incarnation_epoch(header.incarnation)
        if epoch < self.epoch:
            raise ConnectionError(f"the syncer at {self.address} holds lease epoch {epoch}, below the {self.epoch} we "
                                  "joined: a fenced syncer")
        self.epoch = epoch
        with self.lock:
            self.supersede, self.secret = False, header.session_secret
            self.incarnation = header.incarnation
            self.copy.joined(header, state.owned, state.params, shapes)
            self.inbox.clear()
            self.outbox.clear()
            self.feed(s.Joined(header.incarnation))  # under the lock: no thread sees one incarnation without the other
        return state

    def join_with_retry(self, shapes: dict[str, tuple[int, ...]], initial: InitialModel | None = None) -> JoinState:
        if initial is not None:
            self.initial = initial
        self.feed(s.JoinStarted())
        while not self.stopping.is_set():
            route = self.route
            try:
                return self.join(shapes)
            except grpc.RpcError as exc:
                if exc.code().name in UNREACHABLE:
                    self.failover(route)
                actions = self.feed(s.JoinFailed(exc.code().name, exc.details() or ""))
            except ConnectionError as exc:
                self.failover(route)
                actions = self.feed(s.JoinFailed("CONNECTION", str(exc)))
            for a in actions:
                if isinstance(a, s.Refuse):
                    raise (Unauthenticated if a.kind == "token" else JoinRefused)(a.message) from None
                if isinstance(a, s.Wait):
                    log.warning("join failed (%s); retrying in %.1fs", a.reason, a.seconds)
                    self.stopping.wait(a.seconds)
        raise RuntimeError("stopped before joining")

    def _offer_recovery(self) -> None:
        """Give a restarted syncer the newest global fragments we hold (see Recover)."""
        with self.lock:
            offer = self.copy.offer()
        if offer is not None:
            recover_call(self, offer)

    def rejoin(self) -> None:
        """The syncer restarted: offer it our copy, pull its whole state; the loop adopts it at a
        step boundary."""
        try:
            self._offer_recovery()
            try:
                state = self.join_with_retry(self.copy.shapes)
            except RuntimeError as exc:  # Unauthenticated, JoinRefused, or stopped
                carry_out(self, self.feed(s.RejoinFailed(str(exc))))
                return
        except BaseException:  # no refusal: the next notice of the restart may try again
            self.feed(s.RejoinAborted())
            raise
        carry_out(self, self.feed(s.Rejoined(state.incarnation)), state=state)

    # -- the loop's side -----------------------------------------------------------------

    def start(self) -> None:
        for target, name in ((send_loop, "sender"), (subscribe_loop, "subscriber")):
            t = threading.Thread(target=target, args=(self,), name=name, daemon=True)
            t.start()
            self.threads.append(t)

    def submit(self, item: Push) -> None:
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
        deadline = self.clock() + timeout
        with self.lock:
            while self.outbox or self.sending:
                remaining = deadline - self.clock()
                if remaining <= 0:
                    return False
                self.lock.wait(remaining)
        return True

    def close(self) -> None:
        self.stopping.set()
        self.wake.set()
        with self.lock:
            self.lock.notify_all()
        with self.turn:
            self.turn.notify_all()
        self.channel.close()


_conforms: type[SyncerLink] = SyncerClient  # mypy fails here when the class drifts from its protocol
