"""Pure: every check a job passes before the operator runs it, in one list.

The operator (operator/reconcile/passes.py) and `diloco validate` both call `problems`, so a manifest that
validates is one the operator accepts: the spec's own rules (diloco/spec/__init__.py), then what
Kubernetes would refuse later or the learners could not fill (render.name_problems: names, TPU
slices and hostsPerLearner, pod overlays and templates, a checkpoint volume nobody can size), then what this
installation cannot do (the Gateway API, Kueue's limits). One check needs the cluster and is
the operator's alone: a running syncer's shard count (render.shard_change_problem).
"""

from __future__ import annotations

from diloco.operator.kueue import integration as kueue
from diloco.operator.render import exposure
from diloco.operator.render import job as render
from diloco.spec import DecoupledDiLoCoJob, home_view


def spec_problems(job: DecoupledDiLoCoJob) -> list[str]:
    """What no installation can run, each naming its field path."""
    return render.name_problems(job)


def install_problems(job: DecoupledDiLoCoJob, *, gateway_api: bool, queued: bool) -> list[str]:
    """What this installation cannot run: `gateway_api` (the chart's syncerExposure.gatewayAPI)
    and `queued` (Kueue enabled and the job labelled with a queue)."""
    return exposure.problems(job, gateway_api) + (kueue.problems(job) if queued else [])


def problems(job: DecoupledDiLoCoJob, *, gateway_api: bool, kueue_enabled: bool) -> list[str]:
    """Every admission check of `job` on an installation with these chart settings."""
    queued = kueue.queue(kueue_enabled, job.metadata.labels) is not None
    # A multi-cluster job runs its home view here (operator/reconcile/observe.py): its remote groups
    # are their clusters' to admit.
    here = job.model_copy(update={"spec": home_view(job.spec)}) if job.spec.clusters else job
    return spec_problems(job) + install_problems(here, gateway_api=gateway_api, queued=queued)
