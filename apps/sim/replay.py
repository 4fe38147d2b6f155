"""A deterministic replay of Decoupled DiLoCo: one process, a virtual clock, scripted speeds.

The real protocol without the timing noise of real processes: the learners' books and
schedule (`diloco.core.ledger`, `diloco.core.schedule`), the syncer's own round driver
(`diloco.syncer.round.RoundDriver`: admission's norm bound, the rounds, merging, the outer step
and publishing, as the syncer runs them) fed the real push bytes, the step-time vote of the
syncer's counters,
and whatever inner step the caller passes (`Trainer`: the real JAX model in
`bench/replay.py`, a toy in the tests). Learners' step times, start times, kills and the
network latency are scripted, so two runs of one script are identical and an ablation
differs from its baseline only by the knob it turns.

Published fragments reach learners through the syncer's own `Publisher`, in
`spec.syncer.broadcastCompression`: each learner holds the view V_p the product's learners hold
(deltas with error feedback; a joiner, the fp32 snapshot of the views), so a
broadcast codec's cost is measured here without the timing noise. Simplifications, on
purpose: computing a step takes no virtual time beyond its scripted step time; the syncer's
merge and encode take no virtual time.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from diloco.core.codecs import Blob
from diloco.core.ledger import Arrival, Ledger, absorb, prepare_push
from diloco.core.schedule import JobProgress, Schedule
from diloco.spec import Syncer as SyncerSpec
from diloco.syncer.acceptance import Admission, Refused, outer_gradient
from diloco.syncer.counter_bounds import Counters
from diloco.syncer.global_model import GlobalModel
from diloco.syncer.publisher import Publisher
from diloco.syncer.round import RoundDriver
from diloco.wire import pb, push_header

Tensors = dict[str, np.ndarray]


class Trainer(Protocol):
    """The learners' inner computation, `m` naming the learner (its data shard)."""

    tokens_per_step: int  # what one inner step trains

    def fresh_state(self, m: int, params: Tensors) -> Any: ...

    def step(self, m: int, params: Tensors, state: Any, position: int) -> tuple[Tensors, Any, int]:
        """One inner step with the learning rate of schedule position `position` (the job's
        progress: JobProgress): (new params, new state, tokens trained)."""
        ...


@dataclass(kw_only=True)
class Script:
    """One learner's timeline in virtual seconds."""

    step_seconds: float = 1.0
    start: float = 0.0
    jitter: float = 0.05  # each step takes step_seconds x (1 ± jitter), seeded: real steps vary
    outages: list[tuple[float, float]] = field(default_factory=list)  # (killed at, back at)
    pauses: list[tuple[float, float]] = field(default_factory=list)  # (from, seconds): frozen, not killed


@dataclass(kw_only=True)
class _Learner:
    m: int
    script: Script
    life: int = 0
    alive: bool = False
    done: bool = False
    params: Tensors = field(default_factory=dict)
    state: Any = None
    ledger: Ledger | None = None
    schedule: Schedule | None = None
    session: int = 0
    push_seq: int = 0
    session_tokens: int = 0  # this life's (the push header's cumulative counter)
    earlier_tokens: int = 0  # earlier lives'
    steps: int = 0
    progress: JobProgress | None = None  # where the learning-rate schedule stands (as the learner's)
    refused: list[tuple[int, int]] = field(default_factory=list)
    accepted: list[tuple[int, int, int, bool]] = field(default_factory=list)
    inbox: dict[int, Arrival] = field(default_factory=dict)


@dataclass(frozen=True)
class Sent:
    """A push on its way to the syncer: its header and bytes, and when its learner sent it."""

    header: pb.PushHeader
    blob: bytes | Blob
    at: float


@dataclass(kw_only=True)
class ReplayResult:
    params: Tensors
    rounds: list[int]  # learners per merged round
    tokens_trained: int
    tokens_merged: int  # less than trained only by what kills threw away before it was pushed
    skipped_slots: int
    refused: int
    outer_steps: int
    curve: list[tuple[float, int, Tensors]] = field(default_factory=list)  # (time, slot, Θ) snapshots


class Replay:
    def __init__(self, spec: SyncerSpec, params0: Tensors, trainer: Trainer, scripts: list[Script], *,
                 steps: int, latency: float = 0.05, adoption: str = "rebase", peer_state: bool = True,
                 snapshot_every: float | None = None, seed: int = 0) -> None:
        self.spec, self.trainer, self.steps, self.latency = spec, trainer, steps, latency
        self.adoption, self.peer_state = adoption, peer_state
        self.model = GlobalModel.fresh(spec, params0)
        # The syncer's round, on the virtual clock, publishing straight to the learners.
        admission = Admission(num_fragments=self.model.plan.num_fragments, max_norm_ratio=spec.max_norm_ratio)
        self.driver = RoundDriver(model=self.model, admission=admission, publish=self._publish, clock=lambda: self.now)
        self.book = self.driver.book
        # The broadcast: V_p per fragment, advanced by each published delta as every learner's is.
        self.publisher = Publisher(spec.broadcast_compression, spec.block_size, self.model.tag)
        for p in range(self.model.plan.num_fragments):
            self.publisher.reset(p, self.model.versions[p], self.model.fragment(p))
        self.steps_voted = Counters(max(trainer.tokens_per_step, 1), spec.fragments, started=0.0)  # the step-time vote
        self.fragments = [list(f) for f in self.model.plan.fragments]
        self.learners = [_Learner(m=m, script=s) for m, s in enumerate(scripts)]
        # How a (re)joining learner's schedule starts; ablations swap in one deaf to the syncer.
        self.schedule_factory: Callable[[int, int, int], Schedule] = lambda num, slot, m: Schedule(num, slot, per_slot=spec.shards)
        self.rngs = [np.random.default_rng([seed, m]) for m in range(len(scripts))]
        self.events: list[tuple[float, int, str, tuple[Any, ...]]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.rounds: list[int] = []
        self.refused = 0
        self.ticks: set[float] = set()  # deadlines with a tick scheduled
        self.killed_at: dict[tuple[int, int], float] = {}  # (learner, life) -> when it was killed
        self.snapshot_every = snapshot_every
        self.curve: list[tuple[float, int, Tensors]] = []

    # -- the event loop ---------------------------------------------------------------

    def at(self, t: float, kind: str, *args: Any) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, args))

    def run(self) -> ReplayResult:
        for lr in self.learners:
            self.at(lr.script.start, "join", lr.m)
            for down, up in lr.script.outages:
                self.at(down, "kill", lr.m)
                self.at(up, "join", lr.m)
        if self.snapshot_every:
            self.at(0.0, "snapshot")
        while self.events:
            self.now, _, kind, args = heapq.heappop(self.events)
            getattr(self, f"_on_{kind}")(*args)
            if kind != "snapshot" and all(lr.done for lr in self.learners) and not self._traffic():
                break
        self._merge(flush=True)  # the syncer's final flush
        return ReplayResult(params={n: v.copy() for n, v in self.model.params.items()}, rounds=self.rounds,
                            tokens_trained=sum(lr.session_tokens + lr.earlier_tokens for lr in self.learners),
                            tokens_merged=self.model.tokens_merged,
                            skipped_slots=sum(lr.schedule.skipped for lr in self.learners if lr.schedule),
                            refused=self.refused, outer_steps=self.model.outer_steps, curve=self.curve)

    def _traffic(self) -> bool:
        return any(kind in ("arrive", "tick") for _, _, kind, _ in self.events)

    def _on_snapshot(self) -> None:
        slot = max((lr.schedule.slot for lr in self.learners if lr.schedule), default=0)
        self.curve.append((self.now, slot, {n: v.copy() for n, v in self.model.params.items()}))
        if self.snapshot_every and not all(lr.done for lr in self.learners):
            self.at(self.now + self.snapshot_every, "snapshot")

    # -- learners ---------------------------------------------------------------------

    def _on_join(self, m: int) -> None:
        lr = self.learners[m]
        if lr.done:
            return
        lr.life += 1
        lr.alive = True
        lr.params = {n: v.copy() for h in self.publisher.heads.values() for n, v in h.view.items()}  # the Join's V
        lr.ledger = Ledger(self.fragments, lr.params, self.model.versions, self.adoption)  # type: ignore[arg-type]
        lr.schedule = self.schedule_factory(len(self.fragments), self.book.next_slot, m)
        lr.progress = JobProgress(len(self.learners), self.trainer.tokens_per_step)
        lr.progress.observe(self.model.job_tokens())  # the Join reply's count
        lr.state = self.trainer.fresh_state(m, lr.params)
        peers = [o for o in self.learners if o.alive and o.m != m and o.state is not None]
        if self.peer_state and peers and lr.schedule.slot > 0:  # spec.training.peerOptimizerState
            lr.state = peers[0].state  # a live peer's AdamW moments (immutable arrays: shared, not copied)
        lr.session, lr.push_seq = lr.life, 0
        lr.earlier_tokens += lr.session_tokens  # a new process counts its tokens from zero
        lr.session_tokens = 0
        lr.refused, lr.accepted, lr.inbox = [], [], {}
        self.at(self.now, "step", m, lr.life)

    def _on_kill(self, m: int) -> None:
        lr = self.learners[m]
        if not lr.alive:
            return
        self.killed_at[(m, lr.life)] = self.now
        lr.alive = False
        lr.life += 1

    def _on_step(self, m: int, life: int) -> None:
        lr = self.learners[m]
        if not lr.alive or lr.life != life:
            return
        assert lr.ledger is not None and lr.schedule is not None and lr.progress is not None
        _absorb(lr, self.fragments)
        if lr.schedule.slot >= self.steps:
            self._flush(lr)
            return
        lr.params, lr.state, tokens = self.trainer.step(m, lr.params, lr.state, lr.progress.position())
        lr.progress.stepped()
        lr.ledger.stepped(tokens)
        lr.session_tokens += tokens
        lr.steps += 1
        slot, due = lr.schedule.take()
        t_done = self.now + lr.script.step_seconds * (1 + lr.script.jitter * (2 * self.rngs[m].random() - 1))
        for start, seconds in lr.script.pauses:  # a SIGSTOP: the step in progress ends late
            if self.now <= start < t_done:
                t_done += seconds
        for p in due:
            if not lr.ledger.busy(p):
                self._push(lr, p, slot, t_done)
        self.at(t_done, "step", m, life)

    def _push(self, lr: _Learner, p: int, slot: int, t_sent: float) -> None:
        assert lr.ledger is not None
        lr.push_seq += 1
        push = prepare_push(lr.ledger, p, {n: lr.params[n] for n in self.fragments[p]}, codec=self.spec.compression,
                            block_size=self.spec.block_size, push_id=lr.push_seq, slot=slot,
                            session_tokens=lr.session_tokens, incarnation="", step_seconds=lr.script.step_seconds,
                            loss=0.0, train_seconds=0.0)
        header = push_header(push, learner=f"l{lr.m}", region="", session=lr.session, secret=b"")
        self.at(t_sent + self.latency, "arrive", lr.m, lr.life, Sent(header, push.blob, t_sent))

    def _flush(self, lr: _Learner) -> None:
        """The end of the job for this learner: push everything unpushed, each fragment in its
        next due slot (as the learner's flush does: the syncer refuses a slot not due for it),
        then stop."""
        assert lr.ledger is not None and lr.schedule is not None
        for p in range(len(self.fragments)):
            if lr.ledger.unpushed(p):
                self._push(lr, p, lr.schedule.next_slot_of(p), self.now)
        lr.done = True

    # -- the syncer -------------------------------------------------------------------

    def _active(self) -> set[str]:
        return {f"l{lr.m}" for lr in self.learners if lr.alive}

    def _on_arrive(self, m: int, life: int, sent: Sent) -> None:
        """A push reaches the syncer: parsed and offered to its round as the syncer does
        (syncer/core.py `admit`, less the transport's checks), then due rounds merge."""
        if self.killed_at.get((m, life), float("inf")) < sent.at:
            return  # its learner died before the step that made it ended: never sent
        h, p = sent.header, sent.header.fragment
        tensors, norm = outer_gradient(sent.blob, p, self.model.shapes(p))
        self.steps_voted.observe_step(h.learner, h.step_seconds)
        reply: tuple[Any, ...] = ("refused", p, h.push_id)
        try:
            taken = self.driver.offer(h, tensors, norm, step_time=self.steps_voted.step_median(), received_at=self.now)
        except Refused:  # an outlier (spec.syncer.maxNormRatio)
            taken = None
        if taken is not None and taken.accepted:
            reply = ("accepted", p, h.push_id, taken.merged_into, taken.offer.late)
        else:
            self.refused += 1
        self.at(self.now + self.latency, "reply", m, life, reply)
        self._merge()

    def _on_tick(self) -> None:
        self.ticks.discard(self.now)
        self._merge()

    def _merge(self, flush: bool = False) -> None:
        """Every due round, through the syncer's driver; then a tick at each open round's deadline."""
        for done in self.driver.merge_ready(self._active, flush=flush):
            self.rounds.append(len({c.learner for c in done.closed.contributions}))
        for deadline in self.driver.deadlines():
            if deadline > self.now and deadline not in self.ticks:
                self.ticks.add(deadline)
                self.at(deadline, "tick")

    def _publish(self, p: int, version: int, values: Mapping[str, np.ndarray], slot: int) -> None:
        """The driver's publish: the publisher encodes Θ_p's delta against V_p and advances V_p;
        each live learner receives the new V_p (what it decodes, bit for bit) after the latency."""
        self.publisher.publish(p, version, values, slot)
        arrival = Arrival(version, dict(self.publisher.heads[p].view), slot + 1, self.model.job_tokens())
        for lr in self.learners:
            if lr.alive:
                self.at(self.now + self.latency, "publish", lr.m, lr.life, p, arrival)

    def _on_reply(self, m: int, life: int, reply: tuple[Any, ...]) -> None:
        lr = self.learners[m]
        if lr.life != life:
            return
        if reply[0] == "accepted":
            lr.accepted.append(reply[1:])
        else:
            lr.refused.append(reply[1:])

    def _on_publish(self, m: int, life: int, p: int, arrival: Arrival) -> None:
        lr = self.learners[m]
        if lr.life == life:
            lr.inbox[p] = arrival  # the newest version wins, as in the product's inbox


def _absorb(lr: _Learner, fragments: list[list[str]]) -> None:
    """What reached a learner since its last step (replies and published fragments), absorbed as
    the product's learner absorbs them (diloco/core/ledger.py `absorb`)."""
    assert lr.ledger is not None and lr.schedule is not None and lr.progress is not None

    def shift(values: Tensors) -> None:
        lr.params.update({n: lr.params[n] + v for n, v in values.items()})

    absorb(lr.ledger, lr.schedule, lambda p: {n: lr.params[n] for n in fragments[p]}, shift,
           refused=lr.refused, accepted=lr.accepted, published=lr.inbox)
    for arrival in lr.inbox.values():
        lr.progress.observe(arrival.job_tokens)
    lr.refused, lr.accepted, lr.inbox = [], [], {}


def toy_trainer(directions: list[Tensors]) -> Trainer:
    """Each step of learner m adds `directions[m]` to its weights: progress independent of θ,
    so conservation of progress can be checked exactly."""

    class Toy:
        tokens_per_step = 1

        def fresh_state(self, m: int, params: Tensors) -> Any:
            return None

        def step(self, m: int, params: Tensors, state: Any, position: int) -> tuple[Tensors, Any, int]:
            return {n: v + directions[m][n] for n, v in params.items()}, None, 1

    return Toy()

