"""Bounds on the counters a push reports (docs/OPERATIONS.md, "Integrity").

A push reports the inner steps and tokens since its anchor and its process's cumulative trained
tokens. They set its merge weight (w = tokens x tokens/steps), the job's trained-token count
(the token budget) and every learner's learning-rate position (core/schedule.py JobProgress),
so a learner holding the job token could steer all three by lying. Nothing a learner says can
be checked against its data; what the syncer can check it against is its own clock:

- tokens <= steps x batchSize x context: exact, the spec fixes what one step trains;
- steps <= the time since the process's counters last started over, over the job's step time
  divided by SPEED, plus SLACK_CYCLES schedule cycles. The counters start over when a push of
  the process is merged (rebase keeps only what the merge did not contain) or at its Join. The
  step time is the median of the learners' reported ones, one vote per learner, so a minority
  cannot move it. Wall time, not the fragment's recent pushes, is the measure: a syncer starved
  of CPU for a second merges nothing while learners step on, and their honest counts jump (the
  chaos example on two cores: 7 x P once, where a bound relative to recent pushes refused 18
  honest pushes in 150 s).
- a process's trained tokens advance, per accepted push, by at most that push's own (so
  bounded) tokens: `credit_limit`.

What stays open: in the first `RESTART_WINDOW` of a syncer restored from a checkpoint, while
learners that lived through the restart settle, steps are bounded by tokens and the outlier
norm only. No clock here: `now` comes in, so every rule is tested deterministically.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

import grpc

from diloco.core.rounds import Ema
from diloco.syncer.acceptance import Refused

# A learner may step this many times faster than the job's median learner. Mixed chip
# generations in one job differ by about 2-3x (the paper's mixed run); beyond 4x the rest of
# the job is a straggler to it anyway.
SPEED = 4.0
# Allowance in schedule cycles (P steps each) for what the clock cannot see: a push made before
# it was received, and the steps of a merged push the learner had not yet adopted.
SLACK_CYCLES = 2
# After a restart from a checkpoint, learners re-join with counters that began before this
# incarnation: steps are not bounded for this long (learners retry a lost syncer for seconds).
RESTART_WINDOW = 120.0
HISTORY = 4  # merged pushes remembered per process and fragment: anchors it may not yet have adopted


@dataclass
class Counters:
    tokens_per_step: int  # spec.training.batchSize x spec.model.context
    cycle: int  # P: the slots in which every fragment is due once
    started: float  # when this syncer incarnation started (its clock)
    step_seconds: dict[str, Ema] = field(default_factory=dict)  # per learner: its reported step time
    joined: dict[tuple[str, int], float] = field(default_factory=dict)  # per process: its Join
    # per (process, fragment): (the version that merged one of its pushes, when that push arrived)
    merged: dict[tuple[tuple[str, int], int], deque[tuple[int, float]]] = field(default_factory=dict)
    max_ratio_seen: float = 0.0  # of every push checked, the largest steps over its bound

    def __post_init__(self) -> None:
        if self.tokens_per_step < 1 or self.cycle < 1:
            raise ValueError(f"tokens_per_step ({self.tokens_per_step}) and cycle ({self.cycle}) must be positive")

    def join(self, origin: tuple[str, int], now: float) -> None:
        """A process joined (or re-joined) under a learner id: its counters start over, and the
        id's earlier processes push no more (their sessions are superseded)."""
        learner = origin[0]
        self.joined = {o: t for o, t in self.joined.items() if o[0] != learner}
        self.merged = {k: v for k, v in self.merged.items() if k[0][0] != learner}
        self.joined[origin] = now

    def observe_step(self, learner: str, seconds: float) -> None:
        if seconds > 0:
            self.step_seconds.setdefault(learner, Ema()).update(seconds)

    def step_median(self) -> float | None:
        """The learners' median reported step time, one vote each (None: nobody said yet)."""
        said = [e.get() for e in self.step_seconds.values() if e.value is not None]
        return statistics.median(said) if said else None

    def step_floor(self) -> float | None:
        """The fastest step time believed: the median over SPEED."""
        median = self.step_median()
        return None if median is None else median / SPEED

    def since(self, origin: tuple[str, int], p: int, base_version: int) -> float | None:
        """When the process's counters for fragment p last started over, as far as a push
        against `base_version` can have (None: it never joined this syncer)."""
        anchors = [t for v, t in self.merged.get((origin, p), ()) if v <= base_version]
        return anchors[-1] if anchors else self.joined.get(origin)

    def steps_bound(self, origin: tuple[str, int], p: int, base_version: int, now: float) -> int | None:
        """None: no bound. So in a restarted syncer's first RESTART_WINDOW: learners that lived
        through the restart re-join with counters that began before it, hand merges back (Recover)
        and settle their ledgers over a few rounds (seen: an honest push with 16 steps 0.4 s after
        its learner re-joined, its last merge not yet taken off its counters)."""
        if now - self.started < RESTART_WINDOW:
            return None
        floor, since = self.step_floor(), self.since(origin, p, base_version)
        if floor is None or since is None:
            return None
        return int(max(0.0, now - since) / floor) + SLACK_CYCLES * self.cycle

    def check(self, origin: tuple[str, int], p: int, *, base_version: int, steps: int, tokens: int, now: float) -> None:
        """Raise Refused (outcome `counters`) if a push's counters are out of bounds."""
        if tokens > steps * self.tokens_per_step:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{tokens} tokens over {steps} inner steps exceed steps x batchSize x context = "
                          f"{steps * self.tokens_per_step}; re-sync from the global model", "counters")
        bound = self.steps_bound(origin, p, base_version, now)
        if bound is None:
            return
        self.max_ratio_seen = max(self.max_ratio_seen, steps / bound)
        if steps > bound:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{steps} inner steps since the anchor of fragment {p} exceed the {bound} this learner can "
                          f"have taken since its counters started over ({now - (self.since(origin, p, base_version) or now):.1f} s "
                          f"at {SPEED:g}x the job's median step time, plus {SLACK_CYCLES} cycles); re-sync from the "
                          "global model", "counters")

    def merged_into(self, pushes: list[tuple[tuple[str, int], float]], p: int, version: int) -> None:
        """A round of p merged into `version`: each process's counters start over from its push
        (its origin, and when the syncer took it)."""
        for origin, at in pushes:
            self.merged.setdefault((origin, p), deque(maxlen=HISTORY)).append((version, at))


def credit_limit(session_tokens: int, known: int, tokens: int) -> int:
    """A learner process's cumulative trained tokens (a push's `session_tokens`) as far as one
    accepted push can vouch for: at most `tokens` (the push's own, bounded by `Counters`) beyond
    what is already `known` of it. An honest process trains about one step between two of its pushes, far less than a
    push's P steps, so the limit only bites a liar (or, briefly, a process whose count this
    syncer last saw long ago: after a restart from an older checkpoint, it catches up over a
    few pushes)."""
    return min(session_tokens, known + tokens)
