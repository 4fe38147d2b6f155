"""The job as a pass reads it: its spec parsed and checked, and, for a started job whose edit
changes an immutable field, the spec it started with (operator/admission/immutable.py). Pure.
"""

from __future__ import annotations

from typing import Any

from diloco.operator.admission import checks as spec_checks
from diloco.operator.admission import immutable
from diloco.spec import DecoupledDiLoCoJob, SpecError, parse_job


def load(body: dict[str, Any]) -> tuple[DecoupledDiLoCoJob | None, list[str]]:
    """The validated job, or the problems (each naming its field path)."""
    meta = body.get("metadata", {})
    try:
        # Labels and annotations too: Kueue's (operator/kueue/integration.py) are read from the job's.
        job = parse_job({"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
                         "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"),
                                      "labels": meta.get("labels") or {}, "annotations": meta.get("annotations") or {}},
                         "spec": body.get("spec")})
    except SpecError as exc:
        return None, exc.problems
    problems = spec_checks.spec_problems(job)
    return (None, problems) if problems else (job, [])


def effective(body: dict[str, Any]) -> tuple[DecoupledDiLoCoJob | None, list[str], list[str]]:
    """(the job to run, its problems, the refused changes): a started job whose edit changes an
    immutable field runs on with the values it started with (operator/admission/immutable.py)."""
    job, problems = load(body)
    was = immutable.started(body)
    if job is None or was is None:
        return (immutable.pinned(job) if job is not None else None), problems, []
    # Compared as this operator reads the record: a field added since it was written has its default.
    kept, kept_problems = load(immutable.restore(body, was))
    refused = immutable.refused(immutable.values(kept.spec) if kept else was, job.spec)
    if refused:
        return kept, refused + kept_problems if kept_problems else [], refused
    # Nothing refused: the same spec, with the data's started shard count pinned where it is unset.
    return (kept, [], []) if kept is not None else (job, problems, [])
