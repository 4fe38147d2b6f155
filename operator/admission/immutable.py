"""Pure immutability rules: spec fields a started job must keep, because changing them would
corrupt what is already trained.

The model's shapes and the fragment plan are baked into the syncer's checkpoint and every
learner's state, the data into each learner's position in its shard, the shard count into
which shard checkpoints which fragment, and `managedBy` into which controller owns the
children. When a job first starts (condition Created), the operator records these fields'
values in `status.startedSpec` (with the job's uid: a copy of the status on another cluster is
not this job's record). A later spec that changes one is *refused*, not failed: the job keeps
running with the started values (other changes of the same edit still apply), condition
SpecRejected/SpecImmutable names each field, and reverting the edit clears it. Before the
job starts, anything may change. With spec.data.shards unset, the shard count recorded is the
learners' at the start: a scale-up past it is refused (its learners would read other learners'
tokens; the job runs on with as many learners as shards) and a scale-down keeps it (the other
learners keep their shards). The CRD's CEL rules (crd.py) refuse most such edits at the API
server already; this is the check that holds on servers without CEL and after suspensions.
"""

from __future__ import annotations

import copy
from typing import Any

from diloco.operator.status import conditions as c
from diloco.spec import DecoupledDiLoCoJob, JobSpec

FIELD = "startedSpec"  # status.startedSpec: {"uid": ..., "fields": {path: value}}
# spec paths (camelCase, as written in manifests) -> why they cannot change.
FIELDS: dict[str, str] = {
    "managedBy": "another controller would run children this operator still owns",
    "model": "the checkpoint and every learner hold parameters of the started shapes",
    "data": "each learner's place in its shard and the held-out split would change under it",
    "syncer.fragments": "the checkpoint and the learners hold the started fragment plan",
    "syncer.fragmentation": "the checkpoint and the learners hold the started fragment plan",
    "syncer.shards": "each shard's checkpoint holds only the fragments it owns",
    "syncer.external": "a learners-only cluster and one with its own syncer own different children",
    "syncer.checkpoints.url": "the syncer restores from where its checkpoints are: anywhere else it finds none, and "
                              "training starts again from Θ₀",
}
# Where the syncer's checkpoints are, recorded even when unset ("": its volume), so that a record
# written before this rule (no key at all) is told apart from a job that started on its volume,
# and is left alone rather than read as "started with none".
LOCATION = "syncer.checkpoints.url"


def _get(tree: dict[str, Any], path: str) -> Any:
    node: Any = tree
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _prune(value: Any) -> Any:
    """Without nulls: the status is written with merge patches, where null deletes a key."""
    if isinstance(value, dict):
        return {k: _prune(v) for k, v in value.items() if v is not None}
    return value


def values(spec: JobSpec) -> dict[str, Any]:
    """The immutable fields' effective values (defaults filled in), by path; unset ones absent.
    The data's shard count too where it is unset (one shard per learner): the layout a started
    job's learners read by, so a later scale-up cannot move their shard boundaries."""
    dumped = spec.model_dump(mode="json", by_alias=True)
    dumped["data"]["shards"] = spec.shard_count
    out = {path: _prune(v) for path in FIELDS if (v := _get(dumped, path)) is not None}
    return {**out, LOCATION: out.get(LOCATION, "")}


def pinned(job: DecoupledDiLoCoJob) -> DecoupledDiLoCoJob:
    """The job with its data's shard count written out where unset (one per learner), as its
    learners read it from the first render on: recording it at the start changes nothing."""
    if job.spec.data.shards is not None:
        return job
    data = job.spec.data.model_copy(update={"shards": job.spec.shard_count})
    return job.model_copy(update={"spec": job.spec.model_copy(update={"data": data})})


def _started_shards(started_values: dict[str, Any]) -> int | None:
    """The data's shard count the job started with (None in a record older than this rule)."""
    shards = (started_values.get("data") or {}).get("shards")
    return shards if isinstance(shards, int) else None


def _layout(started_values: dict[str, Any], spec: JobSpec) -> str | None:
    """The started layout holds: more learners than it has shards would read other learners'
    tokens, so such a scale-up is refused (restore() cuts the groups back to fit)."""
    shards = _started_shards(started_values)
    if shards is None or spec.total_learners <= shards:
        return None
    why = " (spec.data.shards unset: one shard per learner then)" if spec.data.shards is None else ""
    return (f"spec.learnerGroups: {spec.total_learners} learners need {spec.total_learners} data shards, but the "
            f"job's data was split into {shards} when it started{why}, and a learner past them would read another "
            f"learner's tokens; the job runs on with {shards} learners. To scale a job up, create it with "
            "spec.data.shards set to the most learners it will have")


def started(body: dict[str, Any]) -> dict[str, Any] | None:
    """The values this job started with, or None (not started yet, or a record of another object)."""
    record = (body.get("status") or {}).get(FIELD) or {}
    if not record or record.get("uid") != body.get("metadata", {}).get("uid"):
        return None
    fields: dict[str, Any] = record.get("fields") or {}
    return fields


def record(status: dict[str, Any], new: dict[str, Any], uid: str, spec: JobSpec) -> dict[str, Any]:
    """`new` with the started values added the first time the job counts as started."""
    mine = (status.get(FIELD) or {}).get("uid") == uid
    if mine or not c.is_true(new.get("conditions") or [], c.CREATED):
        return new
    return {**new, FIELD: {"uid": uid, "fields": values(spec)}}


def _leaves(path: str, was: Any, now: Any) -> list[str]:
    """`spec.<path>.<leaf>: <now>, started with <was>` for each differing leaf."""
    if isinstance(was, dict) and isinstance(now, dict):
        return [x for k in sorted(set(was) | set(now)) for x in _leaves(f"{path}.{k}", was.get(k), now.get(k))]
    if was == now:
        return []
    return [f"spec.{path} is {_show(now)}, started with {_show(was)}"]


def _show(value: Any) -> str:
    return "unset" if value is None else repr(value)


def refused(started_values: dict[str, Any], spec: JobSpec) -> list[str]:
    """One problem per changed immutable field: what changed, why it may not, what to do."""
    now = values(spec)
    shards = _started_shards(started_values)
    if spec.data.shards is None and shards is not None:
        now["data"]["shards"] = shards  # unset: the started layout holds (_layout refuses outgrowing it)
    layout = _layout(started_values, spec)
    out = [layout] if layout else []
    for path, why in FIELDS.items():
        if path == LOCATION and path not in started_values:
            continue  # recorded before this rule
        diff = _leaves(path, started_values.get(path) or None, now.get(path) or None)
        if diff:
            out.append(f"{'; '.join(diff)}: spec.{path} cannot change once the job has started ({why}); "
                       "set it back, or create a new job")
    return out


def restore(body: dict[str, Any], started_values: dict[str, Any]) -> dict[str, Any]:
    """The body with every immutable field set back to its started value (unset if it was)."""
    out = copy.deepcopy(body)
    spec = out.setdefault("spec", {})
    for path in FIELDS:
        if path == LOCATION:
            continue
        *parents, leaf = path.split(".")
        node = spec
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        if path in started_values:
            node[leaf] = copy.deepcopy(started_values[path])
        else:
            node.pop(leaf, None)
    if (location := started_values.get(LOCATION)) is not None:  # the started store, or none (the volume)
        syncer = spec["syncer"]  # made by the loop above
        if location:
            syncer["checkpoints"] = {**(syncer.get("checkpoints") or {}), "url": location}
        else:
            syncer.pop("checkpoints", None)
    shards = _started_shards(started_values)
    if shards is not None:  # the learners fit the started layout: groups cut back in order
        for group in spec.get("learnerGroups") or []:
            if isinstance(group, dict) and isinstance(group.get("replicas", 1), int):
                group["replicas"] = min(group.get("replicas", 1), shards)
                shards -= group["replicas"]
    return out


def condition(new: dict[str, Any], status: dict[str, Any], *, problems: list[str], now: str,
              generation: int) -> dict[str, Any]:
    """`new` with SpecRejected: True naming each refused field; False once reverted (absent on
    jobs that never had a refusal)."""
    conds = list(new.get("conditions") or status.get("conditions") or [])
    if problems:
        conds = c.set_condition(conds, c.SPEC_REJECTED, True, reason="SpecImmutable", message="; ".join(problems),
                                now=now, generation=generation)
    elif c.find(conds, c.SPEC_REJECTED) is not None:
        conds = c.set_condition(conds, c.SPEC_REJECTED, False, reason="SpecAccepted", message="", now=now,
                                generation=generation)
    else:
        return new
    return {**new, "conditions": conds}


def newly_refused(status: dict[str, Any], problems: list[str]) -> bool:
    """Whether these refusals are news (post an Event), not the same ones as the last pass."""
    old = c.find(status.get("conditions") or [], c.SPEC_REJECTED) or {}
    return bool(problems) and (old.get("status") != "True" or old.get("message") != "; ".join(problems))
