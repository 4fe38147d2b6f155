"""A multi-cluster job's remote parts as one pass of the reconcile decides them, pure: the sub-plan
operator/reconcile/plan.py takes after the job's status (operator/remote/health.py decides; this
reads what the pass observed: the job as applied, its token and CA, the syncer's exposed addresses).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from diloco.operator.reconcile.actions import Event
from diloco.operator.reconcile.observation import Observation
from diloco.operator.reconcile.observe import Observed
from diloco.operator.remote import health as remote
from diloco.operator.remote import parts as remote_parts
from diloco.operator.render import access
from diloco.operator.render import naming as n


@dataclass(frozen=True)
class Regions:
    """A multi-cluster job's remote parts this pass: the status they show, the writes, the Events."""

    patch: dict[str, Any] = field(default_factory=dict)
    writes: tuple[remote.Write, ...] = ()
    events: tuple[Event, ...] = ()


def remote_regions(o: Observed, status: dict[str, Any], obs: Observation, *, stamp: str,
                   generation: int) -> Regions:
    """Each remote cluster's part written where it differs from the home job (created, edited,
    put back), and its health shown: status.clusters, its groups among status.learnerGroups,
    condition ClustersReachable (operator/remote/health.py). Nothing for a one-cluster job."""
    whole = o.whole
    if whole is None and not o.gone:
        return Regions()
    whole = whole or o.job
    assert whole is not None
    tls = whole.spec.syncer.expose.tls if whole.spec.syncer.expose is not None else None
    ca = access.value(o.secrets.get(tls.secret_name), n.CA_KEY) if tls and tls.enabled and tls.secret_name else None
    home = remote_parts.Home(whole, o.owner.uid, o.token, ca, [a for a in obs.exposed_address.split(",") if a])
    decided, conds = remote.decide(home, o.remotes, o.gone, o.status, status["conditions"], stamp=stamp,
                                   generation=generation)
    mine = [g for g in status.get("learnerGroups") or [] if not g.get("cluster")]
    patch = {"conditions": conds, "clusters": list(decided.clusters), "learnerGroups": [*mine, *decided.groups]}
    return Regions(patch, decided.writes, decided.events)
