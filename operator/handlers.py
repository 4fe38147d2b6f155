"""The kopf handlers: thin wrappers that hand each event to `reconcile`.

Create, resume and spec updates all run the same level-triggered pass; a timer repeats it
(status from the syncer, deadlines, stuck pods, drift); learner pod events count losses and
re-admissions; with Kueue, events of the Workloads a job owns, and its pods' deletions, run its
pass at once; a second timer drives chaos. Jobs whose `spec.managedBy` names another
controller (Kueue's MultiKueue dispatching copies to worker clusters) match no handler, so
kopf neither handles them nor puts its finalizer on them. Handlers are sync: kopf runs them
in threads and they block only on the API server and one short gRPC call. They return
nothing, so kopf writes no handler results into the status.
"""

from __future__ import annotations

from typing import Any

import kopf

from diloco.operator import peering
from diloco.operator.admission import immutable, webhook
from diloco.operator.context import Config, Context
from diloco.operator.crd import GROUP, PLURAL, VERSION
from diloco.operator.reconcile import passes
from diloco.operator.render import naming as n
from diloco.spec import MANAGED_BY

RESOURCE = (GROUP, VERSION, PLURAL)
OURS = {"app.kubernetes.io/managed-by": n.MANAGER}  # what the operator rendered: the jobs' pods, their Workloads
WORKLOADS = ("kueue.x-k8s.io", "workloads")  # Kueue's, whichever version it serves (kopf asks discovery)


def _ctx(memo: Any) -> Context:
    ctx: Context = memo["ctx"]
    return ctx


def _namespaced(namespace: str | None) -> str:
    if namespace is None:  # the CRD is namespaced; kopf passes None only for cluster-scoped kinds
        raise kopf.PermanentError("DecoupledDiLoCoJob objects are namespaced")
    return namespace


def login(memo: Any, **_: Any) -> kopf.ConnectionInfo:
    """kopf logs in with our client's own credentials, so both always talk to the same cluster
    (one process may run operators for several clusters: the multi-cluster tests do)."""
    return peering.connection_info(_ctx(memo).connect())  # with a User-Agent naming the replica


def startup(memo: Any, **_: Any) -> None:
    _ctx(memo).connect()


def configure(settings: kopf.OperatorSettings) -> None:
    """Our own annotation prefix, finalizer (the timers need one) and Event source; no kopf
    state in the job's status; no namespace or CRD scanning (the chart's RBAC grants neither)."""
    settings.scanning.disabled = True
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="diloco.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="diloco.dev", key="last-handled-configuration")
    settings.persistence.finalizer = "diloco.dev/finalizer"
    settings.posting.reporting_component = n.MANAGER
    settings.posting.event_name_prefix = "diloco-"
    settings.posting.loggers = False
    settings.watching.server_timeout = 300  # re-list now and then; cheap, and heals missed events
    # The API server sends only our jobs' pods: a cluster's other pods never reach the operator
    # (the handler's own `labels=` filter alone would stream every pod and drop most of them here).
    settings.watching.label_selectors["pods"] = ",".join(f"{k}={v}" for k, v in sorted(OURS.items()))
    # Likewise only the Workloads the operator wrote for its jobs (watched with kueue.enabled).
    settings.watching.label_selectors[WORKLOADS] = ",".join(f"{k}={v}" for k, v in sorted(OURS.items()))
    # A job deleted while its (sync, uncancellable) timer runs keeps kopf's finalizer until the
    # timer is seen to have exited; look again after 2 s, not kopf's default minute.
    settings.background.cancellation_polling = 2.0


def cleanup(memo: Any, **_: Any) -> None:
    _ctx(memo).syncers.close()


def apply_job(namespace: str | None, name: str, memo: Any, **_: Any) -> None:
    passes.reconcile(_ctx(memo), _namespaced(namespace), name)


def chaos(namespace: str | None, name: str, memo: Any, **_: Any) -> None:
    passes.chaos_tick(_ctx(memo), _namespaced(namespace), name)


def ours(spec: Any, status: Any = None, meta: Any = None, **_: Any) -> bool:
    """Whether this operator runs the job: spec.managedBy absent or naming it (as in JobSet), or
    a job it started itself whatever managedBy says now, so that the change is refused and shown
    (operator/admission/immutable.py) instead of leaving the job's children running with nobody watching them."""
    if spec.get("managedBy") in (None, MANAGED_BY):
        return True
    record = (status or {}).get(immutable.FIELD) or {}
    return bool(record) and record.get("uid") == (meta or {}).get("uid") and \
        (record.get("fields") or {}).get("managedBy") in (None, MANAGED_BY)


def chaos_enabled(spec: Any, **kwargs: Any) -> bool:
    return ours(spec, **kwargs) and bool((spec.get("chaos") or {}).get("enabled"))


def forget(namespace: str | None, name: str, memo: Any, **_: Any) -> None:
    """Children go with the job (owner references); its Kueue Workloads once the finalizer the
    operator put on them as their integration is off; its remote parts once each cluster deleted
    them (spec.clusters); then our in-memory state is dropped."""
    if not passes.release_workloads(_ctx(memo), _namespaced(namespace), name):
        raise kopf.TemporaryError("a Workload changed while its finalizer was taken off", delay=1)
    if not passes.release_remotes(_ctx(memo), _namespaced(namespace), name):
        raise kopf.TemporaryError("a remote cluster still holds the job's part", delay=5)
    _ctx(memo).forget(_namespaced(namespace), name)


def job_pod(event: kopf.RawEvent, body: kopf.Body, memo: Any, **_: Any) -> None:
    """A learner pod's event counts a loss or a re-admission (passes.pod_event); with Kueue, a
    job's pod gone runs the job's pass at once: an evicted job gives its quota back the moment its
    last pod is gone (Kueue's integrations react to their jobs' events, not to a timer)."""
    ctx, pod = _ctx(memo), dict(body)
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if labels.get(n.COMPONENT) == n.LEARNER:
        passes.pod_event(ctx, event.get("type"), pod)
    if ctx.config.kueue and event.get("type") == "DELETED" and labels.get(n.JOB):
        passes.reconcile(ctx, _namespaced(pod["metadata"].get("namespace")), labels[n.JOB])


def workload(event: kopf.RawEvent, body: kopf.Body, memo: Any, **_: Any) -> None:
    """A Workload of one of our jobs changed (Kueue admitted, evicted, preempted or deactivated
    it; a slice replaced another): the job's pass runs now, not on the next timer."""
    owner = passes.workload_owner(dict(body))
    if owner is not None:
        passes.reconcile(_ctx(memo), *owner)


def register(registry: kopf.OperatorRegistry, config: Config) -> None:
    """Attach the handlers to `registry` (a fresh one per operator run in tests)."""
    # A pass that raised (its API server away a moment, a write that lost a race) is tried again
    # at the next refresh, not after kopf's default minute: the job catches up once the server answers.
    retry = config.status_interval
    kopf.on.login(registry=registry)(login)
    kopf.on.startup(registry=registry)(startup)
    kopf.on.cleanup(registry=registry)(cleanup)
    for decorator in (kopf.on.create, kopf.on.resume):
        decorator(*RESOURCE, registry=registry, id="apply", when=ours, backoff=retry)(apply_job)
    kopf.on.update(*RESOURCE, registry=registry, id="apply", field="spec", when=ours, backoff=retry)(apply_job)
    kopf.on.delete(*RESOURCE, registry=registry, id="forget", optional=True, when=ours)(forget)
    kopf.timer(*RESOURCE, registry=registry, id="refresh", interval=config.status_interval,
               initial_delay=min(1.0, config.status_interval), when=ours, backoff=retry)(apply_job)
    kopf.timer(*RESOURCE, registry=registry, id="chaos", interval=config.chaos_interval,
               when=chaos_enabled, backoff=config.chaos_interval)(chaos)
    kopf.on.event("", "v1", "pods", registry=registry, id="job-pods", labels=OURS)(job_pod)
    if config.kueue:  # Kueue's decisions acted on as they are written (the chart grants watch on workloads)
        kopf.on.event(group=WORKLOADS[0], plural=WORKLOADS[1], registry=registry, id="kueue-workloads",
                      labels=OURS)(workload)
    if config.webhook is not None:  # `kubectl apply` refuses what reconcile would fail (operator/admission/webhook.py)
        webhook.register(registry, RESOURCE, when=ours)


def build_registry(config: Config) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    register(registry, config)
    return registry


def build_memo(ctx: Context) -> kopf.Memo:
    return kopf.Memo(ctx=ctx)

