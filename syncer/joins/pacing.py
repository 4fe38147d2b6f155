"""Pacing the bulk streams of re-admission: a Join's whole model and a peer's optimizer state.

A re-joining learner of a 1e9-parameter model reads 4 GB (and 2 GB of a peer's moments). Sent
as fast as the client reads, that took the syncer's core for seconds while eight other learners
waited for their rounds: measured, one Join made up to 11 consecutive slots late
(docs/BENCHMARKS.md §5). Every such stream takes its chunks' bytes from one shared budget, so
all re-admissions together use at most `rate` bytes a second of the syncer's sending, and the
rounds keep the rest of the core. A burst of `burst` bytes goes out at once, so a small model's
Join (the quickstart's is 2 MB) never waits. Only while learners push (`SyncerCore.rounds_running`):
with nobody training against the syncer, as when every learner re-joins a restarted one, no
round waits, and pacing would only make them all wait longer. The clock and sleep are passed in
(tests script them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Pacer:
    """A shared send budget of `rate` bytes a second (None: unpaced)."""

    def __init__(self, rate: float | None, burst: int = 64 << 20, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if rate is not None and rate <= 0:
            raise ValueError("a pacing rate must be positive bytes a second (or None: unpaced)")
        self.rate, self.burst, self.clock, self.sleep = rate, burst, clock, sleep
        self.lock = threading.Lock()
        self._free_at = float("-inf")  # when the bytes taken so far would have gone out at `rate`

    def take(self, n: int) -> float:
        """Wait until `n` more bytes fit the budget; returns the seconds waited. Streams that take
        at once share the rate in the order they asked."""
        if self.rate is None:
            return 0.0
        with self.lock:
            now = self.clock()
            self._free_at = max(self._free_at, now) + n / self.rate
            wait = self._free_at - now - self.burst / self.rate  # up to `burst` bytes may run ahead of the rate
        if wait > 1e-6:  # not rounding error at the burst's edge
            self.sleep(wait)
            return wait
        return 0.0
