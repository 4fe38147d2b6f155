"""The operator replicas' peering settings (operator/peering.py) and their User-Agents, without a
cluster: who ranks higher, what the chart's environment gives, what is refused and how, and that
kopf's client and ours both name the pod. tests/realapi/test_peering.py runs two replicas."""

from __future__ import annotations

import argparse
import time
from typing import Any

import kopf
import pytest

from diloco.contract import Exit
from diloco.operator import handlers, main, peering
from diloco.operator.context import Config, Context
from diloco.operator.kube import ApiError, Kube, replica_agent
from diloco.operator.peering import LIFETIME, TIEBREAK, Peering
from diloco.operator.render.naming import MANAGER

INT64 = 2**63 - 1


def test_the_earlier_replica_ranks_higher_and_a_tie_break_separates_one_millisecond() -> None:
    assert peering.priority(1_000, 999_999) > peering.priority(1_001, 0)
    assert peering.priority(1_000, 1) != peering.priority(1_000, 2)
    year_2200_ms = 7_258_118_400_000
    assert -INT64 - 1 <= peering.priority(year_2200_ms, TIEBREAK - 1) < 0  # JSON int64 in the peering object
    with pytest.raises(ValueError, match="tiebreak"):
        peering.priority(1_000, TIEBREAK)


def test_replicas_started_one_after_the_other_are_distinct_and_ordered() -> None:
    first = Peering.start("diloco", "pod-a")
    time.sleep(0.002)  # a later millisecond: within one, the random tie-break orders them
    second = Peering.start("diloco", "pod-b")
    assert first.priority > second.priority and first.lifetime == LIFETIME


def test_the_charts_environment_names_object_identity_and_lifetime() -> None:
    p = Peering.from_env({"DILOCO_PEERING_NAME": "diloco-decoupled-diloco", "POD_NAME": "diloco-7f9-x2",
                          "DILOCO_PEERING_LIFETIME_SECONDS": "15"})
    assert (p.name, p.identity, p.lifetime) == ("diloco-decoupled-diloco", "diloco-7f9-x2", 15)
    outside = Peering.from_env({"DILOCO_PEERING_NAME": "x"})
    assert outside.identity and outside.lifetime == LIFETIME  # host/pid: unique per process


@pytest.mark.parametrize(("env", "named"), [
    ({}, "$DILOCO_PEERING_NAME"),
    ({"DILOCO_PEERING_NAME": "x", "DILOCO_PEERING_LIFETIME_SECONDS": "ten"}, "$DILOCO_PEERING_LIFETIME_SECONDS"),
    ({"DILOCO_PEERING_NAME": "x", "DILOCO_PEERING_LIFETIME_SECONDS": "2"}, "at least 5 seconds"),
])
def test_bad_peering_settings_are_refused_naming_the_setting(env: dict[str, str], named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("$", r"\$")):
        Peering.from_env(env)


def test_peering_is_mandatory_and_kopf_gets_the_replicas_identity_and_priority() -> None:
    p = Peering("diloco", "pod-a", -5, lifetime=12)
    settings = kopf.OperatorSettings()
    p.apply(settings)
    assert settings.peering.mandatory and not settings.peering.standalone
    assert (settings.peering.name, settings.peering.priority, settings.peering.lifetime) == ("diloco", -5, 12)
    assert p.run_kwargs() == {"standalone": False, "identity": "pod-a", "priority": -5, "peering_name": "diloco"}


def test_main_without_the_peering_name_exits_with_the_fix(capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DILOCO_PEERING_NAME", raising=False)
    assert main.main(argparse.Namespace(namespace=None, standalone=False)) == int(Exit.CONFIG)
    err = capsys.readouterr().err
    assert "$DILOCO_PEERING_NAME is not set" in err and "--standalone" in err


class Listing:
    """Answers peering lists: `present` names the namespaces (None: cluster-wide) holding the object."""

    def __init__(self, present: set[str | None], crd: bool = True):
        self.present, self.crd, self.paths = present, crd, []

    def request(self, method: str, path: str, body: Any = None, *, params: dict[str, str] | None = None,
                content_type: str = "") -> dict[str, Any]:
        self.paths.append((method, path, params))
        if not self.crd:
            raise ApiError(404, "the server could not find the requested resource")
        namespace = path.split("/namespaces/")[1].split("/")[0] if "/namespaces/" in path else None
        return {"items": [{"metadata": {"name": "p"}}] if namespace in self.present else []}


def test_a_missing_peering_object_or_crd_stops_the_start_naming_what_is_missing() -> None:
    p = Peering("p", "pod-a", 0)
    cluster = Listing({None})
    peering.require(cluster, p, [])  # type: ignore[arg-type]
    assert cluster.paths == [("GET", "apis/kopf.dev/v1/clusterkopfpeerings", {"fieldSelector": "metadata.name=p"})]
    with pytest.raises(ValueError, match=r"KopfPeering b/p \(apiVersion kopf.dev/v1\).*--standalone"):
        peering.require(Listing({"a"}), p, ["a", "b"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ClusterKopfPeering p"):
        peering.require(Listing(set(), crd=False), p, [])  # type: ignore[arg-type]


def test_both_clients_name_the_replica_in_their_user_agent() -> None:
    assert replica_agent({"POD_NAME": "diloco-7f9-x2"}) == f"{MANAGER} (diloco-7f9-x2)"
    assert replica_agent({}) == MANAGER  # outside a pod: the field manager's name, as before
    kube = Kube("https://127.0.0.1:6443", token="t0k", user_agent=replica_agent({"POD_NAME": "pod-a"}))
    ctx = Context(Config(), kube=kube)
    info = handlers.login(memo=kopf.Memo(ctx=ctx))
    headers = info.as_http_headers()
    assert headers["Authorization"] == "Bearer t0k"
    assert headers["User-Agent"].startswith(f"{MANAGER} (pod-a) kopf/")
    assert info.server == kube.host and not info.insecure
