"""The syncer's core: locking and learner bookkeeping around the round the driver runs.

The parts, each with one job: `Admission` (syncer/admission.py) decides which pushes may be
taken, the `RoundDriver` (syncer/round.py) runs a round: offer → close → merge → commit →
publish, over the `RoundBook` (diloco/core/rounds.py), `GlobalModel` (syncer/state.py) and the
`Publisher` (syncer/publisher.py), which encodes each version once for every subscriber; the
replay (apps/sim/replay.py) runs the same driver. Checkpoints and Recover are in
syncer/persistence.py, and the servicer (syncer/servicer.py) only translates RPCs.

Threads: gRPC handlers admit contributions under `lock`; one merge thread closes rounds and
merges them outside it (`merging` keeps merges, Recover and checkpoints one at a time);
subscribers wait on the publisher's condition. Anything malformed is refused (`Refused`)
before it touches the global state.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import grpc

from diloco.checkpoint import CheckpointStore
from diloco.core.codecs import encoded_size
from diloco.core.fragments import owned_by, owner
from diloco.core.merge import Source
from diloco.core.rounds import RoundBook, Verdict
from diloco.spec import Syncer as SyncerSpec
from diloco.syncer import accounting, persistence
from diloco.syncer.admission import Admission, Refused, check_header, outer_gradient
from diloco.syncer.counters import RESTART_WINDOW, Counters
from diloco.syncer.lease import PublishLease
from diloco.syncer.metrics import SyncerMetrics
from diloco.syncer.peer_state import StateRelay
from diloco.syncer.publisher import CHAIN, Publisher, Update
from diloco.syncer.round import RoundDriver
from diloco.syncer.state import GlobalModel, Outer
from diloco.syncer.status import status_reply
from diloco.wire import pb

log = logging.getLogger("diloco.syncer")
LIVE_SECONDS = 30.0  # a learner seen this recently (or subscribed) is live: its id is taken
# A push this recent means learners are training against this syncer: re-admissions' bulk
# streams are paced then (syncer/pacing.py), and go unpaced when nobody pushes (every learner
# re-joining a restarted syncer), since no round is waiting.
ROUNDS_RUNNING_SECONDS = 10.0


@dataclass(kw_only=True)
class LearnerInfo:
    region: str = ""
    joins: int = 0
    contributions: int = 0
    tokens: int = 0
    last_seen: float = 0.0
    loss: float = float("nan")
    subscriptions: int = 0
    bytes_received: int = 0
    staleness: int = 0  # summed lag of accepted contributions


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
    """Everything but the transport: locking, learners, and the round driver they feed."""

    spec: SyncerSpec
    model: GlobalModel
    store: CheckpointStore | None
    metrics: SyncerMetrics
    clock: Callable[[], float] = time.monotonic
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    lock: threading.Condition = field(default_factory=threading.Condition)
    learners: dict[str, LearnerInfo] = field(default_factory=dict)
    refused: int = 0
    refused_by: dict[str, int] = field(default_factory=dict)  # by outcome
    bytes_received: int = 0
    bytes_sent: int = 0
    last_publish: float = 0.0
    last_push: float = float("-inf")  # when a push last arrived (`rounds_running`)
    checkpoint_version: int = 0
    stopping: bool = False
    regions: frozenset[str] = frozenset()  # the job's regions; others are reported as "other"
    shard: int = 0  # of spec.shards: this process merges, checkpoints and publishes its fragments only
    # spec.training.batchSize x spec.model.context: the most tokens one inner step trains, which
    # bounds what a push may report (syncer/admission.py Counters).
    tokens_per_step: int = 0

    def __post_init__(self) -> None:
        self.admission = Admission(num_fragments=self.model.plan.num_fragments, max_norm_ratio=self.spec.max_norm_ratio)
        # A syncer that has merged nothing (a fresh job) has no learners whose counters began before it.
        self.counters = Counters(self.tokens_per_step, self.spec.fragments,
                                 started=self.clock() - (RESTART_WINDOW if self.model.outer_steps == 0 else 0.0))
        self.last_publish = self.clock()
        self.max_push_bytes = push_bounds(self.model)
        self.metrics.outer_version.set(sum(self.model.versions))
        self.max_recover_bytes = sum(self.max_push_bytes) + 1024  # every fragment in fp32: the whole model
        self.max_state_bytes = state_bound(self.model)
        self.relay = StateRelay(self.clock)  # peers' optimizer state for re-joining learners (syncer/peer_state.py)
        self.lease = PublishLease.open(self.store.dir if self.store else None, self.model.versions)
        self.publisher = Publisher(self.spec.broadcast_compression, self.spec.block_size, self.model.tag)
        self.driver = RoundDriver(model=self.model, admission=self.admission, publish=self.publisher.publish,
                                  clock=self.clock, lock=self.lock, lease=self.lease, on_commit=lambda done: accounting.count_merge(self, done))
        if not 0 <= self.shard < self.spec.shards:
            raise ValueError(f"shard {self.shard} of {self.spec.shards}: shards are numbered 0 to {self.spec.shards - 1}")
        self.owned = owned_by(self.shard, self.model.plan.num_fragments, self.spec.shards)
        self.model.keep_only(self.owned)  # a shard holds its own fragments' tensors only
        for p in self.owned:
            self.publisher.reset(p, self.model.versions[p], self.model.fragment(p), self.driver.published_slot[p])

    @property
    def book(self) -> RoundBook[Outer]:
        return self.driver.book

    def region_of(self, learner: str) -> str:
        info = self.learners.get(learner)
        region = info.region if info else ""
        return region if region in self.regions else "other"

    def admit(self, header: pb.PushHeader, body: Callable[[], bytes | memoryview]) -> pb.PushReply:
        """Check a push's header and session, then read its body (`body`) and offer it to its
        round; state changes only if accepted. Peers are asked for their optimizer state here."""
        check_header(header, self.incarnation, self.max_push_bytes, self.spec.shards)
        if header.fragment not in self.owned:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"fragment {header.fragment} belongs to syncer shard "
                          f"{owner(header.fragment, self.spec.shards)}, not to this one ({self.shard})", "misrouted")
        self.check_session(header.learner, header.session_secret)
        blob = body()
        tensors, norm = outer_gradient(blob, header.fragment, self.model.shapes(header.fragment))
        reply = self._offer(header, tensors, len(blob), norm)
        if reply.accepted and self.relay.should_share(header.learner):
            reply.share_state = True
        return reply

    def _offer(self, h: pb.PushHeader, tensors: Mapping[str, Source], size: int, norm: float) -> pb.PushReply:
        p = h.fragment
        with self.lock:
            info = self.learners.setdefault(h.learner, LearnerInfo(region=h.region))
            info.last_seen = self.clock()
            if math.isfinite(h.loss) and h.loss >= 0:  # shown in status only; never trusted further
                info.loss = h.loss
            self.last_push = info.last_seen
            if (merged_into := self.admission.retried((h.learner, h.session), h.push_id)) is not None:
                return pb.PushReply(accepted=True, version=self.model.versions[p], merged_into=merged_into)
            self.counters.observe_step(h.learner, h.step_seconds)
            self.counters.check((h.learner, int(h.session)), p, base_version=int(h.base_version), steps=int(h.steps),
                                tokens=int(h.tokens), now=info.last_seen)
            # One vote per learner in the step time: no liar moves it.
            taken = self.driver.offer(h, tensors, norm, step_time=self.counters.step_median(),
                                      received_at=info.last_seen)
            if taken.ratio is not None:
                self.metrics.norm_ratio.observe(taken.ratio)
            offer = taken.offer
            if offer.verdict is not Verdict.ACCEPTED:
                self.count_refusal("stale" if offer.verdict is Verdict.STALE else "future")
                return pb.PushReply(accepted=False, reason=offer.reason, version=self.model.versions[p])
            accounting.count_accepted(self, h.learner, info, size=size, lag=offer.lag)
            self.lock.notify_all()
            return pb.PushReply(accepted=True, version=self.model.versions[p], merged_into=taken.merged_into,
                                late=offer.late)

    def job_tokens(self) -> int:
        """The job's trained tokens as accepted pushes report them: the merged count plus what
        pushes in open rounds carry beyond it. Learners set their learning-rate schedule by it
        (diloco/core/schedule.py, JobProgress); the merged count alone trails training by the
        merge's latency, 4-7 steps measured, and that lag cost about 1% of held-out loss."""
        with self.lock:
            return self.model.tokens_trained()

    def open_session(self, learner: str, process: int, supersede: bool) -> bytes:
        """The joining process's session secret (see `Admission.open_session`)."""
        with self.lock:
            info = self.learners.get(learner)
            live = info is not None and (info.subscriptions > 0 or self.clock() - info.last_seen < LIVE_SECONDS)
            secret = self.admission.open_session(learner, process, supersede, live)
            self.counters.join((learner, process), self.clock())
            return secret

    def check_session(self, learner: str, secret: bytes) -> None:
        with self.lock:
            self.admission.check_session(learner, secret)

    def count_refusal(self, outcome: str) -> None:
        with self.lock:
            self.refused += 1
            self.refused_by[outcome] = self.refused_by.get(outcome, 0) + 1
        self.metrics.contributions.labels(outcome).inc()

    def recover(self, header: pb.RecoverHeader, body: Callable[[], bytes | memoryview]) -> list[int]:
        """Adopt newer fragments a learner hands back (syncer/persistence.py)."""
        return persistence.recover(self, header, body)

    def checkpoint(self) -> bool:
        """Write a checkpoint (syncer/persistence.py); False if none was written."""
        return persistence.checkpoint(self)

    def headroom(self) -> int:
        """What this shard's heap grows by past seeding, at most (`headroom`)."""
        return headroom(self.spec, self.model, self.owned)

    def rounds_running(self) -> bool:
        """Learners are pushing to this syncer (one did in the last ROUNDS_RUNNING_SECONDS)."""
        return self.clock() - self.last_push < ROUNDS_RUNNING_SECONDS

    def active_learners(self) -> set[str]:
        return {name for name, info in self.learners.items() if info.subscriptions > 0}

    def merge_ready(self, flush: bool = False) -> list[int]:
        """Close, merge, commit and publish every round that is due (syncer/round.py)."""
        return [r.fragment for r in self.driver.merge_ready(self.active_learners, flush=flush)]

    def wait_for_round(self, longest: float = 0.5) -> None:
        """Sleep until a round may be due (the merge thread)."""
        self.driver.wait_for_round(self.active_learners, longest)

    def updates(self, known: list[int], exact: bool, alive: Callable[[], bool]) -> Iterator[Update]:
        """A subscription's messages (syncer/publisher.py): each version encoded once for all."""
        return self.publisher.updates(known, exact, alive)

    def stop(self) -> None:
        """Shutting down: subscriptions end, the final merges and checkpoint follow."""
        self.stopping = True
        self.publisher.stop()
        with self.lock:
            self.lock.notify_all()

    def joined(self, learner: str, region: str) -> tuple[LearnerInfo, int, int]:
        """Record a Join (syncer/readmission.py): the learner's record, the schedule's next slot
        and the job's tokens, at once."""
        with self.lock:
            info = self.learners.setdefault(learner, LearnerInfo())
            info.region, info.last_seen = region, self.clock()
            info.joins += 1
            return info, self.book.next_slot, self.job_tokens()

    @contextlib.contextmanager
    def subscribed(self, learner: str) -> Iterator[None]:
        """While a subscription stream is open, its learner counts as active."""
        with self.lock:
            info = self.learners.setdefault(learner, LearnerInfo())
            info.subscriptions += 1
        accounting.set_active_gauges(self)
        try:
            yield
        finally:
            with self.lock:
                info.subscriptions -= 1
            accounting.set_active_gauges(self)

    def versions(self) -> list[int]:
        with self.lock:
            return list(self.model.versions)

    def status(self) -> pb.StatusReply:
        return status_reply(self)

    def count_sent(self, n: int) -> None:
        with self.lock:
            self.bytes_sent += n
        self.metrics.bytes_sent.inc(n)
