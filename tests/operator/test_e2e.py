"""The whole system on one machine: operator, syncer and learners training for real.

The emulated API server stands in for Kubernetes; tests/kube/controllers.py plays the
StatefulSet and Deployment controllers and the kubelet, which runs every pod's container
command as a local process (tests/kube/processes.py). The operator's chaos deletes a learner
pod; the other learner keeps training; the StatefulSet replaces the pod; the new learner
re-joins; the custom resource's status shows the loss, the re-admission and the progress.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from diloco.core.chaos import ChaosSchedule
from diloco.operator.context import Config
from diloco.operator.kube import Kube
from diloco.operator.render import naming as n
from diloco.spec import Chaos
from tests.helpers import TINY_MODEL, wait_for
from tests.kube import NAMESPACE
from tests.kube.controllers import Controllers
from tests.kube.processes import ProcessRuntime
from tests.kube.running import OperatorThread

pytest_plugins = ["tests.kube.fixtures"]
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
MEAN = 60.0
# A seed whose schedule kills once within 5 s of the job running, then not again for 80 s.
SEED = next(s for s in range(10_000) if (c := ChaosSchedule(Chaos(enabled=True, mean_seconds_between_kills=MEAN, seed=s)))
            .due_at(0) <= 5.0 < 80.0 < c.due_at(1))


def status(kube: Kube) -> dict[str, Any]:
    return (kube.get("DecoupledDiLoCoJob", NAMESPACE, "e2e") or {}).get("status") or {}


def events(kube: Kube, reason: str) -> list[dict[str, Any]]:
    items = kube.request("GET", f"api/v1/namespaces/{NAMESPACE}/events").get("items") or []
    return [e for e in items if e.get("reason") == reason]


@pytest.fixture
def runtime(api: Kube, tmp_path: Path) -> Iterator[ProcessRuntime]:
    rt = ProcessRuntime(api, NAMESPACE, tmp_path)
    yield rt
    rt.close()


def test_chaos_kill_readmission_and_training_continue(api: Kube, runtime: ProcessRuntime) -> None:
    config = Config(status_interval=1.0, chaos_interval=0.5, stuck_timeout=10.0,
                    syncer_address=lambda job, ns: runtime.local(n.syncer_address(job, ns)))
    with Controllers(api, NAMESPACE, runtime, period=0.2), OperatorThread(config):
        api.create({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob",
                    "metadata": {"name": "e2e", "namespace": NAMESPACE},
                    "spec": {"learnerGroups": [{"name": "local", "replicas": 2}],
                             "syncer": {"fragments": 2, "checkpointIntervalSeconds": 5},
                             "model": dict(TINY_MODEL),
                             "training": {"batchSize": 8, "warmupSteps": 10, "decaySteps": 5000,
                                          "evalIntervalSteps": 100000},
                             "chaos": {"enabled": True, "meanSecondsBetweenKills": MEAN, "seed": SEED,
                                       "maxConcurrent": 1}}})
        running = wait_for(lambda: (s := status(api)).get("phase") == "Running" and s.get("learners") == "2/2" and s,
                           timeout=60, what="both learners joined")
        assert running["syncer"]["ready"]

        kill = wait_for(lambda: events(api, "ChaosKill"), timeout=20, what="a chaos kill")[0]
        victim = kill["message"].rsplit(" ", 1)[-1]
        # A planned restart (chaos), not a learner loss; the slot is down until it is back.
        wait_for(lambda: status(api)["learnerGroups"][0].get("planned") == 1, timeout=10, what="the restart counted")
        assert status(api)["learnerGroups"][0]["lost"] == 0
        before = status(api)
        wait_for(lambda: status(api).get("outerVersion", 0) > before.get("outerVersion", 0) + 5, timeout=20,
                 what="merges while a learner is down")

        after = wait_for(lambda: (s := status(api))["learnerGroups"][0]["readmitted"] == 1 and s, timeout=60,
                         what="the replacement re-admitted")
        assert after["lostLearners"] == []
        wait_for(lambda: status(api)["learners"] == "2/2", timeout=10, what="both learners ready again")
        wait_for(lambda: events(api, "LearnerRestarted") and events(api, "LearnerReadmitted"), timeout=10,
                 what="the restart and re-admission Events")  # kopf posts Events from a queue
        assert not events(api, "LearnerLost")
        wait_for(lambda: status(api).get("syncer", {}).get("readmissions", 0) >= 1, timeout=10,
                 what="the syncer's view of the re-join")
        old_pod, new_pod = runtime.logs_of(victim)  # the replacement joined the running job
        assert '"event": "joined"' in old_pod and '"event": "joined"' in new_pod
        final = wait_for(lambda: (s := status(api)).get("outerVersion", 0) > after.get("outerVersion", 0) + 5 and s,
                         timeout=20, what="training after re-admission")
        assert final["tokensMerged"] > after["tokensMerged"] > 0
        assert 0 < final["goodput"] <= 1
        assert final["syncer"]["activeLearners"] == 2
