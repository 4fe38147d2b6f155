"""Pure: when a job bounded by `spec.training.steps` has finished them.

A learner reaches the shared schedule's slot `steps`, pushes what it holds, waits until the
syncer has accepted it, writes `contract.Finished` (a versioned JSON line: marker, learner id,
steps, slot) to its container's termination message file, and exits 0 (trainer/learner.py).
Locally the runner then leaves it down; inside a StatefulSet (restartPolicy Always) the kubelet
starts it again, and the new process joins past the last slot, steps once and finishes again.

The signal is that marker in the learner container's `state.terminated.message` (or
`lastState`'s, once restarted) beside exit code 0, not the exit code alone: the learner also
exits 0 on SIGTERM, which a liveness probe's kill, an eviction, a drain or a pod's deletion
sends, and it writes the marker only at its last slot. What this relies on: the operator renders
the learner container's terminationMessagePath (contract.TERMINATION_LOG) with policy `File`
(never the logs) and tells the learner the path (operator/render/learners.py); the kubelet gives each container
start a fresh, empty file there and copies its last 4096 bytes into the terminated state, so a
marker belongs to the start that wrote it (the learner also empties the file when it starts). A
marker must name the pod's own learner and at least the spec's steps (a raised
spec.training.steps is not reached by an older marker); a sidecar's message is not read. Once
every learner of this manifest has finished, the job ends `Succeeded/StepsReached` and
spec.runPolicy.cleanPodPolicy removes the learners, as for a token budget (render.children), so
none is restarted again.

Nothing is recorded: the evidence lives as long as the pod, and a finished learner whose pod
is replaced finishes again within one start-up. On the syncer's cluster the job also waits
until the syncer sees no learner of another cluster's regions connected (they may still be
flushing their last pushes), when it can ask.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from diloco.contract import Finished
from diloco.operator.render import naming as n
from diloco.spec import JobSpec

REASON = "StepsReached"  # the Succeeded condition's reason


def exited_done(pod: dict[str, Any], steps: int) -> bool:
    """Whether this learner pod's learner container exited 0 with the marker of its own learner
    having reached `steps` (spec.training.steps) in its termination message."""
    found = n.learner_of(pod)
    if found is None:
        return False
    me = str(found[1])
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") != n.LEARNER:
            continue  # a sidecar's exit or message says nothing about training
        for state in ("state", "lastState"):
            ended = (cs.get(state) or {}).get("terminated") or {}
            said = Finished.read(ended.get("message"))
            if ended.get("exitCode") == 0 and said is not None and said.learner == me and said.steps >= steps:
                return True
    return False


def finished(spec: JobSpec, pods: Iterable[dict[str, Any]]) -> tuple[str, ...]:
    """The learners (`group-index`, sorted) of a steps-bounded job whose pod shows they finished;
    () for a job without spec.training.steps (an exit 0 there is no ending)."""
    if spec.training.steps is None:
        return ()
    steps = spec.training.steps
    wanted = {str(x) for x in spec.learner_ids()}
    done = {str(found[1]) for pod in pods if (found := n.learner_of(pod)) is not None and exited_done(pod, steps)}
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
