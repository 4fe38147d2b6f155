"""The reconcile's first step: read everything one pass over a job needs, and nothing else.

The job, its children, its pods, the Secrets it names, what Kueue's part needs (queueing.read),
and the syncer's answer (the controllers' signals about refused pods are read for the children
as written: operator/reconcile/apply.py); the
pure plan (operator/reconcile/plan.py) decides from these alone. The pure helpers called here (the spec
check, the syncer's readiness) only choose what to read: an invalid job's children are not
listed, a syncer that is not ready is not dialled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from secrets import token_urlsafe
from typing import Any

from diloco.operator.admission import checks as spec_checks
from diloco.operator.context import Config, Context
from diloco.operator.kueue import integration as kueue
from diloco.operator.kueue import queueing
from diloco.operator.reconcile import children
from diloco.operator.reconcile.loading import effective
from diloco.operator.remote import health as remote
from diloco.operator.remote import sync as remote_sync
from diloco.operator.render import access
from diloco.operator.render import job as render
from diloco.operator.render import naming as n
from diloco.operator.status import job as st
from diloco.operator.syncer_client import Target
from diloco.spec import DecoupledDiLoCoJob, home_view

Probe = tuple[st.SyncerView | None, str]  # the syncer's Status answer, or the gRPC code's name of its failure


@dataclass(frozen=True)
class Observed:
    """What one pass over a job read."""

    body: dict[str, Any]  # the job as the API server has it
    config: Config
    now: float  # when it was read (the pass's clock; the plan takes it as an argument too)
    job: DecoupledDiLoCoJob | None  # None: its spec cannot run here (`problems` say why)
    problems: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # edits to immutable fields, refused (operator/admission/immutable.py)
    queue: str | None = None  # the LocalQueue it is queued in (operator/kueue/integration.py)
    live: dict[children.Key, Any] = field(default_factory=dict)  # its children
    secrets: access.Secrets = field(default_factory=dict)  # those it names, by name (None: missing)
    token: str = ""  # its token: read, or fresh for a job that has none yet
    syncer: Probe = (None, "")  # the syncer's answer: asked only once it can answer
    probed: bool = False  # an external syncer, asked before the learners are rendered
    pods: list[dict[str, Any]] = field(default_factory=list)
    kueue: queueing.Seen | None = None  # what a queued job's pass read of Kueue
    whole: DecoupledDiLoCoJob | None = None  # a multi-cluster job as applied; `job` is then its home view
    remotes: tuple[remote.Seen, ...] = ()  # the remote clusters it names, as read (operator/remote/)
    gone: tuple[remote.Seen, ...] = ()  # clusters its status records that its spec no longer names

    @property
    def owner(self) -> render.Owner:
        meta = self.body["metadata"]
        return render.Owner(meta["name"], meta["namespace"], meta["uid"])

    @property
    def status(self) -> dict[str, Any]:
        return self.body.get("status") or {}


def shard_problem(job: DecoupledDiLoCoJob, live: dict[children.Key, Any]) -> list[str]:
    """A change of the syncer's shard count under a running job, seen in its live children."""
    name = job.metadata.name
    standby_shards = [i for kind, child in live if kind == "Deployment" and (i := n.shard_of_syncer(name, child)) is not None]
    changed = render.shard_change_problem(job, live.get(("Deployment", n.syncer(name))),
                                          live.get(("StatefulSet", n.syncer(name))), standby_shards)
    return [changed] if changed else []


def link(job: DecoupledDiLoCoJob, owner: render.Owner, secrets: access.Secrets) -> access.Link:
    return access.link(job, owner.namespace, secrets)


def target(config: Config, job: DecoupledDiLoCoJob, owner: render.Owner, secrets: access.Secrets,
           token: str) -> Target:
    """The syncer as the operator dials it: like the learners, with the same token and CA."""
    found = link(job, owner, secrets)
    external = job.spec.syncer.external is not None
    # A sharded syncer is dialled shard by shard, by the pods' names or, with a standby, the
    # shards' Services (the config's override, for tests, maps the one Service of an unsharded syncer).
    sharded = job.spec.syncer.shards > 1
    address = found.address if external or sharded else \
        access.paired(job, config.syncer_address(owner.name, owner.namespace))
    ca = access.value(secrets.get(found.ca_secret), n.CA_KEY) if found.ca_secret else None
    return Target(address, token, ca, found.server_name)


def syncer_ready(job: DecoupledDiLoCoJob, live: dict[children.Key, Any]) -> bool:
    """Every pod of the job's own syncer is ready (one per shard), as its workload counts them;
    with a sharded standby, each shard's Deployment has its ready pod (the lease holder)."""
    if render.sharded_standby(job):
        return all(_ready(live.get(("Deployment", n.syncer_shard(job.metadata.name, i)))) >= 1
                   for i in range(job.spec.syncer.shards))
    kind = "Deployment" if job.spec.syncer.shards == 1 else "StatefulSet"  # one pod per shard
    return _ready(live.get((kind, n.syncer(job.metadata.name)))) >= job.spec.syncer.shards


def paired(job: DecoupledDiLoCoJob) -> bool:
    """Each shard's standby pair has its other member in another cluster (spec.syncer.standby.peers):
    whichever holds the lease serves, so the syncer is asked wherever it is, not only once ready here."""
    return job.spec.syncer.standby is not None and bool(job.spec.syncer.standby.peers)


def _ready(workload: dict[str, Any] | None) -> int:
    return int(((workload or {}).get("status") or {}).get("readyReplicas") or 0)


def _token(ctx: Context, job: DecoupledDiLoCoJob, owner: render.Owner, secrets: access.Secrets) -> str:
    """The job's token: the home job's copy in a learners-only cluster, or where the job names a
    Secret holding it (spec.syncer.tokenSecret: a standby's cluster); else kept from the job's own
    Secret once it exists, generated only the first time."""
    ext = job.spec.syncer.external
    given = ext.token_secret if ext is not None else job.spec.syncer.token_secret
    if given is not None:
        raw = access.value(secrets.get(given), n.TOKEN_KEY)
        return raw.decode("utf-8", "replace").strip() if raw else ""
    raw = access.value(ctx.api.get("Secret", owner.namespace, n.token_secret(owner.name)), n.TOKEN_KEY)
    return raw.decode() if raw else token_urlsafe(32)


def observe(ctx: Context, body: dict[str, Any], now: float) -> Observed:
    """Everything the pass over the job `body` needs, read."""
    meta, config = body["metadata"], ctx.config
    namespace, name = meta["namespace"], meta["name"]
    whole, problems, refused = effective(body)
    # A multi-cluster job runs its home view here; its remote groups run in their clusters.
    job = whole.model_copy(update={"spec": home_view(whole.spec)}) if whole and whole.spec.clusters else whole
    queue = kueue.queue(config.kueue, meta.get("labels"))
    seen = Observed(body, config, now, None, problems, refused, queue)
    if job is None:
        return seen
    # What keeps a valid spec from running here (operator/admission/checks.py): read before its children are.
    problems = spec_checks.install_problems(job, gateway_api=config.gateway_api, queued=queue is not None)
    if problems:
        return Observed(body, config, now, None, problems, refused, queue)
    assert whole is not None
    live = children.observe(ctx.api, namespace, name, config.managed_kinds)
    if job.spec.syncer.external is None and (problems := shard_problem(job, live)):
        return Observed(body, config, now, None, problems, refused, queue)
    owner = render.Owner(name, namespace, meta["uid"])
    secrets = {secret: ctx.api.get("Secret", namespace, secret) for secret, _, _ in access.referenced(job)}
    token = _token(ctx, job, owner, secrets)
    dial = target(config, job, owner, secrets, token)
    probed = access.secret_blocker(job, secrets) is None and job.spec.syncer.external is not None
    # An external syncer is asked before any learner exists: a token it refuses would only make
    # them crash-loop. The job's own, once it is ready.
    answer: Probe = ctx.syncers.status(namespace, name, dial) if probed or paired(job) or (
        job.spec.syncer.external is None and syncer_ready(job, live)) else (None, "")
    q = queueing.read(ctx.api, job, owner=owner, link=link(job, owner, secrets), queue_name=queue, live=live,
                      generation=int(meta.get("generation") or 0)) if queue is not None else None
    job_pods = ctx.api.list("Pod", namespace, n.selector(name))
    remotes, gone = read_remotes(ctx, whole, body.get("status") or {})
    return Observed(body, config, now, job, [], refused, queue, live, secrets, token, answer, probed, job_pods, q,
                    whole if whole is not job else None, remotes, gone)


def read_remotes(ctx: Context, whole: DecoupledDiLoCoJob, status: dict[str, Any]) -> tuple[tuple[remote.Seen, ...],
                                                                                          tuple[remote.Seen, ...]]:
    """Each remote cluster's part, read at once: those the spec names, and those only the status
    still records (a cluster taken out of spec.clusters, whose part must go)."""
    name, namespace = whole.metadata.name, whole.metadata.namespace or "default"
    wanted = [(c, c.namespace or namespace) for c in whole.spec.clusters]
    named = {c.name for c, _ in wanted}
    left = [(c, ns) for c, ns in remote_sync.recorded(status) if c.name not in named]
    if not wanted and not left:
        return (), ()
    seen = remote_sync.read(ctx.api, ctx.remotes, ctx.config.peers.operator_namespace, [*wanted, *left], name)
    return tuple(seen[:len(wanted)]), tuple(seen[len(wanted):])
