"""Refused child writes, pure and through children.sync: what they are, and how the job shows them."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest

from diloco.operator.context import Config
from diloco.operator.failures import pod_refusals, refusals
from diloco.operator.kube import ApiError, Kube
from diloco.operator.reconcile import children
from diloco.operator.status import conditions
from tests.helpers import wait_for
from tests.kube.running import OperatorThread

pytest_plugins = ["tests.kube.fixtures"]

QUOTA = ('statefulsets.apps "demo-us" is forbidden: exceeded quota: no-sts, requested: count/statefulsets.apps=1, '
         'used: count/statefulsets.apps=0, limited: count/statefulsets.apps=0')
WEBHOOK = ('admission webhook "validation.gatekeeper.sh" denied the request: [must-have-owner] you must provide '
           'labels: {"owner"}')
RBAC = ('statefulsets.apps "demo-us" is forbidden: User "system:serviceaccount:diloco-system:diloco" cannot patch '
        'resource "statefulsets" in API group "apps" in the namespace "jobs"')
INVALID = 'StatefulSet.apps "demo-us" is invalid: spec.template.spec.containers[0].image: Required value'


def error(status: int, detail: str) -> ApiError:
    return ApiError(status, f"PATCH apis/apps/v1/...: {detail}", {403: "Forbidden", 422: "Invalid"}.get(status, ""),
                    detail)


@pytest.mark.parametrize(("status", "detail", "reason"), [
    (403, QUOTA, refusals.QUOTA), (403, WEBHOOK, refusals.WEBHOOK), (403, RBAC, refusals.FORBIDDEN),
    (422, INVALID, refusals.INVALID), (400, "bad", refusals.BAD),
    (403, 'pods "x" is forbidden: status unknown for quota: q, resource: pods', refusals.QUOTA)])
def test_refusals_are_classified_by_status_and_message(status: int, detail: str, reason: str) -> None:
    exc = error(status, detail)
    assert refusals.refused(exc) and refusals.reason(exc) == reason
    r = refusals.of({"kind": "StatefulSet", "metadata": {"name": "demo-us"}}, "create", exc)
    assert r.describe().startswith(f"StatefulSet demo-us: create refused ({reason}") and f"): {detail}; fix: " in \
        r.describe() and r.fix in r.describe()
    if reason == refusals.QUOTA:  # the quota named, in the head and in the fix
        assert r.by in ("ResourceQuota no-sts", "ResourceQuota q") and r.by in r.head() and r.by in r.fix
        assert r.fix.endswith("the operator retries on every pass")


@pytest.mark.parametrize("status", [404, 409, 429, 500, 503])
def test_other_errors_are_not_refusals(status: int) -> None:
    assert not refusals.refused(ApiError(status, "x"))


def test_the_condition_names_the_first_refusal_and_clears_once_written() -> None:
    sts = refusals.Refusal("StatefulSet", "demo-us", "create", refusals.QUOTA, QUOTA)
    dep = refusals.Refusal("Deployment", "demo-syncer", "create", refusals.QUOTA, QUOTA)
    assert refusals.condition([], [], "t0", 1) == []  # absent on jobs that never had one
    conds = refusals.condition([], [sts, dep], "t0", 1)
    refused = conditions.find(conds, conditions.CHILDREN_REFUSED)
    assert refused is not None and (refused["status"], refused["reason"]) == ("True", "QuotaExceeded")
    assert refused["message"].startswith(f"StatefulSet demo-us: create refused (QuotaExceeded): {QUOTA}; fix: raise")
    assert refused["message"].endswith("(and 1 more: Deployment demo-syncer: create refused (QuotaExceeded))")
    cleared = conditions.find(refusals.condition(conds, [], "t1", 2), conditions.CHILDREN_REFUSED)
    assert cleared is not None and (cleared["status"], cleared["reason"]) == ("False", "ChildrenWritten")
    assert cleared["message"] == "every child was written and no pod is refused"


def test_events_go_out_when_the_refusals_change_not_on_every_pass() -> None:
    sts = refusals.Refusal("StatefulSet", "demo-us", "create", refusals.QUOTA, QUOTA)
    first = refusals.condition([], [sts], "t0", 1)
    assert refusals.news([], first, [sts]) == [sts]
    again = refusals.condition(first, [sts], "t1", 1)
    assert refusals.news(first, again, [sts]) == []
    other = refusals.Refusal("StatefulSet", "demo-us", "create", refusals.WEBHOOK, WEBHOOK)
    assert refusals.news(again, refusals.condition(again, [other], "t2", 1), [other]) == [other]
    cleared = refusals.condition(again, [], "t3", 1)
    assert refusals.news(again, cleared, []) == []
    back = refusals.condition(cleared, [sts], "t4", 1)
    assert refusals.news(cleared, back, [sts]) == [sts]


class Refusing:
    """An API where StatefulSets are refused (a quota) and everything else is written."""

    def __init__(self, refuse: ApiError) -> None:
        self.refuse, self.applied = refuse, []

    def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        return []

    def get(self, kind: str, namespace: str, name: str) -> None:
        return None

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        if obj["kind"] == "StatefulSet":
            raise self.refuse
        self.applied.append(children.key(obj))
        return obj


def child(kind: str, name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": kind, "metadata": {"name": name, "namespace": "jobs"}}


def test_sync_writes_the_other_children_and_returns_the_refusal() -> None:
    kube = Refusing(error(403, QUOTA))
    desired = [child("ConfigMap", "demo-config"), child("StatefulSet", "demo-us"), child("Deployment", "demo-syncer")]
    live, done = children.sync(kube, "jobs", "demo", owner_uid="uid", desired=desired)  # type: ignore[arg-type]
    assert kube.applied == [("ConfigMap", "demo-config"), ("Deployment", "demo-syncer")]
    assert set(live) == {("ConfigMap", "demo-config"), ("Deployment", "demo-syncer")}
    assert [children.key(o) for o in done.apply] == kube.applied and done.summary() == [
        "applied ConfigMap/demo-config", "applied Deployment/demo-syncer"]
    [r] = done.refused
    assert (r.kind, r.name, r.verb, r.reason, r.message) == ("StatefulSet", "demo-us", "create", "QuotaExceeded", QUOTA)


def test_sync_lets_an_unreachable_server_through_for_kopf_to_retry() -> None:
    with pytest.raises(ApiError):
        children.sync(Refusing(ApiError(503, "unavailable")), "jobs", "demo",  # type: ignore[arg-type]
                      owner_uid="uid", desired=[child("StatefulSet", "demo-us")])


class Response:
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        self.status, self.data = status, json.dumps(body).encode()


def test_the_client_keeps_the_servers_reason_and_message(monkeypatch: pytest.MonkeyPatch) -> None:
    kube = Kube("https://127.0.0.1:1", verify=False)
    status = {"kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403, "message": QUOTA}
    monkeypatch.setattr(kube.pool, "request", lambda *a, **k: Response(403, status))
    with pytest.raises(ApiError) as raised:
        kube.apply({**child("ConfigMap", "demo-config")})
    assert (raised.value.status, raised.value.reason, raised.value.detail) == (403, "Forbidden", QUOTA)
    assert str(raised.value).startswith("HTTP 403: PATCH api/v1/namespaces/jobs/configmaps/demo-config: ")


# -- pods the controllers may not create, or the kubelet not start (pod_refusals.py) -----------------------------

POD_QUOTA = ('pods "demo-us-1" is forbidden: exceeded quota: learner-pods, requested: pods=1, used: pods=2, '
             'limited: pods=2')
POD_SECURITY = ('pods "demo-us-0" is forbidden: violates PodSecurity "restricted:latest": allowPrivilegeEscalation '
                '!= false (container "learner" must set securityContext.allowPrivilegeEscalation=false)')
KYVERNO = ('admission webhook "validate.kyverno.svc-fail" denied the request: \n\nresource Pod/jobs/demo-us-0 was '
           'blocked due to the following policies\n\nrequire-requests-limits:\n  validate-resources: \'validation '
           'error: CPU and memory resource requests and limits are required\'\n')


@pytest.mark.parametrize(("message", "reason", "by", "in_fix"), [
    (POD_QUOTA, refusals.QUOTA, "ResourceQuota learner-pods", "raise the namespace's ResourceQuota learner-pods"),
    ('pods "demo-us-0" is forbidden: exceeded quota: gpus, requested: requests.nvidia.com/gpu=8, used: '
     'requests.nvidia.com/gpu=8, limited: requests.nvidia.com/gpu=8', refusals.QUOTA, "ResourceQuota gpus",
     "kubectl describe resourcequota gpus"),
    ('pods "demo-us-0" is forbidden: failed quota: compute: must specify limits.cpu,limits.memory', refusals.QUOTA,
     "ResourceQuota compute", "set it in spec.learnerGroups[].resources"),
    (POD_SECURITY, refusals.FORBIDDEN, 'PodSecurity "restricted:latest"', "pod-security.kubernetes.io/enforce"),
    (WEBHOOK, refusals.WEBHOOK, 'admission webhook "validation.gatekeeper.sh", Gatekeeper constraint must-have-owner',
     "ask the policy's owner"),
    (KYVERNO, refusals.WEBHOOK, 'admission webhook "validate.kyverno.svc-fail", Kyverno policy require-requests-limits',
     "ask the policy's owner"),
    ('Internal error occurred: failed calling webhook "validate.kyverno.svc-fail": Post "https://kyverno-svc.kyverno'
     '.svc:443/validate": dial tcp 10.96.0.5:443: connect: connection refused', refusals.WEBHOOK,
     'admission webhook "validate.kyverno.svc-fail"', "fails closed"),
    ('pods "demo-us-0" is forbidden: unable to validate against any pod security policy: [spec.containers[0]'
     '.securityContext.privileged: Invalid value: true]', refusals.FORBIDDEN, "PodSecurityPolicy", "PodSecurityPolicy"),
    ('pods "demo-us-0" is forbidden: maximum cpu usage per Container is 2, but limit is 4', refusals.FORBIDDEN,
     "LimitRange", "kubectl describe limitrange"),
    ('Pod "demo-us-0" is invalid: spec.containers[0].image: Required value', refusals.INVALID, "",
     "found the pod invalid"),
    ('pods "demo-us-0" is forbidden: something else', refusals.FORBIDDEN, "", "an admission plugin or policy"),
])
def test_a_refused_pods_message_names_what_refused_it_and_the_fix(message: str, reason: str, by: str,
                                                                  in_fix: str) -> None:
    got_reason, got_by, fix = refusals.classify(message, verb="create")
    assert (got_reason, got_by) == (reason, by) and in_fix in fix


@pytest.mark.parametrize(("message", "by", "in_fix"), [
    ('secret "hf-token" not found', 'Secret "hf-token"', "create Secret hf-token in the job's namespace"),
    ('configmap "extra-env" not found', 'ConfigMap "extra-env"', "create ConfigMap extra-env"),
    ("couldn't find key token in Secret jobs/hf-token", 'Secret "hf-token"', "add key token to Secret hf-token"),
    ("container has runAsNonRoot and image will run as root (pod: \"demo-us-0_jobs(1)\", container: learner)",
     "securityContext.runAsNonRoot", "securityContext.runAsUser"),
    ("something new", "", "the message says what is missing"),
])
def test_a_container_config_error_names_the_missing_object(message: str, by: str, in_fix: str) -> None:
    got_by, fix = refusals.config_error(message)
    assert got_by == by and in_fix in fix


def sts(name: str = "demo-us", replicas: int = 2, have: int = 1, uid: str = "sts-uid") -> dict[str, Any]:
    return {"kind": "StatefulSet", "metadata": {"name": name, "uid": uid}, "spec": {"replicas": replicas},
            "status": {"replicas": have}}


def event(uid: str, reason: str, message: str, at: str, kind: str = "StatefulSet") -> dict[str, Any]:
    return {"metadata": {"name": f"e-{at}"}, "involvedObject": {"kind": kind, "uid": uid}, "reason": reason,
            "message": message, "lastTimestamp": at, "type": "Warning" if reason == "FailedCreate" else "Normal"}


def pod(name: str, waiting: dict[str, str] | None = None, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, **({"deletionTimestamp": "2026-12-06T05:00:00Z"} if deleting else {})}
    state = {"waiting": waiting} if waiting else {"running": {}}
    return {"metadata": meta, "status": {"containerStatuses": [{"name": "learner", "state": state}]}}


def failed(pod_name: str, at: str, uid: str = "sts-uid", error: str = POD_QUOTA) -> dict[str, Any]:
    return event(uid, "FailedCreate", f"create Pod {pod_name} in StatefulSet demo-us failed error: {error}", at)


def created(pod_name: str, at: str, uid: str = "sts-uid") -> dict[str, Any]:
    return event(uid, "SuccessfulCreate", f"create Pod {pod_name} in StatefulSet demo-us successful", at)


T0, T1, T2 = "2026-12-06T05:00:00Z", "2026-12-06T05:00:10Z", "2026-12-06T05:01:00Z"


@pytest.mark.parametrize(("case", "workload", "events", "pods", "refused"), [
    ("refused, pod missing", sts(), [created("demo-us-0", T0), failed("demo-us-1", T1)], ["demo-us-0"], ["demo-us-1"]),
    ("its pod exists since", sts(), [failed("demo-us-1", T1)], ["demo-us-0", "demo-us-1"], []),
    ("created after the refusal", sts(), [failed("demo-us-1", T0), created("demo-us-1", T1)], ["demo-us-0"], []),
    ("another pod created later", sts(), [failed("demo-us-1", T0), created("demo-us-0", T1)], [], ["demo-us-1"]),
    ("every pod exists", sts(have=2), [failed("demo-us-1", T1)], ["demo-us-0"], []),
    ("an older StatefulSet's", sts(), [failed("demo-us-1", T1, uid="old-uid")], ["demo-us-0"], []),
    ("scaled down past it", sts(replicas=1, have=0), [failed("demo-us-1", T1)], [], []),
    ("its claim refused", sts(), [event("sts-uid", "FailedCreate", "create Claim ckpt-demo-us-1 for Pod demo-us-1 in "
                                        f"StatefulSet demo-us failed error: {POD_QUOTA}", T1)], [], ["demo-us-1"]),
    ("aggregated", sts(), [event("sts-uid", "FailedCreate", "(combined from similar events): create Pod demo-us-1 in "
                                 f"StatefulSet demo-us failed error: {POD_QUOTA}", T1)], ["demo-us-0"], ["demo-us-1"]),
    ("being deleted", {**sts(), "metadata": {"name": "demo-us", "uid": "sts-uid", "deletionTimestamp": T2}},
     [failed("demo-us-1", T1)], [], []),
])
def test_a_statefulsets_failed_create_counts_only_while_live(case: str, workload: dict[str, Any],
                                                             events: list[dict[str, Any]], pods: list[str],
                                                             refused: list[str]) -> None:
    seen = pod_refusals.Observed([workload], [pod(p) for p in pods], events=events)
    found = pod_refusals.found(seen)
    assert [r.name for r in found] == refused, case
    for r in found:
        assert (r.kind, r.verb, r.reason, r.owner, r.by) == ("Pod", "create", refusals.QUOTA, "StatefulSet demo-us",
                                                             "ResourceQuota learner-pods")
        assert r.describe().startswith("Pod demo-us-1 of StatefulSet demo-us: create refused (QuotaExceeded, "
                                       f"ResourceQuota learner-pods): {POD_QUOTA}; fix: raise the namespace's "
                                       "ResourceQuota learner-pods")


RS_QUOTA = ('pods "demo-syncer-6b8c9d7f5-" is forbidden: exceeded quota: learner-pods, requested: pods=1, used: '
            'pods=2, limited: pods=2')


def deployment(have: int = 0, failure: str | None = None) -> dict[str, Any]:
    conds = [{"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": failure}] \
        if failure else []
    return {"kind": "Deployment", "metadata": {"name": "demo-syncer", "uid": "dep-uid"},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "syncer"}}},
            "status": {"updatedReplicas": have, "conditions": conds}}


def replica_set(uid: str, revision: int, have: int = 0, failure: str | None = None) -> dict[str, Any]:
    conds = [{"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": failure}] \
        if failure else []
    return {"metadata": {"name": f"demo-syncer-{uid}", "uid": uid, "ownerReferences": [{"uid": "dep-uid"}],
                         "annotations": {"deployment.kubernetes.io/revision": str(revision)}},
            "spec": {"replicas": 1}, "status": {"replicas": have, "conditions": conds}}


def rs_event(uid: str, reason: str, at: str) -> dict[str, Any]:
    message = f"Error creating: {RS_QUOTA}" if reason == "FailedCreate" else "Created pod: demo-syncer-6b8c9d7f5-x2"
    return event(uid, reason, message, at, kind="ReplicaSet")


@pytest.mark.parametrize(("case", "workload", "sets", "events", "refused"), [
    ("its ReplicaFailure condition", deployment(failure=RS_QUOTA), [], [], True),
    ("a stale condition, every pod there", deployment(have=1, failure=RS_QUOTA), [], [], False),
    ("the newest ReplicaSet's condition", deployment(), [replica_set("new", 2, failure=RS_QUOTA)], [], True),
    ("the newest ReplicaSet's event", deployment(), [replica_set("new", 2)], [rs_event("new", "FailedCreate", T1)],
     True),
    ("created after it", deployment(), [replica_set("new", 2)],
     [rs_event("new", "FailedCreate", T0), rs_event("new", "SuccessfulCreate", T1)], False),
    ("an older ReplicaSet's", deployment(), [replica_set("old", 1), replica_set("new", 2)],
     [rs_event("old", "FailedCreate", T1)], False),
    ("the newest has its pods", deployment(), [replica_set("new", 2, have=1)], [rs_event("new", "FailedCreate", T1)],
     False),
])
def test_a_deployments_refused_pod_is_read_from_its_condition_or_replica_set(
        case: str, workload: dict[str, Any], sets: list[dict[str, Any]], events: list[dict[str, Any]],
        refused: bool) -> None:
    found = pod_refusals.found(pod_refusals.Observed([workload], [], replica_sets=sets, events=events))
    assert len(found) == int(refused), case
    for r in found:
        assert r.describe().startswith("Pod of Deployment demo-syncer: create refused (QuotaExceeded, ResourceQuota "
                                       f"learner-pods): {RS_QUOTA}; fix: raise the namespace's ResourceQuota")


def test_containers_waiting_on_a_missing_secret_are_refused_starts() -> None:
    missing = {"reason": "CreateContainerConfigError", "message": 'secret "hf-token" not found'}
    pods = [pod("demo-us-1", missing), pod("demo-us-0"), pod("demo-us-2", missing, deleting=True),
            {"metadata": {"name": "demo-eu-0"}, "status": {"initContainerStatuses": [
                {"name": "fetch", "state": {"waiting": missing}}]}},
            pod("demo-syncer-x", {"reason": "ContainerCreating"})]
    found = pod_refusals.found(pod_refusals.Observed([], pods))
    assert [(r.name, r.verb, r.reason, r.by) for r in found] == [
        ("demo-eu-0", "start", "ContainerConfigError", 'Secret "hf-token"'),
        ("demo-us-1", "start", "ContainerConfigError", 'Secret "hf-token"')]
    assert found[1].describe() == ('Pod demo-us-1: start refused (ContainerConfigError, Secret "hf-token"): container '
                                   'learner: secret "hf-token" not found; fix: create Secret hf-token in the job\'s '
                                   'namespace, or correct the reference to it (env valueFrom, envFrom) in '
                                   'spec.learnerGroups[].template and spec.syncer.template; the kubelet retries on '
                                   'its own')


class Reads:
    """The API as the observe step reads it: records each request."""

    def __init__(self, sets: list[dict[str, Any]], events: list[dict[str, Any]]) -> None:
        self.sets, self.events, self.calls = sets, events, []

    def request(self, method: str, path: str, body: Any = None, *, params: dict[str, str] | None = None,
                content_type: str = "") -> dict[str, Any]:
        self.calls.append((method, path, params))
        return {"items": self.sets if path.endswith("/replicasets") else self.events}


def test_the_observe_step_reads_only_for_workloads_short_of_pods() -> None:
    whole = {("StatefulSet", "demo-us"): sts(have=2), ("Deployment", "demo-syncer"): deployment(have=1),
             ("ConfigMap", "demo-config"): {"metadata": {"name": "demo-config"}}}
    api = Reads([replica_set("new", 2)], [failed("demo-us-1", T1)])
    seen = pod_refusals.read(api, "jobs", whole, [])  # type: ignore[arg-type]
    assert api.calls == [] and pod_refusals.found(seen) == []  # an idle pass reads nothing more
    short = {("StatefulSet", "demo-us"): sts(), ("Deployment", "demo-syncer"): deployment()}
    seen = pod_refusals.read(api, "jobs", short, [pod("demo-us-0")])  # type: ignore[arg-type]
    assert api.calls == [
        ("GET", "apis/apps/v1/namespaces/jobs/replicasets", {"labelSelector": "app=syncer"}),
        ("GET", "api/v1/namespaces/jobs/events", {"fieldSelector": "involvedObject.uid=new"}),
        ("GET", "api/v1/namespaces/jobs/events", {"fieldSelector": "involvedObject.uid=sts-uid"})]
    assert [r.head() for r in pod_refusals.found(seen)] == [
        "Pod demo-us-1 of StatefulSet demo-us: create refused (QuotaExceeded, ResourceQuota learner-pods)"]
    api.calls.clear()  # a Deployment whose condition says why: no ReplicaSet read
    pod_refusals.read(api, "jobs", {("Deployment", "demo-syncer"): deployment(failure=RS_QUOTA)}, [])  # type: ignore[arg-type]
    assert api.calls == []


def test_a_pod_refusal_posts_once_though_its_message_moves() -> None:
    """A ReplicaSet's pods have generated names and a quota's usage moves: the Event goes out when
    what is refused, or by what, changes; not when the API server's words do."""
    first = pod_refusals.found(pod_refusals.Observed([deployment(failure=RS_QUOTA)], []))
    conds = refusals.condition([], first, "t0", 1)
    assert refusals.news([], conds, first) == first
    moved = pod_refusals.found(pod_refusals.Observed([deployment(failure=RS_QUOTA.replace("6b8c9d7f5-", "7c9d-"))], []))
    again = refusals.condition(conds, moved, "t1", 1)
    assert again[0]["message"] != conds[0]["message"] and refusals.news(conds, again, moved) == []
    learner = pod_refusals.found(pod_refusals.Observed([sts()], [], events=[failed("demo-us-1", T1)]))
    both = refusals.condition(again, [*moved, *learner], "t2", 1)
    assert refusals.news(again, both, [*moved, *learner]) == learner  # only the new one
    write = refusals.Refusal("StatefulSet", "demo-us", "create", refusals.QUOTA, QUOTA,
                             by="ResourceQuota learner-pods")  # its head is inside the pod's
    assert refusals.news(both, refusals.condition(both, [*learner, write], "t3", 1), [*learner, write]) == [write]


# -- through the operator (kopf) on the emulated API server, playing the controllers' signals --------------------

NS = "research"


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def job_condition(api: Kube) -> dict[str, Any]:
    body = api.get("DecoupledDiLoCoJob", NS, "demo") or {}
    return next((x for x in (body.get("status") or {}).get("conditions") or [] if x["type"] == "ChildrenRefused"), {})


def job_events(api: Kube, reason: str) -> list[dict[str, Any]]:
    items = api.request("GET", f"api/v1/namespaces/{NS}/events").get("items") or []
    return [e for e in items if e.get("reason") == reason and e["involvedObject"].get("kind") == "DecoupledDiLoCoJob"]


@pytest.mark.slow
def test_the_operator_shows_pods_the_controllers_and_kubelet_refuse(api: Kube) -> None:
    """No controllers run: the test posts what the StatefulSet controller, the Deployment
    controller and the kubelet report (a FailedCreate Event, a ReplicaFailure condition, a
    container waiting on a missing Secret), and creates the pod as the controller would once
    the quota is raised; the job's condition, Events and metric follow."""
    api.create({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob",
                "metadata": {"name": "demo", "namespace": NS},
                "spec": {"learnerGroups": [{"name": "us", "region": "us-central1", "replicas": 2}]}})
    with OperatorThread(Config(status_interval=0.3, chaos_interval=0.25, stuck_timeout=1.0)) as op:
        learners = wait_for(lambda: api.get("StatefulSet", NS, "demo-us"), what="the learner StatefulSet")
        api.request("POST", f"api/v1/namespaces/{NS}/events", {
            "apiVersion": "v1", "kind": "Event", "metadata": {"name": "demo-us.1", "namespace": NS},
            "involvedObject": {"apiVersion": "apps/v1", "kind": "StatefulSet", "namespace": NS, "name": "demo-us",
                               "uid": learners["metadata"]["uid"]},
            "reason": "FailedCreate", "type": "Warning", "source": {"component": "statefulset-controller"},
            "message": f"create Pod demo-us-1 in StatefulSet demo-us failed error: {POD_QUOTA}",
            "firstTimestamp": now(), "lastTimestamp": now(), "count": 1})
        shown = wait_for(lambda: (x := job_condition(api)).get("status") == "True" and x, what="ChildrenRefused")
        assert shown["reason"] == "QuotaExceeded" and shown["message"].startswith(
            "Pod demo-us-1 of StatefulSet demo-us: create refused (QuotaExceeded, ResourceQuota learner-pods): "
            f"{POD_QUOTA}; fix: raise the namespace's ResourceQuota learner-pods")
        [posted] = wait_for(lambda: job_events(api, "QuotaExceeded"), what="the QuotaExceeded Event")
        assert posted["type"] == "Warning" and "ResourceQuota learner-pods" in posted["message"]
        metric = op.ctx.metrics.registry.get_sample_value
        assert (metric("diloco_operator_child_writes_refused_total", {"kind": "Pod", "reason": "QuotaExceeded"})
                or 0) >= 1
        # The Deployment controller copies its ReplicaSet's failure: one more Event, for it alone.
        api.patch("Deployment", NS, "demo-syncer", {"status": {"conditions": [
            {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": RS_QUOTA}]}},
            sub="status")
        wait_for(lambda: len(job_events(api, "QuotaExceeded")) == 2, what="an Event for the syncer's pod")
        assert sorted(e["message"].split(":")[0] for e in job_events(api, "QuotaExceeded")) == [
            "Pod demo-us-1 of StatefulSet demo-us", "Pod of Deployment demo-syncer"]
        assert job_condition(api)["message"].endswith(
            "(and 1 more: Pod of Deployment demo-syncer: create refused (QuotaExceeded, ResourceQuota learner-pods))")
        # The quota raised: the controllers create the pods; one waits on a Secret no one made.
        labels = learners["spec"]["template"]["metadata"]["labels"]
        for name in ("demo-us-0", "demo-us-1"):
            api.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS,
                                                                       "labels": labels},
                        "spec": learners["spec"]["template"]["spec"]})
        api.patch("Pod", NS, "demo-us-0", {"status": {"phase": "Pending", "containerStatuses": [
            {"name": "learner", "ready": False, "restartCount": 0, "state": {"waiting": {
                "reason": "CreateContainerConfigError", "message": 'secret "hf-token" not found'}}}]}}, sub="status")
        api.patch("Deployment", NS, "demo-syncer", {"status": {"conditions": []}}, sub="status")
        config = wait_for(lambda: (x := job_condition(api)).get("reason") == "ContainerConfigError" and x,
                          what="the container waiting on its Secret")
        assert config["status"] == "True" and config["message"].startswith(
            'Pod demo-us-0: start refused (ContainerConfigError, Secret "hf-token"): container learner: secret '
            '"hf-token" not found; fix: create Secret hf-token')
        wait_for(lambda: job_events(api, "ContainerConfigError"), what="the ContainerConfigError Event")
        api.patch("Pod", NS, "demo-us-0", {"status": {"containerStatuses": [
            {"name": "learner", "ready": False, "restartCount": 0, "state": {"running": {}}}]}}, sub="status")
        cleared = wait_for(lambda: (x := job_condition(api)).get("status") == "False" and x, what="the condition cleared")
        assert cleared["reason"] == "ChildrenWritten" and len(job_events(api, "QuotaExceeded")) == 2
