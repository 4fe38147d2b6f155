"""Immutability, pure: what a started job records, which edits are refused, and that the job
runs on exactly as it started (children unchanged) until the edit is reverted."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import numpy as np
import pytest
import yaml

from diloco.operator import handlers
from diloco.operator.admission import immutable
from diloco.operator.reconcile import passes
from diloco.operator.render import job as render
from diloco.operator.render import naming as n
from diloco.operator.status import conditions
from diloco.operator.status import job as st
from diloco.spec import MANAGED_BY, parse_job
from diloco.trainer import data
from diloco.trainer.data import Tokens

T0 = 1_800_000_000.0
UID = "uid-1"


def body(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob",
            "metadata": {"name": "demo", "namespace": "research", "uid": UID},
            "spec": {"learnerGroups": [{"name": "us", "replicas": 2}], **spec}}


def started(b: dict[str, Any]) -> dict[str, Any]:
    """`b` as the operator leaves it after its first pass: Created, with the started values."""
    job = parse_job(b)
    status = st.compute(job.spec, {}, st.Observation(now=T0), generation=1)
    return {**b, "status": immutable.record({}, status, UID, job.spec)}


def edit(b: dict[str, Any], **spec: Any) -> dict[str, Any]:
    out = copy.deepcopy(b)
    out["spec"].update(spec)
    return out


def children(b: dict[str, Any]) -> list[dict[str, Any]]:
    job, problems, _ = passes._effective(b)
    assert job is not None, problems
    return render.children(job, render.Owner("demo", "research", UID), "t" * 32, started=True, finished=False)


def test_the_values_are_recorded_once_the_job_starts_and_not_before() -> None:
    job = parse_job(body(suspend=True))
    suspended = st.compute(job.spec, {}, st.Observation(now=T0), generation=1)
    assert immutable.FIELD not in immutable.record({}, suspended, UID, job.spec)  # queued: may still change
    b = started(body())
    fields = b["status"][immutable.FIELD]["fields"]
    assert b["status"][immutable.FIELD]["uid"] == UID and "managedBy" not in fields  # unset: absent, never null
    assert fields["syncer.fragments"] == 4 and fields["model"]["dModel"] == 128 and fields["data"]["seed"] == 0
    again = immutable.record(b["status"], {"conditions": b["status"]["conditions"]}, UID, job.spec)
    assert immutable.FIELD not in again  # recorded once: st.compute carries it


@pytest.mark.parametrize("change, field", [
    ({"model": {"dModel": 256}}, "spec.model.dModel is 256, started with 128"),
    ({"data": {"seed": 7}}, "spec.data.seed is 7, started with 0"),
    ({"syncer": {"fragments": 8}}, "spec.syncer.fragments is 8, started with 4"),
    ({"syncer": {"fragments": 4, "shards": 2}}, "spec.syncer.shards is 2, started with 1"),
    ({"managedBy": "kueue.x-k8s.io/multikueue"}, "spec.managedBy is 'kueue.x-k8s.io/multikueue', started with unset"),
    ({"syncer": {"fragments": 4, "checkpoints": {"url": "s3://ckpt/demo"}}},
     "spec.syncer.checkpoints.url is 's3://ckpt/demo', started with unset"),
])
def test_a_started_job_refuses_an_immutable_change_and_keeps_its_children(change: dict[str, Any], field: str) -> None:
    b = started(body())
    before = children(b)
    changed = edit(b, **change)
    job, problems, refused = passes._effective(changed)
    assert job is not None and problems == [] and len(refused) == 1
    assert refused[0].startswith(field) and "set it back, or create a new job" in refused[0]
    assert children(changed) == before  # the job runs on exactly as it started
    assert job.spec.runs_here()  # managedBy too: the operator keeps running what it started


def test_other_changes_of_the_same_edit_still_apply() -> None:
    b = started(body(data={"shards": 4}))  # room to scale up (test_a_scale_up_*)
    changed = edit(b, model={"dModel": 256}, learnerGroups=[{"name": "us", "replicas": 3}])
    job, _, refused = passes._effective(changed)
    assert job is not None and refused and job.spec.total_learners == 3 and job.spec.model.d_model == 128


def test_an_explicit_default_is_no_change() -> None:
    b = started(body())
    assert passes._effective(edit(b, model={"dModel": 128, "layers": 2}, syncer={"fragments": 4}))[2] == []


def test_before_the_job_starts_anything_may_change() -> None:
    b = body(suspend=True)
    job, problems, refused = passes._effective(edit(b, model={"dModel": 256}))
    assert job is not None and job.spec.model.d_model == 256 and refused == problems == []


def test_a_record_of_another_object_is_ignored() -> None:
    b = started(body())
    copied = {**edit(b, model={"dModel": 256}), "metadata": {**b["metadata"], "uid": "other"}}
    assert immutable.started(copied) is None and passes._effective(copied)[2] == []


def test_the_condition_names_the_field_and_reverting_clears_it() -> None:
    b = started(body())
    status = b["status"]
    refused = passes._effective(edit(b, model={"dModel": 256}))[2]
    assert immutable.newly_refused(status, refused)
    new = immutable.condition({"conditions": status["conditions"]}, status, problems=refused, now="t1", generation=2)
    rejected = conditions.find(new["conditions"], conditions.SPEC_REJECTED)
    assert (rejected["status"], rejected["reason"]) == ("True", "SpecImmutable") and "spec.model.dModel" in rejected["message"]
    status = {**status, **new}
    assert not immutable.newly_refused(status, refused)  # the Event is posted once
    reverted = immutable.condition({"conditions": status["conditions"]}, status, problems=[], now="t2", generation=3)
    rejected = conditions.find(reverted["conditions"], conditions.SPEC_REJECTED)
    assert (rejected["status"], rejected["reason"]) == ("False", "SpecAccepted")
    assert immutable.condition({}, {}, problems=[], now="t", generation=1) == {}  # never refused: no condition at all


def test_an_invalid_restored_spec_is_reported_with_the_refusal() -> None:
    groups = [{"name": "us", "replicas": 2}, {"name": "eu", "replicas": 2, "shardOffset": 2}]
    b = started(body(data={"shards": 4}, learnerGroups=groups))
    # A group moved past the started shard count along with data.shards: the restored spec is invalid.
    moved = [groups[0], {**groups[1], "shardOffset": 4}]
    job, problems, refused = passes._effective(edit(b, data={"shards": 6}, learnerGroups=moved))
    assert job is None and problems[0] == refused[0] and any("spec.data.shards" in p for p in problems[1:])


def test_handlers_keep_a_started_job_whose_managed_by_was_changed() -> None:
    b = started(body())
    moved = edit(b, managedBy="kueue.x-k8s.io/multikueue")
    assert handlers.ours(moved["spec"], status=moved["status"], meta=moved["metadata"])
    assert not handlers.ours(moved["spec"], status=moved["status"], meta={"uid": "a copy elsewhere"})
    assert not handlers.ours(moved["spec"], status={}, meta=moved["metadata"])  # never ours: left alone
    assert handlers.ours({"managedBy": MANAGED_BY}) and handlers.ours({})


def test_a_field_added_to_the_spec_after_the_record_is_no_change() -> None:
    b = started(body())
    del b["status"][immutable.FIELD]["fields"]["model"]["dtype"]  # as if an older operator had recorded it
    assert passes._effective(b)[2] == []
    assert passes._effective(edit(b, model={"dtype": "bfloat16"}))[2]  # but setting it is a change


def test_the_record_is_carried_by_every_status() -> None:
    b = started(body())
    job = parse_job(b)
    again = st.compute(job.spec, b["status"], st.Observation(now=T0 + 5), generation=2)
    assert again[immutable.FIELD] == b["status"][immutable.FIELD]
    assert st.changed(b["status"], again).get(immutable.FIELD) is None  # never written twice


def learner_shards(b: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Each rendered learner's (shard, shard count), as its pod reads them from its ConfigMap."""
    config = next(k for k in children(b) if k["kind"] == "ConfigMap" and k["metadata"]["name"] == n.config_map("demo"))
    job = parse_job(yaml.safe_load(config["data"][n.CONFIG_KEY]))
    return {f"{g.name}-{i}": job.spec.shard_of(g.name, i) for g in job.spec.learner_groups for i in range(g.replicas)}


def token_ranges(shards: dict[str, tuple[int, int]], tokens: int = 10_000) -> dict[str, set[int]]:
    """The token positions each learner trains on: the trainer's own split of a corpus."""
    corpus = Tokens([np.arange(tokens)])
    return {who: set(data.shard_of(corpus, s % n, n).array().tolist()) for who, (s, n) in shards.items()}


def test_a_scale_up_past_the_started_shards_is_refused_and_the_learners_keep_theirs() -> None:
    """spec.data.shards unset: one shard per learner at the start, then fixed. 2 -> 3 learners
    would move the boundaries under the running two and overlap the new one with learner 1."""
    b = started(body())
    assert b["status"][immutable.FIELD]["fields"]["data"]["shards"] == 2
    before = learner_shards(b)
    up = edit(b, learnerGroups=[{"name": "us", "replicas": 3}])
    job, problems, refused = passes._effective(up)
    assert job is not None and not problems and len(refused) == 1
    assert refused[0].startswith("spec.learnerGroups: 3 learners need 3 data shards") and "spec.data.shards" in refused[0]
    assert learner_shards(up) == before == {"us-0": (0, 2), "us-1": (1, 2)}
    assert children(up) == children(b)  # the job runs on as it started
    # A scale-down keeps the layout: the learner left keeps its shard; scaling back up is no change.
    down = edit(b, learnerGroups=[{"name": "us", "replicas": 1}])
    assert passes._effective(down)[2] == [] and learner_shards(down) == {"us-0": (0, 2)}
    assert learner_shards(edit(down, learnerGroups=[{"name": "us", "replicas": 2}])) == before


def test_a_scale_up_within_the_started_shards_gives_no_two_learners_the_same_tokens() -> None:
    b = started(body(data={"shards": 4}))
    before = token_ranges(learner_shards(b))
    up = edit(b, learnerGroups=[{"name": "us", "replicas": 3}])
    assert passes._effective(up)[2] == []
    after = token_ranges(learner_shards(up))
    assert len(after) == 3 and all(after[k] == v for k, v in before.items())  # the running two keep theirs
    for a, b_ in itertools.combinations(after.values(), 2):
        assert not a & b_
    assert sum(map(len, after.values())) >= 3 * (10_000 // 4) - 3


def test_an_explicit_shard_count_changed_with_a_scale_up_keeps_the_started_learners() -> None:
    b = started(body(data={"shards": 2}))
    job, problems, refused = passes._effective(edit(b, data={"shards": 3},
                                                      learnerGroups=[{"name": "us", "replicas": 3}]))
    assert job is not None and not problems and job.spec.total_learners == 2 and job.spec.data.shards == 2
    assert any(r.startswith("spec.learnerGroups: 3 learners") for r in refused)
    assert any("spec.data.shards is 3, started with 2" in r for r in refused)


def test_the_checkpoints_stay_where_the_syncer_restores_them() -> None:
    # Moved to another store, or from a store to the volume, the syncer would find no checkpoint and
    # start again from Θ₀: refused, and the job runs on from the started store (its credentials may change).
    b = started(body(syncer={"checkpoints": {"url": "s3://ckpt/demo"}}))
    before = children(b)
    moved = edit(b, syncer={"checkpoints": {"url": "s3://other/demo", "secretName": "other-keys"}})
    job, problems, refused = passes._effective(moved)
    assert job is not None and problems == [] and len(refused) == 1
    assert refused[0].startswith("spec.syncer.checkpoints.url is 's3://other/demo', started with 's3://ckpt/demo'")
    assert job.spec.syncer.checkpoints is not None and job.spec.syncer.checkpoints.url == "s3://ckpt/demo"
    assert job.spec.syncer.checkpoints.secret_name == "other-keys"
    (to_volume,) = passes._effective(edit(b, syncer={}))[2]
    assert to_volume.startswith("spec.syncer.checkpoints.url is unset, started with 's3://ckpt/demo'")
    assert children(edit(b, syncer={})) == before
    rotated = edit(b, syncer={"checkpoints": {"url": "s3://ckpt/demo", "secretName": "rotated"}})
    assert passes._effective(rotated)[2] == []


def test_a_record_from_before_the_checkpoint_rule_keeps_the_store_it_runs_on() -> None:
    b = started(body(syncer={"checkpoints": {"url": "s3://ckpt/demo"}}))
    del b["status"][immutable.FIELD]["fields"][immutable.LOCATION]  # an older operator's record
    job, problems, refused = passes._effective(b)
    assert refused == problems == [] and job is not None and job.spec.syncer.checkpoints is not None
    assert job.spec.syncer.checkpoints.url == "s3://ckpt/demo"
