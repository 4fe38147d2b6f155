"""Pure: when a job bounded by `spec.training.steps` has finished them.

A learner reaches the shared schedule's slot `steps`, pushes what it holds, waits until the
syncer has accepted it, and exits 0 (`Exit.OK`, trainer/learner.py). Locally the runner then
leaves it down; inside a StatefulSet (restartPolicy Always) the kubelet starts it again, and
the new process joins past the last slot, steps once and exits 0 again. So the container's
exit code is the signal: a learner container that terminated with code 0 (its `state`, or its
`lastState` once restarted) has finished. Learner pods have no liveness probe, so no kubelet
SIGTERM ends one early; the SIGTERM exit of a pod being deleted (Terminating), evicted or shut
down with its node (phase Failed) is ignored. Once every learner of this manifest has
finished, the job ends `Succeeded/StepsReached` and spec.runPolicy.cleanPodPolicy removes the
learners, as for a token budget (render.children), so none is restarted again.

Nothing is recorded: the evidence lives as long as the pod, and a finished learner whose pod
is replaced finishes again within one start-up. On the syncer's cluster the job also waits
until the syncer sees no learner of another cluster's regions connected (they may still be
flushing their last pushes), when it can ask.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from diloco.operator import naming as n
from diloco.spec import JobSpec

REASON = "StepsReached"  # the Succeeded condition's reason


def exited_done(pod: dict[str, Any]) -> bool:
    """Whether this learner pod's container has exited 0: its learner reached spec.training.steps."""
    meta, s = pod.get("metadata", {}), pod.get("status") or {}
    if meta.get("deletionTimestamp") or s.get("phase") == "Failed":
        return False  # a SIGTERM exit of a pod being deleted, evicted or shut down with its node
    for cs in s.get("containerStatuses") or []:
        if cs.get("name") != n.LEARNER:
            continue  # a sidecar's exit says nothing about training
        for state in ("state", "lastState"):
            ended = (cs.get(state) or {}).get("terminated") or {}
            if ended.get("exitCode") == 0:
                return True
    return False


def finished(spec: JobSpec, pods: Iterable[dict[str, Any]]) -> tuple[str, ...]:
    """The learners (`group-index`, sorted) of a steps-bounded job whose pod shows they finished;
    () for a job without spec.training.steps (an exit 0 there is no ending)."""
    if spec.training.steps is None:
        return ()
    wanted = {str(x) for x in spec.learner_ids()}
    done = {str(found[1]) for pod in pods if (found := n.learner_of(pod)) is not None and exited_done(pod)}
    return tuple(sorted(done & wanted))


def message(spec: JobSpec, done: Iterable[str], others_active: int = 0) -> str | None:
    """The Succeeded ending's message once every learner of this manifest has finished (and no
    learner of another cluster is still connected to this cluster's syncer), else None."""
    steps, total = spec.training.steps, spec.total_learners
    count = len(set(done))
    if steps is None or total == 0 or count < total or others_active > 0:
        return None
    return f"all {total} learners reached spec.training.steps={steps} and exited 0"


def pending(spec: JobSpec, done: Iterable[str]) -> str:
    """The Degraded message's note on finished learners (their pods are not ready while the
    kubelet restarts them), "" when none has."""
    names = sorted(set(done))
    if not names:
        return ""
    return f"; finished spec.training.steps={spec.training.steps}: {', '.join(names)}"
