"""Relaying a healthy peer's inner-optimizer state to a re-joining learner (docs/ALGORITHM.md,
"Re-admission").

A learner restarted mid-run gets the global model at Join but would start AdamW from zero
moments: its first steps are then sign steps of the full learning rate, and measured in the
replay harness a job with a kill every ~40 slots ended 10% worse than without kills, 3% with
the moments copied from a peer (docs/BENCHMARKS.md, "Re-admission"). The syncer holds no
optimizer state (it would double a learner's upload on every push); it relays one on demand:
the joiner waits in FetchState, the syncer asks the next other learner whose push it accepts
(`should_share` sets PushReply.share_state), and that learner uploads its moments. The bytes
are opaque here: the joiner checks them against its own state before adopting them.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

ASK_SECONDS = 5.0  # a donor that has not uploaded within this long is given up on: ask the next one
MAX_WAIT_SECONDS = 60.0  # the longest a FetchState may hold a server thread


@dataclass(frozen=True)
class Donated:
    donor: str
    count: int  # AdamW's step count with these moments
    blob: bytes


@dataclass
class StateRelay:
    """Who waits for state, whom we asked, and the one copy on hand while anybody waits
    (dropped when nobody does: at a 1e9-parameter model it is a model's worth of bytes)."""

    clock: Callable[[], float] = time.monotonic
    cond: threading.Condition = field(default_factory=threading.Condition)
    waiting: Counter[str] = field(default_factory=Counter)  # requester -> open FetchState calls
    asked: str | None = None
    asked_at: float = 0.0
    # Asked, and had nothing to share (too few steps of its own), and when: asked again only
    # ASK_SECONDS later. Learners that all (re)joined at once all decline at first; if a decline
    # stood while anybody waited, nobody would ever be asked again.
    declined: dict[str, float] = field(default_factory=dict)
    latest: Donated | None = None
    relayed: int = 0

    def should_share(self, learner: str) -> bool:
        """Called for each accepted push: whether to ask its learner for its state now. One
        donor at a time; never a learner for itself, nor one that declined in the last ASK_SECONDS."""
        with self.cond:
            now = self.clock()
            if not any(r != learner for r in self.waiting) or now - self.declined.get(learner, -math.inf) < ASK_SECONDS:
                return False
            if self.latest is not None and any(r != self.latest.donor for r in self.waiting):
                return False  # a copy is on hand for the waiters
            if self.asked is not None and now - self.asked_at < ASK_SECONDS:
                return False
            self.asked, self.asked_at = learner, now
            return True

    def offer(self, donor: str, count: int, blob: bytes) -> bool:
        """A donor's upload; False when nobody waits any more (the bytes are dropped)."""
        with self.cond:
            if self.asked == donor:
                self.asked = None
            if not self.waiting:
                return False
            self.latest = Donated(donor, count, blob)
            self.cond.notify_all()
            return True

    def decline(self, donor: str) -> None:
        """The donor had nothing worth sharing (it re-joined recently itself): ask another at once."""
        with self.cond:
            self.declined[donor] = self.clock()
            if self.asked == donor:
                self.asked = None

    def fetch(self, requester: str, wait: float, alive: Callable[[], bool] = lambda: True) -> Donated | None:
        """Wait up to `wait` seconds (at most MAX_WAIT_SECONDS) for another learner's state,
        giving up within a second once `alive()` is false (the call was cancelled, the server
        stops: a waiting handler must not hold the syncer's exit). The wait is on the real
        clock (it holds a server thread); whom to ask is on `clock`."""
        deadline = time.monotonic() + min(max(wait, 0.0), MAX_WAIT_SECONDS)
        with self.cond:
            self.waiting[requester] += 1
            try:
                while True:
                    got = self.latest
                    if got is not None and got.donor != requester:
                        self.relayed += 1
                        return got
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or not alive():
                        return None
                    self.cond.wait(min(remaining, 1.0))
            finally:
                self.waiting[requester] -= 1
                if self.waiting[requester] <= 0:
                    del self.waiting[requester]
                if not self.waiting:  # nobody left: forget the round of asking, free the copy
                    self.latest, self.asked = None, None
                    self.declined.clear()
