"""Pure failure policy: which pod states a restart cannot fix, their count against
`spec.runPolicy.backoffLimit`, and when an image that cannot be pulled ends the job.

A learner that crashes, is OOM-killed, killed by a signal, preempted or loses its node is what
the method absorbs: its pod comes back and re-joins, and nothing here counts it. A pod waiting
for capacity (Unschedulable) is not failing either (operator/failures/capacity.py). A pod that cannot pull its
image, or whose container exits with `Exit.CONFIG` or `Exit.REFUSED`, fails the same way on every
retry. Each such failure is counted once (keyed by pod uid, container and container instance) in
`status.failures`, so the count survives pod replacements, duplicate passes and operator
restarts; more than backoffLimit of them end the job Failed/BackoffLimitExceeded (status.ending).

An image pull that fails is counted once per pod (the kubelet retries it in the same container
instance, so no new instance ever counts again): two learners on a bad image are 2 failures,
never more than a backoffLimit of 6. So a second rule ends such a job: when every pod of a
learner group, or of the syncer, has been stuck pulling its image for IMAGE_PULL_GRACE, the
group cannot run at all and the job ends Failed/ImagePullFailed (`image_stuck`). One pod stuck
beside running ones (one node's registry mirror, a rollout to a bad tag, which replaces one
pod at a time) leaves the job running with PodsFailing. The syncer's pods are classified the
same way: its config errors count too (and show why it crash-loops), beside the existing limit
on its restarts.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from diloco.contract import Exit
from diloco.operator.render import naming as n
from diloco.operator.status import conditions as c

IMAGE_WAITING = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName"})
# Seconds every pod of a group may stay stuck pulling its image before the job ends: the kubelet's
# pull back-off reaches its 5-minute cap by then, and a registry outage or a credential being
# rotated has had time to clear.
IMAGE_PULL_GRACE = 300.0
# Counted keys remembered (of pods still present; ~80 bytes each): a failure whose key was
# dropped would count again, but that many failures at once are far past any backoffLimit.
KEEP_KEYS = 1000
SHOWN = 10  # pods listed in status.failures.current; `failingPods` counts them all

IMAGE, CONFIG, REFUSED = "ImagePullFailed", "ConfigError", "TokenRefused"
FIXES = {
    IMAGE: ("check the image name and tag (spec.learnerGroups[].image, spec.syncer.image), that the registry "
            "is reachable, and the namespace's imagePullSecrets"),
    CONFIG: "the manifest or a flag is wrong and its log says which (kubectl logs --previous); fix the job's spec",
    REFUSED: ("the syncer refused it for good (a wrong job token or admission): check the token Secret "
              "(spec.syncer.external.tokenSecret in a learners-only cluster)"),
}
EXITS = {int(Exit.CONFIG): CONFIG, int(Exit.REFUSED): REFUSED}
FIELD = "failures"  # status.failures


@dataclass(frozen=True)
class Failure:
    """One permanent failure of one pod: `key` names it, so it is counted once."""

    key: str  # "<pod uid>/<container>/<instance>"
    pod: str
    who: str  # "learner us-1", "syncer"
    reason: str  # IMAGE, CONFIG or REFUSED
    detail: str

    @property
    def fix(self) -> str:
        return FIXES[self.reason]

    def entry(self) -> dict[str, str]:
        return {"pod": self.pod, "who": self.who, "reason": self.reason, "message": self.detail}


def _time(value: str | None) -> float | None:
    if not value:
        return None
    parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)).timestamp()


def who(pod: dict[str, Any]) -> str:
    """How a pod is named in messages: `learner us-1`, `syncer`."""
    found = n.learner_of(pod)
    if found is not None:
        return f"learner {found[1]}"
    return str((pod.get("metadata", {}).get("labels") or {}).get(n.COMPONENT) or "pod")


def _container(uid: str, cs: dict[str, Any]) -> tuple[str, str, str] | None:
    """(key, reason, detail) of a container status that a restart cannot fix, else None."""
    name, restarts = cs.get("name", "?"), int(cs.get("restartCount") or 0)
    waiting = (cs.get("state") or {}).get("waiting") or {}
    if waiting.get("reason") in IMAGE_WAITING:
        why = f"{waiting['reason']}: {waiting['message']}" if waiting.get("message") else waiting["reason"]
        return f"{uid}/{name}/image", IMAGE, f"container {name} cannot pull image {cs.get('image', '?')} ({why})"
    for state in ("state", "lastState"):
        ended = (cs.get(state) or {}).get("terminated") or {}
        reason = EXITS.get(ended.get("exitCode", -1))
        if reason is not None:
            # The instance: its container id where the runtime reports one (the same dead
            # container is `state` first and `lastState` after its restart), else when it ended.
            instance = ended.get("containerID") or ended.get("finishedAt") or f"r{restarts}"
            return (f"{uid}/{name}/{instance}", reason,
                    f"container {name} exited with code {ended['exitCode']} ({'bad config' if reason == CONFIG else 'refused'})")
    return None


def classify(pod: dict[str, Any]) -> Failure | None:
    """The pod's permanent failure now, or None (running, starting, waiting for capacity, or
    failing transiently)."""
    meta, s = pod.get("metadata", {}), pod.get("status") or {}
    uid, name = meta.get("uid", ""), meta.get("name", "?")
    if meta.get("deletionTimestamp"):
        return None  # going anyway: a deletion is a loss (pods.loss), never a config error
    for cs in [*(s.get("initContainerStatuses") or []), *(s.get("containerStatuses") or [])]:
        found = _container(uid, cs)
        if found is not None:
            return Failure(found[0], name, who(pod), found[1], found[2])
    return None


def _group(pod: dict[str, Any]) -> str:
    """The pods that run the same image: a learner group's, or the syncer's."""
    found = n.learner_of(pod)
    if found is not None:
        return f"learner group {found[1].group}"
    return str((pod.get("metadata", {}).get("labels") or {}).get(n.COMPONENT) or "pod")


def _stuck_since(pod: dict[str, Any]) -> float | None:
    """Since when a pod has not run: its Ready condition's last flip to False (a container that
    ran, then lost its image), else when the kubelet took it, else when it was created."""
    meta, s = pod.get("metadata", {}), pod.get("status") or {}
    ready = next((x for x in s.get("conditions") or [] if x.get("type") == "Ready"), None)
    if ready and ready.get("status") == "False" and ready.get("lastTransitionTime"):
        return _time(ready["lastTransitionTime"])
    return _time(s.get("startTime")) or _time(meta.get("creationTimestamp"))


def image_stuck(pods: list[dict[str, Any]], now: float, grace: float = IMAGE_PULL_GRACE) -> str | None:
    """The Failed ending's message once every pod of a learner group (or the syncer) has been
    stuck pulling its image for `grace` seconds, else None."""
    groups: dict[str, list[tuple[dict[str, Any], Failure | None]]] = {}
    for pod in pods:
        if not pod.get("metadata", {}).get("deletionTimestamp"):
            groups.setdefault(_group(pod), []).append((pod, classify(pod)))
    for group, members in sorted(groups.items()):
        waits = [now - since for pod, f in members
                 if f is not None and f.reason == IMAGE and (since := _stuck_since(pod)) is not None]
        if len(waits) == len(members) and min(waits) >= grace:
            first = next(f for _, f in members if f is not None)
            return (f"every pod of the {group} ({len(members)}) has been unable to pull its image for at least "
                    f"{min(waits):.0f} s; pod {first.pod}: {first.detail}; fix: {first.fix}, then re-create the job")
    return None


def counting(pods: list[dict[str, Any]], wanted: Callable[[str], bool]) -> list[dict[str, Any]]:
    """The pods whose failures count against the job: the syncer's, and learners of slots
    (`group-index`) the spec wants. A pod for a slot it does not (a StatefulSet scaled up by
    hand, before the operator puts it back) exits with CONFIG, "no such learner": not the job's
    fault."""
    return [p for p in pods if (found := n.learner_of(p)) is None or wanted(str(found[1]))]


def fold(status: dict[str, Any], pods: list[dict[str, Any]], now: float) -> tuple[dict[str, Any], list[Failure]]:
    """The status patch (`{"failures": ...}`, empty when nothing changed) and the failures
    first seen in this pass. Keys of pods no longer present are dropped: they cannot recur."""
    prior: dict[str, Any] = status.get(FIELD) or {}
    found = [f for f in map(classify, pods) if f is not None]
    if not found and not prior:
        return {}, []
    counted = list(prior.get("counted") or [])
    seen = set(counted)
    fresh = [f for f in found if f.key not in seen]
    present = {p.get("metadata", {}).get("uid", "") for p in pods}
    counted = [k for k in counted if k.split("/", 1)[0] in present] + [f.key for f in fresh]
    state: dict[str, Any] = {"permanent": int(prior.get("permanent") or 0) + len(fresh), "failingPods": len(found),
                             "current": [f.entry() for f in found[:SHOWN]], "counted": counted[-KEEP_KEYS:]}
    if fresh:
        at = dt.datetime.fromtimestamp(now, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        state["last"] = {**fresh[-1].entry(), "at": at}
    elif prior.get("last"):
        state["last"] = prior["last"]
    return ({FIELD: state} if state != prior else {}), fresh


def event_message(f: Failure, count: int, limit: int) -> str:
    """The Warning Event of a new failure: the pod, what is wrong, the fix, how close the end is."""
    return (f"pod {f.pod} ({f.who}): {f.detail}; fix: {f.fix}. Permanent failure {count}; the job fails "
            f"after more than spec.runPolicy.backoffLimit={limit}")


def events(status: dict[str, Any], fresh: list[Failure], limit: int) -> list[tuple[str, str]]:
    """(reason, message) of the Warning Event for each failure new in this pass."""
    before = int((status.get(FIELD) or {}).get("permanent") or 0)
    return [(f.reason, event_message(f, before + i + 1, limit)) for i, f in enumerate(fresh)]


def exceeded(status: dict[str, Any], limit: int) -> str | None:
    """The Failed ending's message once permanent failures exceed backoffLimit, else None."""
    state = status.get(FIELD) or {}
    count = int(state.get("permanent") or 0)
    if count <= limit:
        return None
    last = state.get("last") or {}
    return (f"{count} permanent failures, over spec.runPolicy.backoffLimit={limit}; the last: pod "
            f"{last.get('pod', '?')} ({last.get('who', '?')}): {last.get('reason', '?')}: {last.get('message', '')}")


def condition(conds: list[c.Condition], status: dict[str, Any], *, limit: int, now: str,
              generation: int) -> list[c.Condition]:
    """PodsFailing: True while a pod shows a permanent failure; absent on jobs that never had one."""
    state = status.get(FIELD)
    if not state:
        return conds
    current, count = state.get("current") or [], int(state.get("permanent") or 0)
    if not current:
        return c.set_condition(conds, c.PODS_FAILING, False, reason="NoPermanentFailures",
                               message=f"{count} permanent failures so far (spec.runPolicy.backoffLimit={limit})",
                               now=now, generation=generation)
    first = current[0]
    fix = FIXES.get(first.get("reason", ""), "")
    more = int(state.get("failingPods") or len(current)) - 1
    others = f" (and {more} more pods)" if more > 0 else ""
    message = (f"pod {first['pod']} ({first['who']}): {first['message']}{others}; fix: {fix}. "
               f"{count} permanent failures of spec.runPolicy.backoffLimit={limit}")
    return c.set_condition(conds, c.PODS_FAILING, True, reason=first.get("reason", "PermanentFailure"),
                           message=message, now=now, generation=generation)
