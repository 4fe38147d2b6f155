"""pytest fixtures for the operator tests: an emulated cluster, an API client, controllers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from diloco.operator.kube import Kube
from tests.kube import NAMESPACE
from tests.kube.controllers import Controllers
from tests.kube.emulator import ClusterThread
from tests.kube.running import write_kubeconfig


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ClusterThread]:
    with ClusterThread() as ct:
        # The operator logs in like any client would: through $KUBECONFIG.
        monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kubeconfig", ct.url)))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield ct


@pytest.fixture
def api(cluster: ClusterThread) -> Kube:
    return Kube(cluster.url, user_agent="diloco-tests")


@pytest.fixture
def controllers(api: Kube) -> Iterator[Controllers]:
    with Controllers(api, NAMESPACE) as c:
        yield c
