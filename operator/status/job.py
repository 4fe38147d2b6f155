"""Pure status logic: phase, conditions, per-group counts, goodput, progress, and when a job ends.

Inputs are what the handlers observed (children, the syncer's Status RPC, Secrets the job
names) plus the previous status; the output is the next status. The syncer's answer is the
global picture (every region, every cluster); the group counts are this cluster's own.
Counters written by the pod handlers (lost, preempted, readmitted, restarts), multi-host
learners' runs (gangRuns) and accumulators (goodput, the ETA's rate) are carried over, so the
status is the operator's only memory and a restarted operator continues where the last one
stopped.
Every status written must fit `JobStatus` (diloco/spec/status.py), the CRD's status schema:
`changed` and `validated` check it before anything is patched.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from diloco.contract import LearnerId, incarnation_epoch, incarnation_host, shard_incarnations
from diloco.operator.failures import capacity
from diloco.operator.failures import policy as failures

# Re-exported: the status's inputs, read by its callers as st.Observation and st.SyncerView.
from diloco.operator.reconcile.observation import Observation as Observation
from diloco.operator.reconcile.observation import RegionView as RegionView
from diloco.operator.reconcile.observation import SyncerView as SyncerView
from diloco.operator.status import conditions as c
from diloco.operator.status import goodput, progress, steps
from diloco.spec import JobSpec, JobStatus, Phase

SYNCER_SWITCHING = "SyncerSwitching"  # Running's reason while a sharded standby's change waits for the old pods


def rfc3339(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> float | None:
    if not value:
        return None
    parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)).timestamp()


@dataclass(frozen=True)
class Ending:
    succeeded: bool
    reason: str
    message: str


def group_entry(status: dict[str, Any], name: str) -> dict[str, Any]:
    prior: dict[str, Any] = next((g for g in status.get("learnerGroups") or [] if g.get("name") == name), {})
    return {"name": name, "desired": 0, "ready": 0, "lost": 0, "preempted": 0, "readmitted": 0, **prior}


def slot_wanted(spec: JobSpec, slot: str) -> bool:
    """Whether learner `group-index` should run now (not suspended, group present, index in range)."""
    try:
        learner = LearnerId.parse(slot)
    except ValueError:
        return False
    g = next((x for x in spec.learner_groups if x.name == learner.group), None)
    return not spec.suspend and g is not None and learner.index < g.replicas


def started(status: dict[str, Any]) -> bool:
    return c.is_true(status.get("conditions") or [], c.CREATED)


def finished(status: dict[str, Any]) -> bool:
    conds = status.get("conditions") or []
    return c.is_true(conds, c.SUCCEEDED) or (c.is_true(conds, c.FAILED) and bool(status.get("completionTime")))


def ending(spec: JobSpec, status: dict[str, Any], obs: Observation) -> Ending | None:
    """Whether the job ends now, and how; None while it should keep training."""
    if spec.suspend:
        return None
    budget = spec.training.token_budget
    merged = obs.syncer.tokens_merged if obs.syncer else status.get("tokensMerged", 0)
    if budget and merged >= budget:
        return Ending(True, "TokenBudgetReached", f"{merged} tokens merged; the budget is {budget}")
    done = steps.message(spec, obs.finished, others_active(spec, obs.syncer))
    if done is not None:
        return Ending(True, steps.REASON, done)
    start = parse_time(status.get("startTime"))
    if start is not None:
        elapsed = obs.now - start
        if spec.training.duration_seconds and elapsed >= spec.training.duration_seconds:
            return Ending(True, "DurationReached", f"trained for {elapsed:.0f} s of spec.training.durationSeconds")
        deadline = spec.run_policy.active_deadline_seconds
        if deadline and elapsed >= deadline:
            return Ending(False, "DeadlineExceeded",
                          f"ran {elapsed:.0f} s, past spec.runPolicy.activeDeadlineSeconds={deadline}")
    waited = capacity.timed_out(list(obs.unschedulable), spec.run_policy.scheduling_timeout_seconds, obs.now)
    if waited is not None:
        return Ending(False, capacity.TIMED_OUT, waited)
    if obs.syncer_restarts > spec.run_policy.backoff_limit:
        return Ending(False, "BackoffLimitExceeded",
                      f"the syncer restarted {obs.syncer_restarts} times, over spec.runPolicy.backoffLimit="
                      f"{spec.run_policy.backoff_limit}")
    permanent = failures.exceeded(status, spec.run_policy.backoff_limit)
    if permanent is not None:  # pods that fail the same way on every retry (operator/failures/policy.py)
        return Ending(False, "BackoffLimitExceeded", permanent)
    if obs.image_stuck is not None:
        return Ending(False, failures.IMAGE, obs.image_stuck)
    return None


def compute(spec: JobSpec, status: dict[str, Any], obs: Observation, *, generation: int,
            ended: Ending | None = None) -> dict[str, Any]:
    """The next status of a valid job (a fresh `ended` or a recorded ending included)."""
    now = rfc3339(obs.now)
    out: dict[str, Any] = {"observedGeneration": generation}
    running = not spec.suspend and not finished(status) and ended is None
    desired = spec.total_learners if running else 0
    groups = []
    for g in spec.learner_groups:
        entry = group_entry(status, g.name)
        entry.update(region=g.region, desired=g.replicas if running else 0, ready=obs.ready.get(g.name, 0))
        if g.hosts_per_learner > 1:
            entry.setdefault("restarts", 0)  # whole-gang restarts of its multi-host learners
        groups.append(entry)
    ready = sum(g["ready"] for g in groups)
    out.update(learnerGroups=groups, desiredLearners=desired, readyLearners=ready, learners=f"{ready}/{desired}")
    out["lostLearners"] = [x for x in status.get("lostLearners") or [] if slot_wanted(spec, x.get("slot", ""))]
    if "gangRuns" in status:  # multi-host learners' runs (operator/failures/gangs.py), kept for those still wanted
        out["gangRuns"] = [x for x in status["gangRuns"] or [] if slot_wanted(spec, x.get("learner", ""))]
    syncer: dict[str, Any] = {"endpoint": obs.syncer_endpoint, "ready": obs.syncer_ready,
                              "restarts": obs.syncer_restarts}
    if spec.syncer.external is not None:
        syncer["external"] = True
    if obs.exposed_address:
        syncer["exposedAddress"] = obs.exposed_address
    syncer.update(active_syncer(status.get("syncer") or {}, obs.syncer.incarnation if obs.syncer else None))
    if obs.syncer:
        syncer.update(incarnation=obs.syncer.incarnation, activeLearners=obs.syncer.active_learners,
                      readmissions=obs.syncer.readmissions)
        out.update(outerVersion=obs.syncer.outer_version, tokensMerged=obs.syncer.tokens_merged,
                   regions=[region_entry(r) for r in obs.syncer.regions])
    else:  # the last known picture, until the syncer answers again
        out.update(outerVersion=status.get("outerVersion", 0), tokensMerged=status.get("tokensMerged", 0),
                   regions=status.get("regions") or [])
    out["syncer"] = syncer
    for kept in (failures.FIELD, "startedSpec"):  # the failure count, the immutable fields' values
        if kept in status:
            out[kept] = status[kept]

    if running and not status.get("startTime"):
        out["startTime"] = now
    elif spec.suspend and status.get("startTime"):
        out["startTime"] = None  # as for a Job: a resume starts the deadline's clock again
    active = own_active(spec, obs.syncer) if obs.syncer else 0
    out["accounting"] = acc = goodput.advance(spec, status, obs, desired=desired, active=active, counting=running)
    out.update(goodput.figures(spec, acc))

    conds = _conditions(spec, status, conds=list(status.get("conditions") or []), out=out, obs=obs, ended=ended,
                        running=running, ready=ready, desired=desired, now=now, gen=generation)
    out["conditions"] = conds
    out["phase"] = phase(conds, spec.suspend)
    start = out["startTime"] if "startTime" in out else status.get("startTime")
    out.update(progress.fields(spec, status, out, obs, running=running, start=parse_time(start),
                               end=parse_time(out.get("completionTime") or status.get("completionTime"))))
    return out


def own_active(spec: JobSpec, view: SyncerView) -> int:
    """Connected learners of this manifest's regions: in a multi-cluster job the syncer's total
    also counts other clusters', which would hide this cluster's losses from its goodput."""
    if not view.regions:
        return view.active_learners
    mine = {g.region for g in spec.learner_groups}
    return sum(r.active_learners for r in view.regions if r.region in mine)


def others_active(spec: JobSpec, view: SyncerView | None) -> int:
    """Learners of other clusters' regions connected to this cluster's syncer (0 in a cluster
    whose syncer is external: its job's end removes its own learners only)."""
    if view is None or spec.syncer.external is not None or not view.regions:
        return 0
    return max(0, view.active_learners - own_active(spec, view))


def region_entry(r: RegionView) -> dict[str, Any]:
    return {"region": r.region, "learners": r.learners, "activeLearners": r.active_learners,
            "tokensMerged": r.tokens_merged, "bytesReceived": r.bytes_received, "contributions": r.contributions,
            "meanStaleness": round(r.mean_staleness, 3)}


def _running(obs: Observation, *, running: bool, syncer_ready: bool, ready: int, desired: int) -> tuple[bool, str, str]:
    """The Running condition: (status, reason, message); a blocker or an unreachable syncer says why not."""
    up = running and syncer_ready and ready > 0 and obs.blocker is None
    if running and obs.blocker is not None:
        return False, obs.blocker.reason, obs.blocker.message
    if running and not syncer_ready and obs.syncer_switch:
        return False, SYNCER_SWITCHING, (f"the sharded syncer's standby changed: its new syncers start once "
                                         f"{', '.join(obs.syncer_switch)} are gone (each old one writes its final "
                                         f"checkpoint as it stops); {ready} of {desired} learners ready")
    if running and not syncer_ready and obs.syncer_error:
        return False, "SyncerUnreachable", (f"the syncer at {obs.syncer_endpoint} did not answer its Status RPC "
                                            f"({obs.syncer_error}); {ready} of {desired} learners ready")
    return up, "LearnersTraining" if up else "NotRunning", \
        f"{ready} of {desired} learners ready; syncer {'' if syncer_ready else 'not '}ready"


def _conditions(spec: JobSpec, status: dict[str, Any], *, conds: list[dict[str, Any]], out: dict[str, Any],
                obs: Observation, ended: Ending | None, running: bool, ready: int, desired: int, now: str,
                gen: int) -> list[dict[str, Any]]:
    if not spec.suspend or started(status):
        conds = c.set_condition(conds, c.CREATED, True, reason="ChildrenCreated", message="children created", now=now,
                                generation=gen)
    conds = c.set_condition(conds, c.SUSPENDED, spec.suspend, reason="Suspended" if spec.suspend else "NotSuspended",
                            message="spec.suspend is true: no learners run" if spec.suspend else "", now=now,
                            generation=gen)
    if ended is not None:
        out["completionTime"] = now
        kind = c.SUCCEEDED if ended.succeeded else c.FAILED
        conds = c.set_condition(conds, kind, True, reason=ended.reason, message=ended.message, now=now, generation=gen)
    elif not finished(status):
        conds = c.set_condition(conds, c.FAILED, False, reason="SpecValid", message="", now=now, generation=gen)
    up, reason, message = _running(obs, running=running, syncer_ready=out["syncer"]["ready"], ready=ready,
                                   desired=desired)
    conds = c.set_condition(conds, c.RUNNING, up, reason=reason, message=message, now=now, generation=gen)
    conds = failures.condition(conds, status, limit=spec.run_policy.backoff_limit, now=now, generation=gen)
    conds = capacity.condition(conds, list(obs.unschedulable), timeout=spec.run_policy.scheduling_timeout_seconds,
                               stamp=now, generation=gen)
    degraded = up and ready < desired
    message = ""
    if degraded:
        lost = sorted(x["slot"] for x in out["lostLearners"])
        message = (f"{desired - ready} of {desired} learners not ready" + (f"; lost: {', '.join(lost)}" if lost else "")
                   + steps.pending(spec, obs.finished))
    return c.set_condition(conds, c.DEGRADED, degraded,
                           reason="LearnersUnavailable" if degraded else "AllLearnersReady",
                           message=message, now=now, generation=gen)


def phase(conds: list[dict[str, Any]], suspended: bool) -> Phase:
    if c.is_true(conds, c.SUCCEEDED):
        return "Succeeded"
    if c.is_true(conds, c.FAILED):
        return "Failed"
    if suspended:
        return "Suspended"
    return "Running" if c.is_true(conds, c.RUNNING) else "Pending"


def invalid(status: dict[str, Any], problems: list[str], generation: int, now: float) -> dict[str, Any]:
    """A spec the operator cannot run: Failed/InvalidSpec naming each field; children untouched."""
    conds = c.set_condition(list(status.get("conditions") or []), c.FAILED, True, reason="InvalidSpec",
                            message="; ".join(problems), now=rfc3339(now), generation=generation)
    return {"observedGeneration": generation, "phase": "Failed", "conditions": conds}


def validated(status: dict[str, Any]) -> dict[str, Any]:
    """`status` (a whole one, or a merge patch of whole top-level fields), once JobStatus accepts it.
    The API server prunes a field the CRD's schema lacks without a word; a misspelt key, or a new
    one not added to diloco/spec/status.py, fails here (and so in tests) instead."""
    JobStatus.model_validate(status)
    return status


def changed(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The keys of `new` that differ from `old`, ignoring the goodput sampling clock alone; `new`
    is validated first, as every status the operator writes passes through here or `validated`."""
    validated(new)
    out = {k: v for k, v in new.items() if old.get(k) != v}
    if set(out) == {"accounting"} and {k: v for k, v in new["accounting"].items() if k != "sampledAt"} == \
            {k: v for k, v in (old.get("accounting") or {}).items() if k != "sampledAt"}:
        return {}
    return out


def active_syncer(before: dict[str, Any], incarnation: str | None) -> dict[str, Any]:
    """With a standby (spec.syncer.standby): which pod holds the syncer's lease (`active`), its
    epoch, and the takeovers counted so far (an epoch above the last one seen, with a holder
    before it). The lease's holder and epoch ride in the syncer's incarnation
    (diloco/contract.py `leased_incarnation`); while the syncer is silent, the last known.
    A sharded syncer's incarnation holds each shard's (`shard_incarnations`): `active` names each
    shard's holder in shard order, `leaseEpochs` keeps each shard's epoch (`leaseEpoch` their
    sum) and every shard's takeovers count."""
    kept: dict[str, Any] = {k: before[k] for k in ("active", "leaseEpoch", "leaseEpochs", "takeovers") if k in before}
    shards = shard_incarnations(incarnation or "")
    if len(shards) > 1:
        return _active_shards(before, shards) or kept
    epoch = incarnation_epoch(incarnation or "")
    if not epoch:
        return kept
    previous = int(before.get("leaseEpoch") or 0)
    takeovers = int(before.get("takeovers") or 0) + (1 if previous and epoch > previous else 0)
    return {"active": incarnation_host(incarnation or ""), "leaseEpoch": epoch, "takeovers": takeovers}


def _active_shards(before: dict[str, Any], shards: list[str]) -> dict[str, Any] | None:
    """`active_syncer` for a sharded syncer's shard incarnations; None when none holds a lease."""
    epochs = [incarnation_epoch(x) for x in shards]
    if not any(epochs):
        return None
    previous = [int(x) for x in before.get("leaseEpochs") or []]
    previous = previous if len(previous) == len(epochs) else [0] * len(epochs)  # the first pass that sees them
    took = sum(1 for was, now in zip(previous, epochs, strict=True) if was and now > was)
    return {"active": ",".join(incarnation_host(x) or "" for x in shards), "leaseEpoch": sum(epochs),
            "leaseEpochs": epochs, "takeovers": int(before.get("takeovers") or 0) + took}


def takeover(old: dict[str, Any], new: dict[str, Any]) -> tuple[str, str] | None:
    """The `SyncerTakeover` Event's reason and message when `new` counts a takeover `old` did not;
    for a sharded syncer, naming each shard whose lease changed hands."""
    before, after = old.get("syncer") or {}, new.get("syncer") or {}
    if int(after.get("takeovers") or 0) <= int(before.get("takeovers") or 0):
        return None
    tail = "; learners re-join it and hand back what its checkpoint missed"
    epochs, was = list(after.get("leaseEpochs") or []), list(before.get("leaseEpochs") or [])
    if epochs and len(was) == len(epochs):
        holders = str(after.get("active") or "").split(",")
        previous = str(before.get("active") or "").split(",")
        told = [f"shard {i}: syncer {holders[i] if i < len(holders) else '?'} took over the lease (epoch {now}) "
                f"from {(previous[i] if i < len(previous) else '') or 'the previous active syncer'}"
                for i, (a, now) in enumerate(zip(was, epochs, strict=True)) if a and now > a]
        return "SyncerTakeover", "; ".join(told) + tail
    return ("SyncerTakeover", f"syncer {after.get('active')} took over the lease (epoch {after.get('leaseEpoch')}) "
            f"from {before.get('active') or 'the previous active syncer'}" + tail)
