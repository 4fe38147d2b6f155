"""One round, in order: offer → close → merge → commit → publish, with the clock injected.

The syncer (syncer/core.py) and the replay (apps/sim/replay.py) both run their rounds
through a `RoundDriver`: the syncer with its lock, its publish lease and the real publisher,
on the monotonic clock; the replay with no lock and a virtual clock, publishing straight to
its learners. So the replay runs the round the syncer runs, not a copy of it.

What the driver does not do: transport, sessions and headers (syncer/acceptance.py
`check_header`, checked once before a push's body is read), the counters' bounds
(syncer/counter_bounds.py) and learner bookkeeping. Those stay with the syncer core, which counts
each round from what `rounds` returns.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Protocol

import numpy as np

from diloco.checkpoint import process_key
from diloco.core.merge import Source, values_of
from diloco.core.rounds import Closed, Contribution, Offer, RoundBook, Verdict
from diloco.syncer.acceptance import Admission
from diloco.syncer.counter_bounds import credit_limit
from diloco.syncer.durable.lease import PublishLease
from diloco.syncer.global_model import GlobalModel, MergeResult, Outer, round_policy
from diloco.wire import pb

Publish = Callable[[int, int, Mapping[str, np.ndarray], int], None]  # (fragment, version, values, slot)


class Guard(Protocol):
    """The lock the driver takes around the book and Θ (a threading.Condition in the syncer)."""

    def __enter__(self) -> object: ...

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None, /) -> bool | None: ...

    def notify_all(self) -> None: ...

    def wait(self, timeout: float | None = None) -> bool: ...


class NoLock:
    """A `Guard` for a single thread (the replay)."""

    def __enter__(self) -> NoLock:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None, /) -> None:
        return None

    def notify_all(self) -> None:
        return None

    def wait(self, timeout: float | None = None) -> bool:
        return False


@dataclass(frozen=True)
class Taken:
    """An offered push's outcome: the book's verdict, the version it merges into (accepted
    only) and its norm over its fragment's median (None: not checked yet)."""

    offer: Offer
    merged_into: int = 0
    ratio: float | None = None

    @property
    def accepted(self) -> bool:
        return self.offer.verdict is Verdict.ACCEPTED


@dataclass(frozen=True)
class Round:
    """A round merged, committed and published."""

    closed: Closed[Outer]
    result: MergeResult
    closed_at: float  # the clock when it was closed
    deadline: float  # when it was due to close at the latest (closed_at if it had none)

    @property
    def fragment(self) -> int:
        return self.closed.fragment


def round_book(model: GlobalModel) -> RoundBook[Outer]:
    """The round book the model's spec asks for (the syncer's and the replay's), from the
    schedule it was checkpointed with."""
    policy = round_policy(model.spec, model.spec.fragments)  # P: the slots of a cycle
    book: RoundBook[Outer] = RoundBook(model.plan.num_fragments, policy, combine)
    if model.schedule:
        book.load_schedule(model.schedule)
    return book


def contribution(h: pb.PushHeader, payload: Outer, *, session_tokens: int, received_at: float) -> Contribution[Outer]:
    """The one conversion of a push's wire header (the learner made it from its `Push` record in
    one place too: diloco/wire.py `push_header`) into the syncer's merge input, `Contribution`,
    whose payload is the parsed outer gradient. `session_tokens` is the header's as far as the
    syncer credits it (syncer/counter_bounds.py `credit_limit`). A header without a push id (a
    learner from before the shared schedule) is on schedule by definition: no slot."""
    return Contribution(learner=h.learner, fragment=h.fragment, base_version=int(h.base_version), steps=int(h.steps),
                        tokens=int(h.tokens), payload=payload, session=int(h.session), push_id=int(h.push_id),
                        slot=int(h.slot) if h.push_id else None, session_tokens=session_tokens,
                        received_at=received_at)


def combine(old: Contribution[Outer], new: Contribution[Outer]) -> Contribution[Outer]:
    """Two pushes of one learner process in one round carry disjoint progress: add them."""
    payload = {n: values_of(old.payload[n]) + values_of(new.payload[n]) for n in old.payload}
    return replace(new, base_version=min(old.base_version, new.base_version), steps=old.steps + new.steps,
                   tokens=old.tokens + new.tokens, payload=payload,
                   session_tokens=max(old.session_tokens, new.session_tokens))


class RoundDriver:
    """The round book of every fragment and the sequence that turns a closed round into a
    published version. A round is closed under `lock`, merged outside it (the RDA and the outer
    step are most of the syncer's work, and admission never waits for them), committed under
    it, published outside it. `merging` keeps merges, Recover and checkpoints one at a time."""

    def __init__(self, *, model: GlobalModel, admission: Admission, publish: Publish,
                 clock: Callable[[], float], lock: Guard | None = None, lease: PublishLease | None = None):
        self.model, self.admission, self.publish, self.clock = model, admission, publish, clock
        self.lock: Guard = lock if lock is not None else NoLock()
        self.lease = lease
        self.book: RoundBook[Outer] = round_book(model)
        self.published_slot = list(self.book.closed_slot)  # per fragment: newest slot merged
        self.in_merge: int | None = None  # the fragment whose closed round is being merged outside the lock
        # One merge at a time; Recover and checkpoints take it too (they read or replace Θ and momentum).
        self.merging = threading.Lock()
        self.exclusive_waiting = 0  # checkpoints and Recovers waiting for `merging`

    def offer(self, h: pb.PushHeader, tensors: Mapping[str, Source], norm: float, *,
              step_time: float | None, received_at: float) -> Taken:
        """Offer an admitted push (header checked, outer gradient parsed) to its round: the
        outlier bound on its norm (raises Refused), the step time the grace window scales with
        (the learners' median), the book's verdict; if accepted, recorded for retries and its
        session tokens reported. The caller holds `lock`."""
        p, key = h.fragment, process_key(h.learner, h.session)
        c = contribution(h, dict[str, Source](tensors), received_at=received_at, session_tokens=credit_limit(
            int(h.session_tokens), self.model.credits.known(key), int(h.tokens)))
        ratio = self.admission.check_norm(p, norm, h.learner)
        if step_time is not None:
            self.book.observe_step_time(step_time)
        offer = self.book.offer(c, self.clock(), self.model.versions[p])
        if offer.verdict is not Verdict.ACCEPTED:
            return Taken(offer, ratio=ratio)
        # The open round closes into the next version, or the one after if p is being merged now.
        merged_into = self.model.versions[p] + (2 if self.in_merge == p else 1)
        self.admission.taken(c.origin, c.push_id, p=p, norm=norm, merged_into=merged_into)
        self.model.credits.report(key, c.session_tokens)
        return Taken(offer, merged_into, ratio)

    def merge_ready(self, active: Callable[[], set[str]], *, flush: bool = False) -> list[Round]:
        """Close and apply every round that is due (with `flush`: every round holding anything,
        before the final checkpoint), in turn; returns the rounds published."""
        return list(self.rounds(active, flush=flush))

    def rounds(self, active: Callable[[], set[str]], *, flush: bool = False) -> Iterator[Round]:
        """`merge_ready` one round at a time: each is yielded once published, holding no lock,
        so a caller counts it (the syncer's tallies) before the next is closed."""
        while True:
            with self.lock:  # one round at a time, standing aside for a waiting checkpoint or Recover
                while self.exclusive_waiting:
                    self.lock.wait(timeout=0.05)
            with self.merging:
                merged = self.merge_next(active, flush=flush)
            if merged is None:
                return
            yield merged

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """No merge in flight (checkpoints, Recover). `merge_ready` checks for waiters before
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

    def wait_for_round(self, active: Callable[[], set[str]], longest: float = 0.5) -> None:
        """Sleep until a round may be due: an accepted push wakes us (`lock` notified), else the
        next grace deadline."""
        with self.lock:
            if not self.book.ready(self.clock(), active()):
                deadlines = self.deadlines()
                wake = min(deadlines) if deadlines else self.clock() + 0.5
                self.lock.wait(timeout=min(max(wake - self.clock(), 0.001), longest))

    def merge_next(self, active: Callable[[], set[str]], *, flush: bool = False) -> Round | None:
        """Close, merge, commit and publish the first round that is due (with `flush`: the first
        holding anything); None when none is. `active`: the learners a round waits for, read
        under the lock."""
        with self.lock:
            now = self.clock()
            due = self.book.pending() if flush else self.book.ready(now, active())
            if not due:
                return None
            p, t0 = due[0], self.clock()
            deadline = self.book.deadline(p) or now
            closed = self.book.close(p, self.model.versions[p])
            self.in_merge = p  # pushes admitted meanwhile merge into the version after
            learners = len(active())
        try:
            merged = self.model.merge(closed, learners)
        finally:
            with self.lock:
                self.in_merge = None
        with self.lock:
            if self.lease is not None:
                self.lease.reserve(p, self.model.versions[p] + 1, self.model.versions)
            result = self.model.commit(merged)
            self.published_slot[p] = closed.slot
            values = self.model.fragment(p)
            done = Round(closed, result, now, deadline)
            self.lock.notify_all()
        self.publish(p, result.version, values, closed.slot)
        self.book.published(self.clock() - t0)
        return done

    def deadlines(self) -> list[float]:
        """The open rounds' latest closing times (the caller holds `lock`)."""
        return [d for p in range(self.model.plan.num_fragments) if (d := self.book.deadline(p)) is not None]
