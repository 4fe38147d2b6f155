"""The syncer's core: it drives rounds and owns the state the other parts share.

The parts, each with one job: `Admission` (syncer/admission.py) decides which pushes may be
taken, the `RoundBook` (diloco/core/rounds.py) when a round closes, `GlobalModel`
(syncer/state.py) merges and steps Θ, the `Publisher` (syncer/publisher.py) encodes each version
once for every subscriber, and the servicer (syncer/servicer.py) only translates RPCs.

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import numpy as np

from diloco.checkpoint import CheckpointStore
from diloco.core.codecs import CodecError, Pieces, decode_tensors, encoded_size
from diloco.core.fragments import owned_by, owner
from diloco.core.merge import Source
from diloco.core.rounds import Closed, Contribution, RoundBook, Verdict
from diloco.spec import Syncer as SyncerSpec
from diloco.syncer.admission import Admission, Refused, check_header, outer_gradient
from diloco.syncer.counters import RESTART_WINDOW, SLACK_CYCLES, Counters, credit_limit
from diloco.syncer.lease import PublishLease
from diloco.syncer.metrics import SyncerMetrics
from diloco.syncer.publisher import CHAIN, Publisher, Update
from diloco.syncer.state import GlobalModel, MergeResult, Outer
from diloco.syncer.status import status_reply
from diloco.wire import pb

log = logging.getLogger("diloco.syncer")
LIVE_SECONDS = 30.0  # a learner seen this recently (or subscribed) is live: its id is taken
# A push this recent means learners are training against this syncer: re-admissions' bulk
# streams are paced then (syncer/pacing.py), and go unpaced when nobody pushes (every learner
# re-joining a restarted syncer), since no round is waiting.
ROUNDS_RUNNING_SECONDS = 10.0


@dataclass
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


@dataclass
class SyncerCore:
    """Everything but the transport: admission, merging, publishing, checkpoints."""

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
    published_slot: list[int] = field(default_factory=list)  # per fragment: newest slot merged
    # One merge at a time; Recover and checkpoints take it too (they read or replace Θ and momentum).
    merging: threading.Lock = field(default_factory=threading.Lock)
    in_merge: int | None = None  # the fragment whose closed round is being merged outside the lock
    exclusive_waiting: int = 0  # checkpoints and Recovers waiting for `merging`
    shard: int = 0  # of spec.shards: this process merges, checkpoints and publishes its fragments only
    # spec.training.batchSize x spec.model.context: the most tokens one inner step trains, which
    # bounds what a push may report (syncer/admission.py Counters).
    tokens_per_step: int = 0

    def region_of(self, learner: str) -> str:
        info = self.learners.get(learner)
        region = info.region if info else ""
        return region if region in self.regions else "other"

    def __post_init__(self) -> None:
        self.book: RoundBook[Outer] = self.model.round_book()
        self.published_slot = list(self.book.closed_slot)
        self.admission = Admission(self.model.plan.num_fragments, self.spec.max_norm_ratio)
        # A syncer that has merged nothing (a fresh job) has no learners whose counters began before it.
        self.counters = Counters(self.tokens_per_step, self.spec.fragments,
                                 started=self.clock() - (RESTART_WINDOW if self.model.outer_steps == 0 else 0.0))
        self.last_publish = self.clock()
        self.max_push_bytes = [
            sum(encoded_size(s, "fp32") + len(n) + 10 for n, s in self.model.shapes(p).items()) + 8
            for p in range(self.model.plan.num_fragments)
        ]
        self.metrics.outer_version.set(sum(self.model.versions))
        self.max_recover_bytes = sum(self.max_push_bytes) + 1024  # every fragment in fp32: the whole model
        self.lease = PublishLease.open(self.store.dir if self.store else None, self.model.versions)
        self.publisher = Publisher(self.spec.broadcast_compression, self.spec.block_size, self.model.tag)
        if not 0 <= self.shard < self.spec.shards:
            raise ValueError(f"shard {self.shard} of {self.spec.shards}: shards are numbered 0 to {self.spec.shards - 1}")
        self.owned = owned_by(self.shard, self.model.plan.num_fragments, self.spec.shards)
        self.model.keep_only(self.owned)  # a shard holds its own fragments' tensors only
        for p in self.owned:
            self.publisher.reset(p, self.model.versions[p], self.model.fragment(p), self.published_slot[p])

    # -- admission -----------------------------------------------------------------

    def admit(self, header: pb.PushHeader, blob: bytes | memoryview) -> pb.PushReply:
        """Validate one push and offer it to its round; state changes only if accepted."""
        self.check_header(header)
        p = header.fragment
        tensors, norm = outer_gradient(blob, p, self.model.shapes(p))
        key = f"{header.learner}/{header.session}"
        with self.lock:
            info = self.learners.setdefault(header.learner, LearnerInfo(region=header.region))
            info.last_seen = self.clock()
            if math.isfinite(header.loss) and header.loss >= 0:  # shown in status only; never trusted further
                info.loss = header.loss
            self.last_push = info.last_seen
            if (merged_into := self.admission.retried((header.learner, header.session), header.push_id)) is not None:
                return pb.PushReply(accepted=True, version=self.model.versions[p], merged_into=merged_into)
            origin = (header.learner, int(header.session))
            self.counters.observe_step(header.learner, header.step_seconds)
            self.counters.check(origin, p, int(header.base_version), int(header.steps), int(header.tokens), info.last_seen)
            c = Contribution(header.learner, p, int(header.base_version), int(header.steps), int(header.tokens),
                             dict[str, Source](tensors), session=int(header.session), push_id=int(header.push_id),
                             slot=int(header.slot) if header.push_id else None,
                             trained_tokens=credit_limit(int(header.trained_tokens), self.model.known_tokens(key),
                                                         int(header.tokens)), received_at=info.last_seen)
            ratio = self.admission.check_norm(p, norm, header.learner)
            if ratio is not None:
                self.metrics.norm_ratio.observe(ratio)
            if (median := self.counters.step_median()) is not None:  # one vote per learner: no liar moves it
                self.book.observe_step_time(median)
            offer = self.book.offer(c, self.clock(), self.model.versions[p])
            if offer.verdict is not Verdict.ACCEPTED:
                self.count_refusal("stale" if offer.verdict is Verdict.STALE else "future")
                return pb.PushReply(accepted=False, reason=offer.reason, version=self.model.versions[p])
            # The open round closes into the next version, or the one after if p is being merged now.
            merged_into = self.model.versions[p] + (2 if self.in_merge == p else 1)
            self.admission.taken(c.origin, c.push_id, p, norm, merged_into)
            self.model.report(key, c.trained_tokens)
            info.contributions += 1
            info.bytes_received += len(blob)
            info.staleness += offer.lag
            self.bytes_received += len(blob)
            region = self.region_of(header.learner)
            self.metrics.bytes_received.inc(len(blob))
            self.metrics.region_bytes.labels(region).inc(len(blob))
            self.metrics.contributions.labels("accepted").inc()
            self.metrics.staleness.observe(offer.lag)
            self.metrics.region_staleness.labels(region).observe(offer.lag)
            self.lock.notify_all()
            return pb.PushReply(accepted=True, version=self.model.versions[p], merged_into=merged_into,
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

    def check_state_count(self, learner: str, count: int) -> None:
        """A donor's AdamW step count, which sets the joiner's bias correction, within the steps
        the job's accepted pushes vouch for. Not the donor's own: a re-admitted learner carries on
        the count of the peer whose moments it adopted."""
        with self.lock:
            bound = self.model.tokens_trained() // max(self.tokens_per_step, 1) + SLACK_CYCLES * self.spec.fragments
        if not 0 < count <= bound:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"optimizer state at step {count}: the job's learners have trained at most {bound} steps "
                          f"as their pushes report (learner {learner!r})", "counters")

    def count_refusal(self, outcome: str) -> None:
        with self.lock:
            self.refused += 1
            self.refused_by[outcome] = self.refused_by.get(outcome, 0) + 1
        self.metrics.contributions.labels(outcome).inc()

    def check_header(self, h: pb.PushHeader) -> None:
        """Raise Refused if a push header or its sender's session is unacceptable (before the body)."""
        check_header(h, self.incarnation, self.max_push_bytes, self.spec.shards)
        if h.fragment not in self.owned:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"fragment {h.fragment} belongs to syncer shard "
                          f"{owner(h.fragment, self.spec.shards)}, not to this one ({self.shard})", "misrouted")
        self.check_session(h.learner, h.session_secret)

    def recover(self, fragments: list[int], versions: list[int], blob: bytes | memoryview, tags: list[bytes]) -> list[int]:
        """Adopt global fragments a learner received from a previous incarnation of this syncer
        when they are newer than ours (we restarted from an older checkpoint), only at a version
        the publish lease says could have been published, and only with the provenance tag that
        syncer sent them with: then they are a merge we would otherwise lose, not values a token
        holder made up."""
        num = self.model.plan.num_fragments
        if len(fragments) != len(versions) or len(set(fragments)) != len(fragments) or any(p >= num for p in fragments):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "recover: fragments must be distinct, known, one version each")
        if foreign := [p for p in fragments if p not in self.owned]:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"recover: fragments {foreign} belong to other syncer "
                          f"shards than this one ({self.shard})", "misrouted")
        if len(tags) != len(fragments):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "recover: one provenance tag per fragment is required",
                          "forged")
        expect = {n: s for p in fragments for n, s in self.model.shapes(p).items()}
        try:
            tensors = decode_tensors(blob, expect)
        except CodecError as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"recover: {exc}") from None
        if not all(np.all(np.isfinite(t)) for t in tensors.values()):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "recover: fragments hold NaN or Inf", "nonfinite")
        with self.lock:
            newer = [(p, v) for p, v in zip(fragments, versions) if v > self.model.versions[p]]
            beyond = [(p, v) for p, v in newer if not self.lease.allows(p, v)]
        if beyond:
            p, v = beyond[0]
            log.warning("refused a recovery offer beyond the publish lease (fragment %d, version %d)", p, v)
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                          f"recover: fragment {p} at version {v} is beyond any version this job's syncer has "
                          "published (its publish lease); nothing was adopted", "forged")
        for (p, v), t in zip(zip(fragments, versions), tags):
            if (p, v) in newer and not self.model.tag_matches(p, v, tensors, t):
                log.warning("refused a recovery offer without a valid provenance tag (fragment %d, version %d)", p, v)
                raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                              f"recover: fragment {p} at version {v} does not carry this job's provenance tag "
                              "(not published by its syncer); nothing was adopted", "forged")
        adopted = []
        with self.exclusive(), self.lock:  # not while a merge of the fragment is in flight
            for p, v in newer:
                if v > self.model.versions[p]:
                    for n in self.model.plan.fragments[p]:
                        self.model.params[n] = tensors[n].astype(np.float32, copy=True)
                    self.model.versions[p] = v
                    # The open round stays: its outer gradients are progress, valid on any base.
                    adopted.append(p)
                    self.publisher.reset(p, v, self.model.fragment(p), self.published_slot[p])
            if adopted:
                self.metrics.outer_version.set(sum(self.model.versions))
                self.lock.notify_all()
        if adopted:
            log.info("recovered fragments %s from a learner; versions now %s", adopted, self.model.versions)
        return adopted

    def headroom(self) -> int:
        """What this shard's heap grows by past seeding, at most: a Join's snapshot keeps a
        whole view alive while every fragment is republished under it, and each fragment keeps
        CHAIN compressed deltas (syncer/publisher.py). The syncer faults it in at start."""
        codec, block = self.spec.broadcast_compression, self.spec.block_size
        return sum(encoded_size(s, "fp32") + CHAIN * encoded_size(s, codec, block)
                   for p in self.owned for s in self.model.shapes(p).values())

    # -- merging and publishing ----------------------------------------------------

    def rounds_running(self) -> bool:
        """Learners are pushing to this syncer (one did in the last ROUNDS_RUNNING_SECONDS)."""
        return self.clock() - self.last_push < ROUNDS_RUNNING_SECONDS

    def active_learners(self) -> set[str]:
        return {name for name, info in self.learners.items() if info.subscriptions > 0}

    def merge_ready(self, flush: bool = False) -> list[int]:
        """Close and apply every round that is due (with `flush`: every round holding
        anything, before the final checkpoint); returns the fragments published.

        Admission never waits for a merge: a round is taken under the lock, merged outside it
        (the RDA and the outer step are most of the syncer's work), committed under it, then
        published outside it. `merging` keeps merges, Recover and checkpoints one at a time."""
        done: list[int] = []
        while True:
            with self.lock:  # one round at a time, standing aside for a waiting checkpoint or Recover
                while self.exclusive_waiting:
                    self.lock.wait(timeout=0.05)
            with self.merging:
                with self.lock:
                    now = self.clock()
                    due = self.book.pending() if flush else self.book.ready(now, self.active_learners())
                    if not due:
                        return done
                    p, t0 = due[0], self.clock()
                    deadline = self.book.deadline(p) or now
                    closed = self.book.close(p, self.model.versions[p])
                    self.in_merge = p  # pushes admitted meanwhile merge into the version after
                    active = len(self.active_learners())
                try:
                    merged = self.model.merge(closed, active)
                finally:
                    with self.lock:
                        self.in_merge = None
                with self.lock:
                    self.lease.reserve(p, self.model.versions[p] + 1, self.model.versions)
                    result = self.model.commit(merged)
                    self.counters.merged_into([(c.origin, c.received_at) for c in closed.contributions], p,
                                              result.version)
                    self.published_slot[p] = closed.slot
                    values = self.model.fragment(p)
                    self._count_merge(result, closed, now, deadline)
                    self.lock.notify_all()
                self.publisher.publish(p, result.version, values, closed.slot)
                self.book.published(self.clock() - t0)
            done.append(p)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """No merge in flight (checkpoints, Recover). The merge thread checks for waiters before
        each round: rounds due back to back would otherwise starve them (a lock is not fair)."""
        with self.lock:
            self.exclusive_waiting += 1
        try:
            with self.merging:
                yield
        finally:
            with self.lock:
                self.exclusive_waiting -= 1
                self.lock.notify_all()

    def _count_merge(self, result: MergeResult, closed: Closed[Outer], now: float, deadline: float) -> None:
        """Status and metrics of a committed merge (caller holds the lock)."""
        for learner, credit in result.credits.items():
            self.learners[learner].tokens += credit
            self.metrics.region_tokens.labels(self.region_of(learner)).inc(credit)
        self.last_publish = self.clock()
        self.metrics.merges.inc()
        self.metrics.tokens.inc(result.tokens)
        self.metrics.quorum_size.observe(len(closed.contributions))
        self.metrics.grace_wait.observe(max(0.0, now - (deadline - self.book.timings.grace(self.book.policy))))
        self.metrics.outer_version.set(sum(self.model.versions))
        self.metrics.step_seconds.set(self.book.timings.step.get())
        self.metrics.last_publish.set(time.time())

    def wait_for_round(self, longest: float = 0.5) -> None:
        """Sleep until a round may be due: an accepted push wakes us, else the next grace deadline."""
        with self.lock:
            if not self.book.ready(self.clock(), self.active_learners()):
                self.lock.wait(timeout=min(max(self.next_wakeup() - self.clock(), 0.001), longest))

    def next_wakeup(self) -> float:
        with self.lock:
            deadlines = [d for p in range(self.model.plan.num_fragments) if (d := self.book.deadline(p)) is not None]
        return min(deadlines) if deadlines else self.clock() + 0.5

    def checkpoint(self) -> bool:
        """Write a checkpoint; on failure log a clear error, keep the previous one, keep going."""
        if self.store is None:
            return False
        started = time.monotonic()
        with self.exclusive(), self.lock:  # momentum is advanced by merges outside the lock
            self.model.schedule = self.book.schedule_state()
            arrays, meta = self.model.state()
            arrays = {k: v.copy() for k, v in arrays.items()}
            version = sum(self.model.versions)
        held = time.monotonic() - started
        try:
            path = self.store.save(arrays, meta)
        except OSError as exc:
            self.metrics.checkpoint_errors.inc()
            log.error("checkpoint failed in %s: %s; the previous checkpoint is intact, training goes on",
                      self.store.dir, exc)
            return False
        self.checkpoint_version = version
        # Nothing here touches the directory again: its path may already name another volume.
        log.info("checkpoint %s at outer version %d: %d MB of state in %.2f s (%.2f s of it holding the merges)",
                 path.name, version, sum(a.nbytes for a in arrays.values()) >> 20, time.monotonic() - started, held)
        return True

    # -- subscriptions -------------------------------------------------------------

    def updates(self, known: list[int], exact: bool, alive: Callable[[], bool]) -> Iterator[Update]:
        """A subscription's messages (syncer/publisher.py): each version encoded once for all."""
        return self.publisher.updates(known, exact, alive)

    def stop(self) -> None:
        """Shutting down: subscriptions end, the final merges and checkpoint follow."""
        self.stopping = True
        self.publisher.stop()
        with self.lock:
            self.lock.notify_all()

    # -- learners and status -------------------------------------------------------

    def join(self, learner: str, region: str, process: int, supersede: bool) -> tuple[pb.JoinHeader, Pieces]:
        """Admit a (re)joining learner: its session, and the global model as every subscriber
        holds it (the broadcast view), so its subscription continues the shared delta chain."""
        secret = self.open_session(learner, process, supersede)
        with self.lock:
            info = self.learners.setdefault(learner, LearnerInfo())
            info.region, info.last_seen = region, self.clock()
            info.joins += 1
            slot, job_tokens = self.book.next_slot, self.job_tokens()
        held, blob, tagged = self.publisher.snapshot()
        versions = [held.get(p, 0) for p in range(self.model.plan.num_fragments)]
        tags = [tagged.get(p, b"") for p in range(self.model.plan.num_fragments)]
        self.metrics.joins.labels("readmission" if info.joins > 1 else "first").inc()
        log.info("learner %s joined (%s, join #%d)", learner, region, info.joins)
        header = pb.JoinHeader(
            incarnation=self.incarnation, versions=versions, total_bytes=blob.size,
            fragments=[pb.FragmentNames(names=list(f)) for f in self.model.plan.fragments],
            codec=self.spec.compression, block_size=self.spec.block_size, slot=slot, tags=tags,
            session_secret=secret, shard=self.shard, shards=self.spec.shards,
            resume_tokens=self.model.credited_to(learner), job_tokens=job_tokens,
        )
        return header, blob

    @contextlib.contextmanager
    def subscribed(self, learner: str) -> Iterator[None]:
        """While a subscription stream is open, its learner counts as active."""
        with self.lock:
            info = self.learners.setdefault(learner, LearnerInfo())
            info.subscriptions += 1
        self.set_active_gauges()
        try:
            yield
        finally:
            with self.lock:
                info.subscriptions -= 1
            self.set_active_gauges()

    def versions(self) -> list[int]:
        with self.lock:
            return list(self.model.versions)

    def status(self) -> pb.StatusReply:
        return status_reply(self)

    def set_active_gauges(self) -> None:
        with self.lock:
            active = self.active_learners()
            self.metrics.active.set(len(active))
            for region in self.regions | {self.region_of(n) for n in self.learners}:
                self.metrics.region_learners.labels(region).set(sum(1 for n in active if self.region_of(n) == region))

    def count_sent(self, n: int) -> None:
        with self.lock:
            self.bytes_sent += n
        self.metrics.bytes_sent.inc(n)
