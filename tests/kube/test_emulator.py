"""The emulated API server refuses what a real one refuses: a write whose resourceVersion
precondition is stale gets 409 on the status half too. Without it, a guarded Workload status
write (operator/kueue/api.py `write`) overwrote the admission Kueue had just written, and the
job never ran (tests/operator/kueue/test_gates.py, under load)."""

from __future__ import annotations

from typing import Any

import pytest

from diloco.operator.kube import ApiError, Kube
from tests.kube import NAMESPACE

pytest_plugins = ["tests.kube.fixtures"]
JOB = "DecoupledDiLoCoJob"


def job() -> dict[str, Any]:
    return {"apiVersion": "diloco.dev/v1alpha1", "kind": JOB, "metadata": {"name": "demo", "namespace": NAMESPACE},
            "spec": {"learnerGroups": [{"name": "us", "replicas": 1}]}}


@pytest.mark.parametrize("sub", [None, "status"])
def test_a_stale_resource_version_is_a_conflict_and_changes_nothing(api: Kube, sub: str | None) -> None:
    read = api.create(job())
    stale = read["metadata"]["resourceVersion"]
    moved = api.patch(JOB, NAMESPACE, "demo", {"status": {"phase": "Pending"}}, sub="status")
    assert moved["metadata"]["resourceVersion"] != stale
    change = {"status": {"phase": "Running"}} if sub else {"spec": {"suspend": True}}
    with pytest.raises(ApiError) as refused:
        api.patch(JOB, NAMESPACE, "demo", {"metadata": {"resourceVersion": stale}, **change}, sub=sub)
    assert refused.value.status == 409
    assert api.get(JOB, NAMESPACE, "demo") == moved
    current = moved["metadata"]["resourceVersion"]  # the current one is accepted
    done = api.patch(JOB, NAMESPACE, "demo", {"metadata": {"resourceVersion": current}, **change}, sub=sub)
    assert done["metadata"]["resourceVersion"] != current
