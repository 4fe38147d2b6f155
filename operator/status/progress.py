"""Pure: how far a job is toward its bound, and about how long it has left (the Progress and ETA
columns of `kubectl get ddj`).

A job ends at the first bound it reaches (operator/status/job.py `ending`): a token budget
(`spec.training.tokenBudget`, against the syncer's tokensMerged), a step count
(`spec.training.steps`, slots of the shared schedule) or a duration (`spec.training.durationSeconds`,
since status.startTime). Each bound set gives a candidate; the one shown is the one expected
first (the smallest ETA), or the furthest along while no rate is known.

Steps: the operator never sees a learner's step until it finishes (operator/status/steps.py).
What it sees is the outer version, the sum of the fragments' versions: each slot of the
schedule closes one round per shard and each round's merge adds one version, so outerVersion /
spec.syncer.shards counts the slots merged, the schedule's position that the learners follow and
stop at. It is an estimate (a round with only late pushes adds a version, a slot whose pushes
were all refused adds none), so a steps job shows at most 99% until every learner has finished.

The ETA is the bound's remaining units over the rate observed across the last `WINDOW` seconds
of passes (outerVersion and tokensMerged sampled into `progressDetail.samples`): it assumes the
job goes on as fast as it went lately, capacity, losses and refusals included, so it moves with
them. A duration's ETA is exact. Deterministic in its inputs: the clock is `obs.now`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from diloco.operator.reconcile.observation import Observation
from diloco.operator.status import conditions as c
from diloco.spec import JobSpec

Unit = Literal["tokens", "steps", "seconds"]
WINDOW = 600.0  # seconds: the rate is measured over about the last ten minutes of passes
SPACING = WINDOW / 4  # a new sample at most this often, so the memory stays a handful of entries
MIN_SPAN = 60.0  # seconds: a shorter baseline gives a rate too noisy to project from
ENDED_BY: dict[str, Unit] = {"TokenBudgetReached": "tokens", "StepsReached": "steps", "DurationReached": "seconds"}


@dataclass(frozen=True)
class Toward:
    """One bound the job may end at: `done` of `bound` `unit`s, at `rate` units a second (0: unknown)."""

    unit: Unit
    done: int
    bound: int
    rate: float

    @property
    def eta(self) -> float | None:
        """Seconds left at the current rate; None while no rate is known."""
        return max(0, self.bound - self.done) / self.rate if self.rate > 0 else None


def human(seconds: float) -> str:
    """A duration in the two largest units, short enough for a kubectl column ("2h13m", "45s")."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 600:
        return f"{s // 60}m{s % 60}s" if s % 60 else f"{s // 60}m"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        h, m = divmod(s // 60, 60)
        return f"{h}h{m}m" if m else f"{h}h"
    d, h = divmod(s // 3600, 24)
    if d > 999:
        return ">999d"
    return f"{d}d{h}h" if h and d < 10 else f"{d}d"


def samples(before: dict[str, Any], *, now: float, outer: int, tokens: int, fresh: bool,
            running: bool) -> list[dict[str, Any]]:
    """The rate memory after this pass: counters sampled at most every SPACING seconds, the oldest
    kept being the newest one at least WINDOW old. Emptied when the job does not run (a resume
    measures afresh), and when a counter fell (a syncer that restarted without its newest
    checkpoint) or the clock went back: a rate across those would be nonsense."""
    if not running:
        return []
    kept = [dict(x) for x in (before.get("progressDetail") or {}).get("samples") or []]
    if any(x["at"] > now or x["outerVersion"] > outer or x["tokensMerged"] > tokens for x in kept):
        kept = []
    if fresh and (not kept or now - kept[-1]["at"] >= SPACING):
        kept.append({"at": round(now, 3), "outerVersion": outer, "tokensMerged": tokens})
    while len(kept) > 1 and now - kept[1]["at"] >= WINDOW:
        kept.pop(0)
    return kept


def rate(memory: list[dict[str, Any]], key: str, value: int, now: float) -> float:
    """`key`'s growth a second from the oldest sample to now; 0 over less than MIN_SPAN."""
    if not memory or now - memory[0]["at"] < MIN_SPAN:
        return 0.0
    return max(0, value - memory[0][key]) / (now - memory[0]["at"])


def candidates(spec: JobSpec, after: dict[str, Any], memory: list[dict[str, Any]], *, now: float,
               start: float | None, fresh: bool, running: bool) -> list[Toward]:
    """One entry per bound the spec sets; rates only from a syncer that answered in a running job
    (a duration's rate is the clock's own, from the job's start)."""
    tr, out = spec.training, []
    outer, tokens = int(after.get("outerVersion") or 0), int(after.get("tokensMerged") or 0)
    measured = fresh and running
    if tr.token_budget:
        out.append(Toward("tokens", tokens, tr.token_budget,
                          rate(memory, "tokensMerged", tokens, now) if measured else 0.0))
    if tr.steps:
        shards = spec.syncer.shards
        out.append(Toward("steps", min(outer // shards, tr.steps), tr.steps,
                          rate(memory, "outerVersion", outer, now) / shards if measured else 0.0))
    if tr.duration_seconds:
        elapsed = max(0.0, now - start) if start is not None else 0.0  # a clock gone back: not started yet
        out.append(Toward("seconds", int(elapsed), max(1, round(tr.duration_seconds)),
                          1.0 if running and start is not None else 0.0))
    return out


def pick(options: list[Toward], ended_by: Unit | None) -> Toward:
    """The bound shown: the one the job ended at, else the one expected first, else the furthest along."""
    named = [t for t in options if t.unit == ended_by]
    if named:
        return named[0]
    timed = [t for t in options if t.eta is not None]
    if timed:
        return min(timed, key=lambda t: t.eta or 0.0)
    return max(options, key=lambda t: t.done / t.bound)


def fields(spec: JobSpec, before: dict[str, Any], after: dict[str, Any], obs: Observation, *,
           running: bool, start: float | None, end: float | None) -> dict[str, Any]:
    """`progress`, `eta` and `progressDetail` of the next status. `before` is the previous status;
    `after` the next one as computed so far (its counters and conditions); `start` and `end` its
    startTime and completionTime as Unix seconds. None clears a field in the merge patch: a job
    without a bound has neither column, and the ETA is absent while unknown or once the job ends."""
    now = end if end is not None else obs.now  # a finished job's elapsed time stops growing
    conds = after.get("conditions") or []
    won = c.find(conds, c.SUCCEEDED) if c.is_true(conds, c.SUCCEEDED) else None
    memory = samples(before, now=obs.now, outer=int(after.get("outerVersion") or 0),
                     tokens=int(after.get("tokensMerged") or 0), fresh=obs.syncer is not None, running=running)
    options = candidates(spec, after, memory, now=now, start=start, fresh=obs.syncer is not None, running=running)
    if not options:
        return {"progress": None, "eta": None, "progressDetail": None}
    shown = pick(options, ENDED_BY.get(str(won.get("reason"))) if won else None)
    if won is not None:
        percent = 100.0
        shown = Toward(shown.unit, max(shown.done, shown.bound), shown.bound, 0.0)
    else:  # not ended by a bound: short of it, whatever an estimate says
        percent = min(99.9, 100.0 * shown.done / shown.bound)
    eta = shown.eta if running else None
    detail = {"unit": shown.unit, "done": shown.done, "bound": shown.bound, "percent": round(percent, 1),
              "rate": round(shown.rate, 6) if running else 0.0, "samples": memory}
    return {"progress": f"{int(percent)}%", "eta": human(eta) if eta is not None else None, "progressDetail": detail}
