"""A pass that fails is tried again at the next refresh (operator/handlers.py), not after kopf's
default minute: a remote cluster's own operator whose API server was paused a moment left its
job's status a minute stale in the three-cluster module."""

from __future__ import annotations

import time

import pytest

from diloco.operator.kube import Kube
from diloco.operator.render import naming as n
from tests.helpers import wait_for
from tests.kube import NAMESPACE
from tests.kube.controllers import Controllers
from tests.kube.emulator import ClusterThread
from tests.kube.running import OperatorThread
from tests.operator.test_handlers import FAST, children_of, manifest

pytestmark = pytest.mark.slow  # the kopf operator on an emulated API server
pytest_plugins = ["tests.kube.fixtures"]
AWAY = 3.0  # seconds the API server answers every request 503
# FAST refreshes every 0.5 s; the wait below allows 20 s for a loaded machine, a third of kopf's minute.


def test_a_pass_that_failed_is_tried_again_at_the_next_refresh(cluster: ClusterThread, api: Kube,
                                                               controllers: Controllers) -> None:
    assert cluster.cluster is not None
    with OperatorThread(FAST):
        api.create(manifest())
        wait_for(lambda: ("ConfigMap", n.config_map("demo")) in children_of(api), timeout=30, what="the job's children")
        cluster.unavailable(AWAY)
        time.sleep(AWAY)
        assert cluster.cluster.refused.get(n.MANAGER), f"no pass ran while the server was away: {cluster.cluster.refused}"
        # No watch sees a ConfigMap go (the operator watches jobs, pods and Workloads): only the
        # refresh timer, failed while the server was away, puts it back.
        api.delete("ConfigMap", NAMESPACE, n.config_map("demo"))
        wait_for(lambda: api.get("ConfigMap", NAMESPACE, n.config_map("demo")), timeout=20,
                 what="the refresh putting the deleted ConfigMap back once the server answers")
