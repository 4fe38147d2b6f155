"""The shared fragment schedule (docs/ALGORITHM.md, "The shared schedule").

Slot s is due for fragment s mod P. Every learner fills one slot per inner step, and
all of them take their slot numbers from the syncer (the Join reply, then every
publish), not from their own step counters: learners that started at unrelated times
then push fragment p in the same step, so a healthy round holds one push from every
live learner and each fragment syncs once per P steps. A learner that fell behind
(slow, paused, just joined) jumps forward to the schedule and skips the slots it
missed; their progress is not lost, it rides along in that fragment's next push. A
faster learner never waits: it keeps filling slots, and the others follow it.

A syncer of N shards cuts each slot's share of the model in N: the plan then holds P·N
fragments, and slot s is due for the N fragments (s mod P)·N ... (s mod P)·N + N − 1, one
owned by each shard (fragment q by shard q mod N). Each shard's slot then carries 1/N of the
bytes, so N shards shorten every slot's chain (receive, merge, publish) instead of taking
turns at whole ones. With one shard this is the plain round robin above.
"""

from __future__ import annotations

from dataclasses import dataclass


def due_fragments(slot: int, num_fragments: int, per_slot: int = 1) -> range:
    """The fragments due in `slot` of a plan of `num_fragments`, `per_slot` (the shards) at a
    time: round robin over the P = num_fragments / per_slot slots of a cycle, so each fragment
    syncs every P slots."""
    first = slot % (num_fragments // per_slot) * per_slot
    return range(first, first + per_slot)


def slot_of(fragment: int, num_fragments: int, per_slot: int = 1) -> int:
    """Where `fragment` falls in the cycle: it is due in slots s with s mod P equal to this."""
    return fragment // per_slot % (num_fragments // per_slot)


@dataclass
class Schedule:
    num_fragments: int
    slot: int = 0  # the next slot this learner fills
    skipped: int = 0  # slots jumped over to catch up with the schedule
    per_slot: int = 1  # fragments due in each slot: the syncer's shards

    @property
    def cycle(self) -> int:
        """P: the slots in which every fragment is due once."""
        return self.num_fragments // self.per_slot

    def take(self) -> tuple[int, range]:
        """Fill the next slot after an inner step: (slot, the fragments due in it)."""
        slot = self.slot
        self.slot += 1
        return slot, due_fragments(slot, self.num_fragments, self.per_slot)

    def next_slot_of(self, fragment: int) -> int:
        """The first slot from the next one on in which `fragment` is due."""
        return self.slot + (slot_of(fragment, self.num_fragments, self.per_slot) - self.slot) % self.cycle

    def late(self, fragment: int) -> None:
        """A push of `fragment` came after its round closed: skip a slot, once per slot however
        many shards said so (only the slot's first fragment counts; the next publish's
        position corrects the rest)."""
        if fragment % self.per_slot == 0:
            self.skip()

    def skip(self, slots: int = 1) -> None:
        """Our push came after its round closed: we are behind the schedule, catch up."""
        self.slot += slots
        self.skipped += slots

    def observe(self, next_slot: int) -> int:
        """The syncer has merged every slot before `next_slot`; never fall behind it.
        Returns the slots skipped."""
        behind = next_slot - self.slot
        if behind <= 0:
            return 0
        self.slot += behind
        self.skipped += behind
        return behind


@dataclass
class JobProgress:
    """Where the job's learning-rate schedule stands, in steps of one learner: the job's trained
    tokens (the syncer says, with every publish and in the Join reply: merged, plus what accepted
    pushes report), plus our own tokens since it last said, over the tokens all M learners
    train in one step each.

    In a healthy job this is every learner's slot. While a learner is down its peers keep
    filling slots (on shared cores, faster), so slots run ahead of the job's tokens; a schedule
    driven by slots then spent the end of a token budget at the minimum rate (a chaos run:
    slot 415 at 304 steps' worth of tokens per learner; docs/BENCHMARKS.md §1). Never moves
    back: news that counts fewer of our own tokens than we assumed leaves it where it was."""

    learners: int  # M: the job's learners (its data shards)
    tokens_per_step: int  # one learner's batch x context
    job_tokens: int = 0  # the job's trained tokens, as the syncer last said
    since: int = 0  # our own steps since then
    at: int = 0

    def observe(self, job_tokens: int) -> None:
        if job_tokens > self.job_tokens:
            self.job_tokens, self.since = job_tokens, 0

    def stepped(self) -> None:
        self.since += 1

    def position(self) -> int:
        own = self.since * self.tokens_per_step
        self.at = max(self.at, (self.job_tokens + own) // (self.learners * self.tokens_per_step))
        return self.at
