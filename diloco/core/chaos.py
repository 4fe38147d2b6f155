"""The chaos schedule: when each kill is due and whom it takes. Pure and seeded.

Kill k is due at the k-th arrival of a Poisson process (rate 1 / meanSecondsBetweenKills)
counted from the schedule's origin. A due kill waits while `maxConcurrent` targets are down
or no target is up, and is made as soon as it is allowed: never skipped, so a slow start does
not thin the schedule. Its victim is a seeded pick among the targets up at that moment, by
name as the job knows them (learner ids, `syncer`), whatever order they are listed in.

To resume, a supervisor keeps only the origin and the number of kills made (the local runner
in memory, the operator in `status.chaos`), so a restart neither repeats nor skips a kill.
The local runner and the operator both call `ChaosSchedule.plan`: one manifest kills the same
targets in the same order in both.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from diloco.spec import Chaos

SYNCER = "syncer"  # the syncer's name as a chaos target


@dataclass(frozen=True)
class Kill:
    number: int  # 0 for the schedule's first kill
    target: str


@dataclass
class ChaosSchedule:
    chaos: Chaos
    _arrivals: list[float] = field(default_factory=list, init=False)
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(f"diloco-chaos/{self.chaos.seed}")

    def due_at(self, k: int) -> float:
        """Seconds after the origin at which kill k falls due."""
        while len(self._arrivals) <= k:
            last = self._arrivals[-1] if self._arrivals else 0.0
            self._arrivals.append(last + self._rng.expovariate(1.0 / self.chaos.mean_seconds_between_kills))
        return self._arrivals[k]

    def due(self, elapsed: float, done: int) -> int:
        """Kills due by `elapsed` seconds beyond the `done` already made."""
        k = done
        while self.due_at(k) <= elapsed:
            k += 1
        return k - done

    def victim(self, k: int, up: Iterable[str]) -> str:
        """The target kill k takes among those up: seeded by k, independent of listing order."""
        return random.Random(f"diloco-chaos/{self.chaos.seed}/{k}").choice(sorted(up))

    def targets(self, learners: Iterable[str], syncer: bool = True) -> list[str]:
        """The names the schedule may kill, of the learners and (if there is one here) the syncer."""
        out = sorted(learners) if "learners" in self.chaos.targets else []
        return out + [SYNCER] if syncer and SYNCER in self.chaos.targets else out

    def plan(self, elapsed: float, done: int, expected: Collection[str], up: Collection[str]) -> list[Kill]:
        """The kills to make now. `expected`: the targets that should be running (`targets`);
        `up`: those running now. Targets expected but not up count against maxConcurrent."""
        if not self.chaos.enabled:
            return []
        alive = {t for t in expected if t in up}
        budget = max(0, self.chaos.max_concurrent - (len(set(expected)) - len(alive)))
        kills: list[Kill] = []
        for k in range(done, done + min(self.due(elapsed, done), budget)):
            if not alive:
                break
            target = self.victim(k, alive)
            alive.discard(target)
            kills.append(Kill(k, target))
        return kills
