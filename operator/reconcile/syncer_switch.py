"""A sharded syncer that changes how it runs starts its new pods once the old ones are gone. Pure.

Adding `spec.syncer.standby` to a running sharded syncer swaps its StatefulSet (one pod a shard)
for a Deployment of two pods a shard (docs/CHECKPOINTS.md, "Per shard"); removing it swaps them
back. Both kinds read and write the same store prefix, `<url>/shard-<i>`. Started together, a new
lease holder would restore before the old pod's final checkpoint lands (written as it stops),
and the two would serve and checkpoint one shard at once: the old pod holds no lease, so nothing
fences it. So the old workload goes first, and the new one is rendered once none of the old
kind's pods is left; the learners retry meanwhile, as through a takeover, and hand back what the
restored checkpoint missed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diloco.operator.render import job as render
from diloco.operator.render import naming as n
from diloco.spec import DecoupledDiLoCoJob


def _new_kind(job: DecoupledDiLoCoJob, kind: str, name: str) -> bool:
    """Whether (kind, name) is one of the syncer workloads this job runs as now."""
    if render.sharded_standby(job):
        return kind == "Deployment" and n.shard_of_syncer(job.metadata.name, name) is not None
    return (kind, name) == ("StatefulSet", n.syncer(job.metadata.name))


def waiting_for(job: DecoupledDiLoCoJob, live: Mapping[tuple[str, str], Any],
                pods: list[dict[str, Any]]) -> list[str]:
    """The old kind's syncer workloads and pods still there (empty: none, or no switch)."""
    if job.spec.syncer.shards == 1 or job.spec.syncer.external is not None:
        return []
    standby, name = render.sharded_standby(job), job.metadata.name
    old = ("StatefulSet", n.syncer(name)) if standby else None
    out = [f"{kind} {child}" for kind, child in live
           if (kind, child) == old or (not standby and kind == "Deployment" and n.shard_of_syncer(name, child) is not None)]
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if labels.get(n.COMPONENT) == n.SYNCER and (n.SHARD in labels) != standby:
            out.append(f"pod {pod['metadata']['name']}")
    return out


def held_back(rendered: list[dict[str, Any]], job: DecoupledDiLoCoJob, live: Mapping[tuple[str, str], Any],
              pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rendered` without the new syncer workloads while the old kind's are still there."""
    if not waiting_for(job, live, pods):
        return rendered
    return [c for c in rendered if not _new_kind(job, c["kind"], c["metadata"]["name"])]
