"""Seeded chaos: when to kill, and whom. Pure; the clock and the random source come in.

Kills arrive as a Poisson process with the manifest's mean interval; a kill is
skipped (and the next one scheduled) while `maxConcurrent` targets are already down
or nobody eligible is up. The local runner and the operator both use this.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from diloco.spec import Chaos


@dataclass
class ChaosMonkey:
    chaos: Chaos
    start: float
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    next_at: float = field(init=False)

    def __post_init__(self) -> None:
        self.next_at = self.start + self.rng.expovariate(1.0 / self.chaos.mean_seconds_between_kills)

    def pick(self, now: float, up: Sequence[str], down: int) -> str | None:
        """The victim to kill now, if a kill is due and allowed; else None."""
        if not self.chaos.enabled or now < self.next_at:
            return None
        self.next_at = now + self.rng.expovariate(1.0 / self.chaos.mean_seconds_between_kills)
        if down >= self.chaos.max_concurrent or not up:
            return None
        return self.rng.choice(sorted(up))

    @classmethod
    def seeded(cls, chaos: Chaos, start: float) -> ChaosMonkey:
        return cls(chaos, start, random.Random(chaos.seed))
