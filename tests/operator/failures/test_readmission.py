"""Re-admission, decided in one place (operator/failures/readmission.py), as a table: a lost slot
and its pods -> re-admitted (the status patch, the Count, the Event) or not.

That the pod-event pass and the reconcile's plan both take this decision, for a one-host and a
multi-host learner: tests/operator/reconcile/test_plan.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from diloco.contract import LearnerId
from diloco.operator.failures import gangs, pods, readmission
from diloco.operator.reconcile.actions import Count, Event
from diloco.operator.render import naming as n
from diloco.operator.status import job as st

T0 = 1_800_000_000.0
REF = n.job_reference("demo", "ml", "uid-1")
US1, TPU1 = LearnerId("us", 1), LearnerId("tpu", 1)
RUN = ("u0/0", "u1/0", "u2/0", "u3/0")  # tpu-1's recorded run: its 4 hosts' pods, no restart


def one_host(ready: bool = True, **meta: Any) -> dict[str, Any]:
    """Learner us-1's pod."""
    return {"metadata": {"name": "demo-us-1", "uid": "pod-1", "namespace": "ml",
                         "labels": {**n.selector("demo", n.LEARNER, "us"), n.INDEX: "1"}, **meta},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def host(h: int, uid: str | None = None, ready: bool = True) -> dict[str, Any]:
    """Host `h` of learner tpu-1 (gang demo-tpu-1)."""
    cs = {"name": n.LEARNER, "ready": ready, "restartCount": 0, "state": {"running": {}}}
    return {"metadata": {"name": f"demo-tpu-1-{h}", "uid": uid or f"u{h}", "namespace": "ml",
                         "labels": {**n.selector("demo", n.LEARNER, "tpu"), n.GANG: "demo-tpu-1",
                                    n.LEARNER_INDEX: "1", n.INDEX: str(h)}},
            "status": {"phase": "Running", "containerStatuses": [cs],
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def status(*lost: LearnerId, run: tuple[str, ...] | None = RUN) -> dict[str, Any]:
    """A running job's status with `lost` counted lost, and tpu-1's run recorded."""
    out: dict[str, Any] = {"learnerGroups": [st.group_entry({}, "us"), st.group_entry({}, "tpu")]}
    for learner in lost:
        out.update(pods.record_loss(out, learner, lost=pods.Loss("Deleted", "pod deleted"), pod_uid="gone",
                                    now=T0) or {})
    return {**out, **(gangs.set_run(out, "tpu-1", run) if run else {})}


ALL = [host(h) for h in range(4)]

# Each row: name, the status, the learner, its pods, its hosts; then the Event's "why", or None: not re-admitted.
ROWS: list[tuple[str, dict[str, Any], LearnerId, list[dict[str, Any]], int, str | None]] = [
    ("a lost one-host learner's pod ready: re-admitted", status(US1), US1, [one_host()], 1, "pod demo-us-1 is ready"),
    ("its pod not ready yet: still lost", status(US1), US1, [one_host(ready=False)], 1, None),
    ("its pod Terminating: still lost", status(US1), US1, [one_host(deletionTimestamp=st.rfc3339(T0))], 1, None),
    ("not lost: nothing to re-admit (a duplicate event)", status(), US1, [one_host()], 1, None),
    ("a lost multi-host learner with every host of its run ready: re-admitted", status(TPU1), TPU1, ALL, 4,
     "all 4 hosts are ready"),
    ("a host not ready: still lost", status(TPU1), TPU1, [*ALL[:3], host(3, ready=False)], 4, None),
    ("a host missing: still lost", status(TPU1), TPU1, ALL[:3], 4, None),
    ("a host ready but not of the run (replaced): still lost", status(TPU1), TPU1, [*ALL[:3], host(3, uid="v3")], 4,
     None),
    ("no run recorded yet: still lost", status(TPU1, run=None), TPU1, ALL, 4, None),
    ("every host back but not lost: nothing to re-admit", status(), TPU1, ALL, 4, None),
]


@pytest.mark.parametrize(("row", "before", "learner", "slot_pods", "hosts", "why"), ROWS, ids=[r[0] for r in ROWS])
def test_a_slot_is_readmitted_once_its_pods_are_back(row: str, before: dict[str, Any], learner: LearnerId,
                                                     slot_pods: list[dict[str, Any]], hosts: int,
                                                     why: str | None) -> None:
    back = readmission.decide(before, REF, learner, slot_pods, hosts=hosts)
    if why is None:
        assert back is None
        return
    assert back is not None
    assert back.count == Count("readmissions", ("ml", "demo", learner.group))
    assert back.event == Event("LearnerReadmitted", f"learner {learner} is back: {why}")
    assert back.then == (back.count, back.event)
    # The patch: the slot no longer lost, its group's readmitted counter up by one, the others as they were.
    assert back.patch == pods.record_ready(before, learner)
    assert pods.open_losses(back.patch) == [] and set(back.patch) == {"learnerGroups", "lostLearners"}
    counters = {g["name"]: g["readmitted"] for g in back.patch["learnerGroups"]}
    assert counters == {"us": 0, "tpu": 0, learner.group: 1}
    again = {**before, **back.patch}
    assert readmission.decide(again, REF, learner, slot_pods, hosts=hosts) is None  # once


def test_one_slot_readmitted_leaves_the_other_lost_slots_lost() -> None:
    before = status(US1, TPU1)
    back = readmission.decide(before, REF, US1, [one_host()])
    assert back is not None and [x["slot"] for x in back.patch["lostLearners"]] == ["tpu-1"]
    gang = readmission.decide({**before, **back.patch}, REF, TPU1, ALL, hosts=4)
    assert gang is not None and gang.patch["lostLearners"] == []
    assert [g["readmitted"] for g in gang.patch["learnerGroups"]] == [1, 1]


def test_the_decision_leaves_its_inputs_alone() -> None:
    before, slot_pods = status(US1), [one_host()]
    copy = {**before, "learnerGroups": [dict(g) for g in before["learnerGroups"]],
            "lostLearners": [dict(x) for x in before["lostLearners"]]}
    readmission.decide(before, REF, US1, slot_pods)
    assert before == copy and slot_pods == [one_host()]
