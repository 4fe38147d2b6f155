"""Refused child writes, pure and through children.sync: what they are, and how the job shows them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from diloco.operator import children, conditions, refusals
from diloco.operator.kube import ApiError, Kube

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
    assert r.describe() == f"StatefulSet demo-us: create refused ({reason}): {detail}; fix: {refusals.FIXES[reason]}"


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
    assert refused["message"].endswith("(and 1 more: Deployment demo-syncer)")
    cleared = conditions.find(refusals.condition(conds, [], "t1", 2), conditions.CHILDREN_REFUSED)
    assert cleared is not None and (cleared["status"], cleared["reason"]) == ("False", "ChildrenWritten")


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
