"""The end of a local run: evaluate the global model, write summary.json and the plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from diloco.apps.local.tracker import RunTracker
from diloco.checkpoint import CheckpointStore, params_of
from diloco.shards import checkpoint_dir
from diloco.spec import DecoupledDiLoCoJob


def evaluate(job: DecoupledDiLoCoJob, params: dict[str, np.ndarray]) -> float:
    """Held-out loss (nats per token) on the same fixed windows the learners use."""
    from diloco.trainer import data
    from diloco.trainer.recipe import Recipe

    spec, window = job.spec, job.spec.model.context + 1
    # The first group's copy (spec/copies.py): every copy holds the same files, checked before the run.
    held_out = data.load(spec.data_for(spec.learner_groups[0].name), spec.model.vocab_size, window).held_out
    batches = data.eval_batches(held_out, batches=spec.training.eval_batches, batch=spec.training.batch_size, length=window)
    recipe = Recipe(spec.model, spec.training)  # the learners' own eval
    return recipe.eval_loss(recipe.place(params), batches)


def held_out_loss(job: DecoupledDiLoCoJob, params: dict[str, np.ndarray]) -> tuple[float, str | None]:
    """`evaluate`, or NaN and why when the held-out data cannot be read: a run the learners ended
    on bad data (their fatal line says so) still writes its summary (`held_out_unread`), never a
    traceback."""
    try:
        return evaluate(job, params), None
    except (ValueError, OSError) as exc:  # records.DataError among them
        return math.nan, str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def global_params(job: DecoupledDiLoCoJob, out: Path) -> tuple[dict[str, np.ndarray] | None, list[str]]:
    """Θ from the final checkpoints (each shard's holds the fragments it owns), and their paths
    relative to `out` (`diloco export` names the held-out loss in its model card when it exports
    these very checkpoints: apps/export.py)."""
    shards, merged, paths = job.spec.syncer.shards, {}, []
    for s in range(shards):
        loaded, _ = CheckpointStore(checkpoint_dir(str(out / "checkpoints"), s, shards)).load_latest()
        if loaded is None:
            return None, []
        merged.update(params_of(loaded.arrays))
        path = Path(loaded.path)
        paths.append(str(path.relative_to(out)) if path.is_relative_to(out) else str(path.resolve()))
    return merged, paths


def write_report(job: DecoupledDiLoCoJob, out: Path, tracker: RunTracker, wall: float,
                 failure: str | None = None) -> dict[str, Any]:
    from diloco.trainer.caches.theta0 import initial_params

    initial, unread = held_out_loss(job, initial_params(job.spec.model, job.spec.data.seed, None))  # Θ₀: fresh or pretrained
    final_params, final_checkpoints = global_params(job, out)
    final = held_out_loss(job, final_params)[0] if final_params is not None and unread is None else math.nan
    sent, received = tracker.bytes()
    learner_kills = sum(1 for _, target in tracker.kills if target in tracker.slots)
    summary: dict[str, Any] = {
        "job": job.metadata.name,
        "learners": len(tracker.slots),
        "initial_eval_loss": initial,
        "final_eval_loss": final,
        "tokens_trained": tracker.tokens_trained,
        "tokens_merged": tracker.tokens_merged,
        "outer_versions": tracker.outer_versions,
        "outer_steps": tracker.outer_steps,
        "learner_kills": learner_kills,
        "syncer_kills": sum(1 for _, target in tracker.kills if target == "syncer"),
        "readmissions": tracker.readmissions(),
        "goodput": round(tracker.goodput(wall), 4),
        "availability": round(tracker.availability(wall), 4),
        "badput": tracker.badput(wall, job.spec.tokens_per_step),
        "learner_seconds": tracker.accounting(wall),
        "bytes_sent": sent,
        "bytes_received": received,
        "contributions_refused": tracker.refused,
        "contributions_refused_by_outcome": tracker.refused_by,
        "max_push_norm_ratio": round(tracker.max_norm_ratio, 3),
        "max_push_steps_ratio": round(tracker.max_steps_ratio, 3),
        "max_publish_gap_seconds": tracker.max_publish_gap,
        "wall_seconds": wall,
        "tokens_per_second": tracker.tokens_trained / wall if wall > 0 else 0.0,
        "merged_tokens_per_second": tracker.tokens_merged / wall if wall > 0 else 0.0,
    }
    if final_checkpoints:
        summary["final_checkpoints"] = final_checkpoints
    if unread is not None:
        summary["held_out_unread"] = unread
    if failure:
        summary["failure"] = failure
    if final_params is not None:  # what the model learned, at a glance; never fails the run
        from diloco.apps.sample import summary_sample

        if (sample := summary_sample(job.spec.model, job.spec.data.source, final_params)) is not None:
            summary["sample"] = sample
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(tracker, out, initial)
    return summary


def plot(tracker: RunTracker, out: Path, initial: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in tracker.slots:
        pts = [(tracker.tokens_at(t), loss) for t, n, loss in tracker.evals if n == name]
        if pts:
            ax.plot(*zip(*pts), marker=".", lw=1, label=name)
    if not math.isnan(initial):
        ax.axhline(initial, color="grey", ls="--", lw=1, label="initial model")
    ax.set_xlabel("tokens merged by the syncer")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_title("Eval loss against tokens")
    if ax.get_legend_handles_labels()[0]:  # a run that never evaluated has no curve to name
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "eval_loss.png", dpi=110)
    plt.close(fig)

    t0 = min([inc.joined_at for s in tracker.slots.values() for inc in s.incarnations] + [t for t, _ in tracker.kills] or [0.0])
    t_end = max([t for t, _, _ in tracker.status] + [t0])
    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.45 * len(tracker.slots)))
    colors = {"up": "tab:green", "down": "tab:red"}
    for row, slot in enumerate(tracker.slots.values()):
        spans = list(slot.intervals)
        if slot.up and slot.incarnations:
            spans.append((slot.incarnations[-1].joined_at, t_end, "up"))
        for start, end, state in spans:
            ax.barh(row, end - start, left=start - t0, color=colors[state], height=0.6)
        for inc in slot.incarnations:
            if inc.restart > 0:
                ax.plot(inc.joined_at - t0, row, marker="^", color="black", ms=6)
    ax.set_yticks(range(len(tracker.slots)), list(tracker.slots))
    ax.set_xlabel("seconds (green up, red down, ▲ re-admitted)")
    ax.set_title("Learner timeline")
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=110)
    plt.close(fig)
