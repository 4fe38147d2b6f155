"""The syncer's core: one lock around the parts that keep the syncer's state.

The parts, each with one job and its own fields: `Admission` (syncer/acceptance.py) decides
which pushes may be taken, the `RoundDriver` (syncer/round.py) runs a round: offer → close →
merge → commit → publish, over the `RoundBook` (diloco/core/rounds.py), `GlobalModel`
(syncer/global_model.py) and the `Publisher` (syncer/publisher.py), which encodes each version once
for every subscriber; the replay (apps/sim/replay.py) runs the same driver. The
`LearnerRegistry` (syncer/registry.py) keeps learners, sessions, regions, Joins and the
optimizer-state relay; the `Tallies` (syncer/tallies.py) count what was taken, refused, merged
and sent, from the rounds the driver returns; `Persistence` (syncer/durable/persistence.py) keeps the
store, the publish lease, checkpoints and Recover. None of them knows the core; the servicer
(syncer/servicer.py) only translates RPCs, to the core alone.

Threads: gRPC handlers admit contributions under `lock`; one merge thread closes rounds and
merges them outside it (`merging` keeps merges, Recover and checkpoints one at a time);
subscribers wait on the publisher's condition. Anything malformed is refused (`Refused`)
before it touches the global state.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import InitVar, dataclass, field

from diloco.checkpoint import Store
from diloco.core.codecs import Pieces, encoded_size
from diloco.core.fragments import owned_by
from diloco.core.merge import Source
from diloco.core.rounds import RoundBook, Verdict
from diloco.spec import Syncer as SyncerSpec
from diloco.syncer.acceptance import Admission, check_header, check_owned, outer_gradient
from diloco.syncer.counter_bounds import RESTART_WINDOW, Counters
from diloco.syncer.durable.lease import PublishLease
from diloco.syncer.durable.persistence import Persistence
from diloco.syncer.global_model import GlobalModel, Outer
from diloco.syncer.joins import readmission
from diloco.syncer.joins.peer_state import Donated
from diloco.syncer.metrics import SyncerMetrics
from diloco.syncer.publisher import CHAIN, Publisher, Update
from diloco.syncer.registry import LearnerRegistry
from diloco.syncer.round import RoundDriver
from diloco.syncer.status import status_reply
from diloco.syncer.tallies import Tallies
from diloco.wire import pb

log = logging.getLogger("diloco.syncer")


def push_bounds(model: GlobalModel) -> list[int]:
    """Per fragment, the largest push it can take: every tensor in fp32, with its framing."""
    return [sum(encoded_size(s, "fp32") + len(n) + 10 for n, s in model.shapes(p).items()) + 8
            for p in range(model.plan.num_fragments)]


def headroom(spec: SyncerSpec, model: GlobalModel, owned: Iterable[int]) -> int:
    """What a shard's heap grows by past seeding, at most: a Join's snapshot keeps a whole view
    alive while every fragment is republished under it, and each fragment keeps CHAIN
    compressed deltas (syncer/publisher.py). The syncer faults it in at start."""
    codec, block = spec.broadcast_compression, spec.block_size
    return sum(encoded_size(s, "fp32") + CHAIN * encoded_size(s, codec, block)
               for p in owned for s in model.shapes(p).values())


def state_bound(model: GlobalModel) -> int:
    """The largest optimizer state a peer may share: AdamW's two moments in bf16 are the model's
    fp32 size; the names are longer than the parameters' (optimizer tree paths), hence the slack."""
    return sum(encoded_size(s, "fp32") + 512 for s in model.shapes().values()) + (1 << 20)


@dataclass(kw_only=True)
class SyncerCore:
    """Everything but the transport: one lock around its parts and the round driver they feed."""

    spec: SyncerSpec
    model: GlobalModel
    store: InitVar[Store | None]  # kept by `persistence`
    metrics: SyncerMetrics
    clock: Callable[[], float] = time.monotonic
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    lock: threading.Condition = field(default_factory=threading.Condition)
    stopping: bool = False
    regions: InitVar[frozenset[str]] = frozenset()  # the job's regions (kept by `registry`); others are "other"
    shard: int = 0  # of spec.shards: this process merges, checkpoints and publishes its fragments only
    # spec.training.batchSize x spec.model.context: the most tokens one inner step trains, which
    # bounds what a push may report (syncer/acceptance.py Counters).
    tokens_per_step: int = 0

    def __post_init__(self, store: Store | None, regions: frozenset[str]) -> None:
        if not 0 <= self.shard < self.spec.shards:
            raise ValueError(f"shard {self.shard} of {self.spec.shards}: shards are numbered 0 to {self.spec.shards - 1}")
        self.admission = Admission(num_fragments=self.model.plan.num_fragments, max_norm_ratio=self.spec.max_norm_ratio)
        # A syncer that has merged nothing (a fresh job) has no learners whose counters began before it.
        counters = Counters(self.tokens_per_step, self.spec.fragments,
                            started=self.clock() - (RESTART_WINDOW if self.model.outer_steps == 0 else 0.0))
        self.registry = LearnerRegistry(admission=self.admission, counters=counters, clock=self.clock, regions=regions)
        self.tallies = Tallies(metrics=self.metrics, clock=self.clock)
        self.max_push_bytes = push_bounds(self.model)
        self.metrics.outer_version.set(sum(self.model.versions))
        self.max_state_bytes = state_bound(self.model)
        lease = PublishLease.open(store, self.model.versions)
        self.publisher = Publisher(self.spec.broadcast_compression, self.spec.block_size, self.model.tag)
        self.driver = RoundDriver(model=self.model, admission=self.admission, publish=self.publisher.publish,
                                  clock=self.clock, lock=self.lock, lease=lease)
        self.owned = owned_by(self.shard, self.model.plan.num_fragments, self.spec.shards)
        self.persistence = Persistence(store=store, lease=lease, model=self.model, driver=self.driver,
                                       publisher=self.publisher, metrics=self.metrics, owned=self.owned, shard=self.shard,
                                       max_recover_bytes=sum(self.max_push_bytes) + 1024)  # the whole model in fp32
        self.model.keep_only(self.owned)  # a shard holds its own fragments' tensors only
        for p in self.owned:
            self.publisher.reset(p, self.model.versions[p], self.model.fragment(p), self.driver.published_slot[p])

    @property
    def book(self) -> RoundBook[Outer]:
        return self.driver.book

    def admit(self, header: pb.PushHeader, body: Callable[[], bytes | memoryview]) -> pb.PushReply:
        """Check a push's header and session, then read its body (`body`) and offer it to its
        round; state changes only if accepted. Peers are asked for their optimizer state here."""
        check_header(header, self.incarnation, self.max_push_bytes, self.spec.shards)
        check_owned(header.fragment, self.owned, self.shard, self.spec.shards)
        self.check_session(header.learner, header.session_secret)
        blob = body()
        tensors, norm = outer_gradient(blob, header.fragment, self.model.shapes(header.fragment))
        reply = self._offer(header, tensors, len(blob), norm)
        if reply.accepted and self.registry.relay.should_share(header.learner):
            reply.share_state = True
        return reply

    def _offer(self, h: pb.PushHeader, tensors: Mapping[str, Source], size: int, norm: float) -> pb.PushReply:
        p = h.fragment
        with self.lock:
            info = self.registry.pushed(h)
            if (merged_into := self.admission.retried((h.learner, h.session), h.push_id)) is not None:
                return pb.PushReply(accepted=True, version=self.model.versions[p], merged_into=merged_into)
            self.registry.check_counters(h, info.last_seen)
            # One vote per learner in the step time: no liar moves it.
            taken = self.driver.offer(h, tensors, norm, step_time=self.registry.counters.step_median(),
                                      received_at=info.last_seen)
            self.tallies.checked_norm(taken.ratio)
            offer = taken.offer
            if offer.verdict is not Verdict.ACCEPTED:
                self.tallies.refusal("stale" if offer.verdict is Verdict.STALE else "future")
                return pb.PushReply(accepted=False, reason=offer.reason, version=self.model.versions[p])
            self.registry.accepted(info, size=size, lag=offer.lag)
            self.tallies.accepted(self.registry.region_of(h.learner), size=size, lag=offer.lag)
            self.lock.notify_all()
            return pb.PushReply(accepted=True, version=self.model.versions[p], merged_into=taken.merged_into,
                                late=offer.late)

    def job_tokens(self) -> int:
        """The job's trained tokens as accepted pushes report them: the merged count plus what pushes in
        open rounds carry beyond it. Learners set their learning-rate schedule by it (core/schedule.py
        JobProgress); the merged count alone trails by the merge's latency (4-7 steps, ~1% of held-out loss)."""
        with self.lock:
            return self.model.job_tokens()

    def join(self, request: pb.JoinRequest) -> tuple[pb.JoinHeader, Pieces]:
        """Admit a (re)joining learner whose model is this job's (syncer/joins/readmission.py): its
        session, and the global model as every subscriber holds it."""
        readmission.check_join(self.model, request)
        listing, learner = readmission.data_listing(request), request.learner
        with self.lock:
            readmission.admit_data(self.model, listing, learner)
            secret = self.registry.open_session(learner, request.process, request.supersede)
            info = self.registry.joined(learner, request.region)
            slot, job_tokens = self.book.next_slot, self.model.job_tokens()
        view = self.publisher.snapshot()
        self.metrics.joins.labels("readmission" if info.joins > 1 else "first").inc()
        log.info("learner %s joined (%s, join #%d)", learner, request.region, info.joins)
        header = readmission.join_header(self.model, self.spec, view, incarnation=self.incarnation, shard=self.shard,
                                         learner=learner, secret=secret, slot=slot, job_tokens=job_tokens)
        return header, view[1]

    def share_state(self, header: pb.StateHeader) -> bool:
        """A donor's optimizer-state upload (its header): False if it declined (syncer/joins/readmission.py)."""
        self.check_session(header.learner, header.session_secret)
        if header.declined:
            self.registry.relay.decline(header.learner)
            return False
        readmission.check_state_size(header, self.max_state_bytes)
        readmission.check_state_count(header, self.job_tokens(), self.tokens_per_step, self.spec.fragments)
        return True

    def relay_state(self, donor: str, count: int, blob: bytes) -> bool:
        return self.registry.relay.offer(donor, count, blob)  # to the learner waiting (syncer/joins/peer_state.py)

    def fetch_state(self, learner: str, wait: float, alive: Callable[[], bool]) -> Donated | None:
        return self.registry.relay.fetch(learner, wait, alive)  # a peer's, waiting up to `wait` seconds

    def open_session(self, learner: str, process: int, supersede: bool) -> bytes:
        """The joining process's session secret (`LearnerRegistry.open_session`)."""
        with self.lock:
            return self.registry.open_session(learner, process, supersede)

    def check_session(self, learner: str, secret: bytes) -> None:
        with self.lock:
            self.registry.check_session(learner, secret)

    def seeded_with(self, init_hash: bytes) -> bool:  # a Seed's Θ₀ is this model's (or it records none)
        return not self.model.init_hash or init_hash == self.model.init_hash

    def count_refusal(self, outcome: str) -> None:
        with self.lock:
            self.tallies.refusal(outcome)

    def recover(self, header: pb.RecoverHeader, body: Callable[[], bytes | memoryview]) -> list[int]:
        return self.persistence.recover(header, body)  # newer fragments a learner hands back

    def checkpoint(self) -> bool:  # False if none was written (syncer/durable/persistence.py)
        return self.persistence.checkpoint()

    def headroom(self) -> int:  # what this shard's heap grows by past seeding, at most (`headroom`)
        return headroom(self.spec, self.model, self.owned)

    def rounds_running(self) -> bool:  # learners are pushing (one did in the last ROUNDS_RUNNING_SECONDS)
        return self.registry.rounds_running()

    def merge_ready(self, flush: bool = False) -> list[int]:
        """Close, merge, commit and publish every round that is due (syncer/round.py), and count each."""
        done = []
        for r in self.driver.rounds(self.registry.active, flush=flush):
            with self.lock:
                self.registry.merged(r)
                self.tallies.merged(r, self.book, sum(self.model.versions), self.registry.region_of)
            done.append(r.fragment)
        return done

    def wait_for_round(self, longest: float = 0.5) -> None:  # the merge thread's sleep until a round may be due
        self.driver.wait_for_round(self.registry.active, longest)

    def updates(self, known: list[int], exact: bool, alive: Callable[[], bool]) -> Iterator[Update]:
        return self.publisher.updates(known, exact, alive)  # a subscription's: each version encoded once for all

    def stop(self) -> None:  # shutting down: subscriptions end, the final merges and checkpoint follow
        self.stopping = True
        self.publisher.stop()
        with self.lock:
            self.lock.notify_all()

    @contextlib.contextmanager
    def subscribed(self, learner: str) -> Iterator[None]:
        """While a subscription stream is open, its learner counts as active."""
        self._subscribe(learner, 1)
        try:
            yield
        finally:
            self._subscribe(learner, -1)

    def _subscribe(self, learner: str, delta: int) -> None:
        with self.lock:
            self.registry.subscribe(learner, delta)
            self.tallies.active(self.registry.active(), self.registry.all_regions(), self.registry.region_of)

    def versions(self) -> list[int]:
        with self.lock:
            return list(self.model.versions)

    def status(self) -> pb.StatusReply:
        with self.lock:
            return status_reply(now=self.clock(), incarnation=self.incarnation, model=self.model, registry=self.registry,
                                tallies=self.tallies, book=self.book, checkpoint_version=self.persistence.checkpoint_version,
                                max_norm_ratio=self.admission.max_ratio_seen, shard=self.shard, shards=self.spec.shards)

    def count_sent(self, n: int) -> None:
        with self.lock:
            self.tallies.sent(n)
