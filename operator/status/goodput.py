"""Goodput as the paper means it, and availability beside it: pure functions over the job's
status and what the syncer last said (docs/OPERATIONS.md, "Reading goodput and badput").

- **Goodput**: tokens whose updates reached Θ (merged by the syncer, this cluster's regions)
  over the tokens the job's capacity could have trained meanwhile: every desired learner at
  its group's measured step rate (batchSize x context per step, the median step time the
  syncer hears from the group's region), for as long as the job ran.
- **Badput** by reason, as shares of that capacity: `down` (desired learners not connected),
  `refused` (pushes thrown away: stale, out of bounds, outliers; each counted as one step of one
  learner, what a learner refused at every step loses; an isolated refusal loses up to P steps,
  so this is a lower bound), `other` (the rest: starting and joining, work a kill threw away
  before it was pushed, merges still in flight, evaluations).
- **Availability**: desired learner-seconds during which the syncer saw that many learners
  connected, over all desired learner-seconds: the figure `status.goodput` showed before 0.2.
  A connected learner whose pushes are all refused is available and not productive.

The running sums live in `status.accounting`, so an operator restart continues them.
"""

from __future__ import annotations

from typing import Any

from diloco.operator.reconcile.observation import Observation
from diloco.spec import JobSpec

MAX_SAMPLE_GAP = 120.0  # seconds: a longer gap (the operator was down) is not counted


def advance(spec: JobSpec, status: dict[str, Any], obs: Observation, *, desired: int, active: int,
            counting: bool) -> dict[str, Any]:
    """The accounting after one more sample at `obs.now`."""
    acc: dict[str, Any] = {"desiredLearnerSeconds": 0.0, "activeLearnerSeconds": 0.0, "downLearnerSeconds": 0.0,
                           "groupSeconds": {}, "stepSeconds": {}, "usefulTokens": 0, "refusedPushes": 0,
                           **(status.get("accounting") or {})}
    acc["groupSeconds"], acc["stepSeconds"] = dict(acc["groupSeconds"]), dict(acc["stepSeconds"])
    last = acc.get("sampledAt")
    gap = obs.now - last if isinstance(last, (int, float)) else None
    sampled = counting and gap is not None and 0 < gap <= MAX_SAMPLE_GAP
    if sampled:
        assert gap is not None
        acc["desiredLearnerSeconds"] = round(acc["desiredLearnerSeconds"] + desired * gap, 3)
        acc["activeLearnerSeconds"] = round(acc["activeLearnerSeconds"] + min(active, desired) * gap, 3)
        acc["downLearnerSeconds"] = round(acc["downLearnerSeconds"] + max(0, desired - active) * gap, 3)
        for g in spec.learner_groups:
            acc["groupSeconds"][g.name] = round(acc["groupSeconds"].get(g.name, 0.0) + g.replicas * gap, 3)
    view = obs.syncer
    if view is not None:
        regions = {r.region: r for r in view.regions}
        for g in spec.learner_groups:  # the newest measured step time of each group's region
            r = regions.get(g.region)
            if r is not None and r.step_seconds > 0:
                acc["stepSeconds"][g.name] = round(r.step_seconds, 6)
        mine = {g.region for g in spec.learner_groups}
        merged = sum(r.tokens_merged for r in view.regions if r.region in mine) if view.regions else view.tokens_merged
        same = acc.get("lastIncarnation") == view.incarnation
        # A restarted syncer resumes from its checkpoint, and its refusal count starts at 0.
        if sampled and isinstance(acc.get("lastTokensMerged"), int) and merged >= acc["lastTokensMerged"]:
            acc["usefulTokens"] += merged - acc["lastTokensMerged"]
        if sampled and same and isinstance(acc.get("lastRefused"), int) and view.refused >= acc["lastRefused"]:
            acc["refusedPushes"] += view.refused - acc["lastRefused"]
        acc.update(lastTokensMerged=merged, lastRefused=view.refused, lastIncarnation=view.incarnation)
    acc["sampledAt"] = round(obs.now, 3)
    return acc


def capacity_tokens(spec: JobSpec, acc: dict[str, Any]) -> float | None:
    """What the desired learners could have trained: each group's learner-seconds at its measured
    rate (a group never measured takes the median of the others'). None until a step is measured."""
    steps = {k: v for k, v in (acc.get("stepSeconds") or {}).items() if isinstance(v, (int, float)) and v > 0}
    if not steps:
        return None
    fallback = sorted(steps.values())[len(steps) // 2]
    return sum(seconds * spec.tokens_per_step / steps.get(group, fallback)
               for group, seconds in (acc.get("groupSeconds") or {}).items())


def figures(spec: JobSpec, acc: dict[str, Any]) -> dict[str, Any]:
    """goodput, availability and badput for the status (each absent until it means something)."""
    out: dict[str, Any] = {}
    if acc["desiredLearnerSeconds"] > 0:
        out["availability"] = round(min(1.0, acc["activeLearnerSeconds"] / acc["desiredLearnerSeconds"]), 3)
    capacity = capacity_tokens(spec, acc)
    if capacity:
        rate = capacity / acc["desiredLearnerSeconds"] if acc["desiredLearnerSeconds"] > 0 else 0.0
        goodput = min(1.0, acc["usefulTokens"] / capacity)
        down = min(1.0 - goodput, acc["downLearnerSeconds"] * rate / capacity)
        refused = min(1.0 - goodput - down, acc["refusedPushes"] * spec.tokens_per_step / capacity)
        out["goodput"] = round(goodput, 3)
        out["badput"] = {"down": round(down, 3), "refused": round(refused, 3),
                         "other": round(max(0.0, 1.0 - goodput - down - refused), 3)}
    return out
