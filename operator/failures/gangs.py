"""Pure whole-gang restarts: a multi-host learner runs as one program, or not at all.

A learner of H hosts is H processes of one SPMD JAX program. When one process goes, the
others cannot go on (their collectives wait for a peer that never answers) and a replacement
cannot join a program that is already running, so the learner restarts as a whole: the
operator deletes the hosts still up, the StatefulSet recreates them, and all H start a new
program together while the other learners keep training.

The processes that form a learner's program (its *run*) are recorded in `status.gangRuns`
once all H hosts' containers run, each as `<pod uid>/<container restarts>`. A host is
*intact* while its pod is that pod, alive, with that restart count; so a host is lost when its
pod is deleted, Terminating, Failed, replaced (operator down meanwhile) or its container
restarted in place. A loss while other hosts are intact restarts the gang: the intact ones are
deleted. That cannot loop: afterwards no host is intact, nothing more is deleted, and a new
run is recorded only when all H hosts run again; a gang being restarted is not restarted
again until it is back. When every host restarted on its own (JAX aborts every process once
one fails), nobody is deleted: the new processes simply form the next run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diloco.contract import LearnerId
from diloco.operator.failures import pods
from diloco.operator.render import naming as n
from diloco.operator.status import job as st

RUNS = "gangRuns"  # status key: [{learner, hosts: ["<uid>/<restarts>", ...]}]


@dataclass(frozen=True)
class Restart:
    host: int  # the first lost host (its process id)
    hosts: int
    loss: pods.Loss
    survivors: tuple[dict[str, Any], ...]  # the intact hosts' pods: deleted, so all H start again

    @property
    def summary(self) -> str:
        return f"host {self.host} of {self.hosts} lost ({self.loss.detail})"


@dataclass(frozen=True)
class Decision:
    run: tuple[str, ...] | None = None  # a new run to record
    restart: Restart | None = None


def restarts(pod: dict[str, Any]) -> int:
    return sum(int(cs.get("restartCount") or 0) for cs in (pod.get("status") or {}).get("containerStatuses") or [])


def identity(pod: dict[str, Any]) -> str:
    """A host's process: its pod and how often its container has restarted in that pod."""
    return f"{pod.get('metadata', {}).get('uid', '')}/{restarts(pod)}"


def alive(pod: dict[str, Any]) -> bool:
    return not pods.terminating(pod) and (pod.get("status") or {}).get("phase") not in ("Failed", "Succeeded")


def running(pod: dict[str, Any]) -> bool:
    """Alive, and every container started (not waiting in a crash-loop back-off)."""
    s = pod.get("status") or {}
    statuses = s.get("containerStatuses") or []
    return alive(pod) and s.get("phase") == "Running" and bool(statuses) and \
        all("running" in (cs.get("state") or {}) for cs in statuses)


def by_host(members: list[dict[str, Any]], hosts: int) -> dict[int, dict[str, Any]]:
    """The gang's pods by host; a StatefulSet has at most one pod per ordinal (one name)."""
    out = {}
    for pod in members:
        host = n.host_of(pod)
        if host is not None and 0 <= host < hosts:
            out[host] = pod
    return out


def run_of(status: dict[str, Any], slot: str) -> tuple[str, ...] | None:
    entry = next((x for x in status.get(RUNS) or [] if x.get("learner") == slot), None)
    return tuple(entry["hosts"]) if entry and entry.get("hosts") else None


def _why(pod: dict[str, Any] | None, gone: bool, recorded: str, name: str) -> pods.Loss:
    """Why a host is no longer the run's, in the words of a lost learner; `gone`: `pod` is how
    it was last seen (its DELETED event), or None if it was never seen going."""
    if pod is None:
        return pods.Loss("Deleted", f"pod {name} deleted")
    loss = pods.loss("DELETED" if gone else None, pod)
    if loss is None and pod.get("metadata", {}).get("uid") != recorded.rsplit("/", 1)[0]:
        loss = pods.Loss("Deleted", f"pod {name} was replaced")
    if loss is None:
        exits = [(cs.get("lastState") or {}).get("terminated") or {}
                 for cs in (pod.get("status") or {}).get("containerStatuses") or []]
        code = next((f" (exit code {t.get('exitCode')}, {t.get('reason', 'Error')})" for t in exits if t), "")
        loss = pods.Loss("Failed", f"pod {name}: container restarted{code}")
    if (pod.get("metadata", {}).get("annotations") or {}).get(n.CHAOS):
        loss = pods.Loss(loss.reason, f"{loss.detail} by chaos")
    return loss


def decide(members: list[dict[str, Any]], hosts: int, *, run: tuple[str, ...] | None, gang: str,
           gone: dict[str, Any] | None = None) -> Decision:
    """What to do about gang `gang` (its StatefulSet's name), given its pods, its recorded run,
    and a pod of it just seen deleted (its DELETED event says why: preempted, evicted...)."""
    current = by_host(members, hosts)
    formed = len(current) == hosts and all(running(p) for p in current.values())
    fresh = tuple(identity(current[h]) for h in range(hosts)) if formed else None
    if run is None or len(run) != hosts:
        return Decision(run=fresh)
    intact = [h for h in range(hosts) if h in current and alive(current[h]) and identity(current[h]) == run[h]]
    if len(intact) == hosts:
        return Decision()
    if not intact:  # the old program is gone entirely: the next one forms once all hosts run
        return Decision(run=fresh)
    lost = next(h for h in range(hosts) if h not in intact)
    # The run's own pod seen deleted says why better than its replacement, if already there.
    seen = gone if gone is not None and n.host_of(gone) == lost and \
        gone.get("metadata", {}).get("uid") == run[lost].rsplit("/", 1)[0] else None
    loss = _why(seen or current.get(lost), seen is not None, run[lost], f"{gang}-{lost}")
    return Decision(restart=Restart(lost, hosts, loss, tuple(current[h] for h in intact)))


def back(members: list[dict[str, Any]], hosts: int, run: tuple[str, ...] | None) -> bool:
    """Whether the learner is training again: a recorded run, every host of it intact and ready."""
    current = by_host(members, hosts)
    return run is not None and len(run) == hosts and len(current) == hosts and \
        all(pods.ready(current[h]) and identity(current[h]) == run[h] for h in range(hosts))


def set_run(status: dict[str, Any], slot: str, run: tuple[str, ...]) -> dict[str, Any]:
    """The status patch recording learner `slot`'s run (lists: a merge patch replaces them whole)."""
    others = [x for x in status.get(RUNS) or [] if x.get("learner") != slot]
    return {RUNS: [*others, {"learner": slot, "hosts": list(run)}]}


def message(learner: LearnerId, restart: Restart) -> str:
    return f"learner {learner} restarting as a whole: {restart.summary}"


def record_restart(status: dict[str, Any], learner: LearnerId, *, restart: Restart, lost_uid: str,
                   now: float) -> dict[str, Any]:
    """The status patch for a gang restart: the learner lost (counted once, as any loss), its
    lostLearners entry saying why it restarts as a whole, and the group's restart counter."""
    slot = str(learner)
    patch = pods.record_loss(status, learner, lost=restart.loss, pod_uid=lost_uid, now=now) or {}
    merged = {**status, **patch}
    losses = [{**x, "restart": restart.summary} if x.get("slot") == slot else x for x in pods.open_losses(merged)]
    groups = [dict(g) for g in merged.get("learnerGroups") or []]
    entry = next((g for g in groups if g.get("name") == learner.group), None)
    if entry is None:
        entry = st.group_entry(merged, learner.group)
        groups.append(entry)
    entry["restarts"] = entry.get("restarts", 0) + 1
    return {"learnerGroups": groups, "lostLearners": losses}
