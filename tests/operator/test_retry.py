"""A pass that fails is tried again at the next refresh (operator/handlers.py), not after
kopf's default minute: a remote cluster's own operator whose API server was away a moment
left its job's status a minute stale in the three-cluster module."""

from __future__ import annotations

import time
from typing import Any

import pytest

from diloco.operator.kube import Kube
from diloco.operator.reconcile import observe
from tests.helpers import wait_for
from tests.kube.controllers import Controllers
from tests.kube.running import OperatorThread
from tests.operator.test_handlers import FAST, children_of, manifest, status

pytestmark = pytest.mark.slow  # the kopf operator on an emulated API server
pytest_plugins = ["tests.kube.fixtures"]
AWAY = 3.0  # seconds every pass fails, as while the API server does not answer
# FAST refreshes every 0.5 s; the wait below allows 20 s for a loaded machine, a third of kopf's minute.


def test_a_pass_that_failed_is_tried_again_within_seconds(api: Kube, controllers: Controllers,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    real, failed = observe.observe, []

    def away(*args: Any, **kwargs: Any) -> Any:
        """Every pass fails for AWAY seconds from the first, then the server answers again."""
        now = time.monotonic()
        if not failed or now < failed[0] + AWAY:
            failed.append(now)
            raise ConnectionError("the API server does not answer")
        return real(*args, **kwargs)

    monkeypatch.setattr(observe, "observe", away)
    with OperatorThread(FAST):
        api.create(manifest())
        wait_for(lambda: failed and time.monotonic() >= failed[0] + AWAY, timeout=60, what="passes failing")
        wait_for(lambda: status(api).get("phase") and children_of(api), timeout=20,
                 what="the job's children and status once the passes succeed again")
