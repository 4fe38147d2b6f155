"""A sharded syncer's standby added or removed while it runs (operator/reconcile/syncer_switch.py):
the old kind's workload goes first, and the new one is rendered only once its pods are gone, so
a shard is never served (nor checkpointed to its store prefix) by two syncers at once."""

from __future__ import annotations

from typing import Any

from diloco.operator.reconcile import children, syncer_switch
from diloco.operator.reconcile.actions import Event
from diloco.operator.reconcile.plan import plan
from diloco.operator.render import naming as n
from diloco.operator.status import conditions as c
from diloco.operator.status import job as st
from tests.operator.reconcile.test_plan import T0, applied, body, condition, kinds, learner, observed, view

SHARDED = {"fragments": 4, "shards": 2, "checkpoints": {"url": "s3://ckpt/demo"}}
STANDBY = {**SHARDED, "standby": {}}
STATEFULSET = ("StatefulSet", "demo-syncer")
PAIRS = {("Deployment", "demo-syncer-shard-0"), ("Deployment", "demo-syncer-shard-1")}


def syncer(name: str, shard: int | None = None) -> dict[str, Any]:
    labels = {**n.selector("demo", n.SYNCER), **({n.SHARD: str(shard)} if shard is not None else {})}
    return {"metadata": {"name": name, "uid": f"pod-{name}", "labels": labels},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}


def running(syncer_spec: dict[str, Any]) -> tuple[dict[str, Any], dict[children.Key, Any]]:
    """The job's status and children once it runs with `syncer_spec`."""
    first = plan(observed(body(syncer=syncer_spec)), T0)
    return first.status, applied(first)


def test_a_standby_added_to_a_running_sharded_syncer_starts_after_the_old_shards_stop() -> None:
    status, live = running(SHARDED)
    old_pods = [syncer("demo-syncer-0"), syncer("demo-syncer-1")]
    learners = [learner(0), learner(1)]

    def desired(live: dict[children.Key, Any], pods: list[dict[str, Any]]) -> Any:
        return plan(observed(body(status, syncer=STANDBY), live=live, pods=learners + pods, syncer=(view(), "")), T0)

    # The StatefulSet goes; the shards' pairs wait while either of its pods is left, and the job says so.
    p = desired(live, old_pods)
    assert STATEFULSET in kinds(p.children.delete) and not PAIRS & kinds(p.children.apply)
    assert condition(p, c.RUNNING) == ("False", st.SYNCER_SWITCHING)
    (told,) = [e for e in p.events if isinstance(e, Event) and e.reason == st.SYNCER_SWITCHING]
    assert "pod demo-syncer-0, pod demo-syncer-1 are gone" in told.message
    status = p.status
    gone = {k: v for k, v in live.items() if k != STATEFULSET}
    p = desired(gone, old_pods[1:])  # one shard's pod still writing its final checkpoint
    assert not PAIRS & kinds(p.children.apply)
    assert not [e for e in p.events if isinstance(e, Event) and e.reason == st.SYNCER_SWITCHING]  # told once
    assert syncer_switch.waiting_for(p_job(STANDBY), gone, old_pods[1:]) == ["pod demo-syncer-1"]
    p = desired(gone, [])
    assert kinds(p.children.apply) >= PAIRS


def test_a_standby_removed_waits_for_every_pair_to_stop() -> None:
    status, live = running(STANDBY)
    pairs = [syncer(f"demo-syncer-shard-{i}-{x}", i) for i in range(2) for x in "ab"]
    p = plan(observed(body(status, syncer=SHARDED), live=live, pods=pairs, syncer=(view(), "")), T0)
    assert kinds(p.children.delete) >= PAIRS and STATEFULSET not in kinds(p.children.apply)
    gone = {k: v for k, v in live.items() if k not in PAIRS}
    p = plan(observed(body(status, syncer=SHARDED), live=gone, pods=[], syncer=(view(), "")), T0)
    assert STATEFULSET in kinds(p.children.apply)


def test_no_switch_holds_nothing_back() -> None:
    for spec in (SHARDED, STANDBY, {"fragments": 4, "checkpoints": {"url": "s3://ckpt/demo"}, "standby": {}}):
        status, live = running(spec)
        pods = [syncer(f"demo-syncer-shard-{i}-a", i) for i in range(2)] if spec is STANDBY else \
            [syncer("demo-syncer-0")]
        assert syncer_switch.waiting_for(p_job(spec), live, pods) == []
        again = plan(observed(body(status, syncer=spec), live=live, pods=pods, syncer=(view(), "")), T0)
        assert not again.children.delete


def p_job(syncer_spec: dict[str, Any]) -> Any:
    job = observed(body(syncer=syncer_spec)).job
    assert job is not None
    return job
