"""Shared helpers for the side-by-side benchmarks (quality, bandwidth, heterogeneous, scavenging).

Two kinds of arms:

* **Real jobs** (`run_job`): the product itself, `diloco run`'s `LocalRun` (one syncer process,
  one pinned learner process per replica, gRPC on loopback, chaos as the manifest says), stopped
  when the learners have *trained* a fixed number of steps in total. The runner's own
  `tokenBudget` counts tokens the syncer merged, which is not the same thing (see
  docs/BENCHMARKS.md), so the bench counts the learners' steps from their progress events.
* **In-process arms** (bench/arms.py): data-parallel, synchronous DiLoCo, a plain loop and a
  real lock-step synchronous DiLoCo, each in a fresh process pinned to a core.

Every arm uses the same model, the same held-out windows (`data.eval_batches` with the job's
`evalBatches`), the same per-learner shards and the same AdamW schedule.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco.apps.testkit.relay import FaultProxy

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "runs" / "bench"
IMG = ROOT / "docs" / "img"
JAX_CACHE = RUNS / "jax-cache"  # shared by every arm: restarts and later arms skip compiling

# The bench model: the quickstart's (2 layers, d_model 128, context 128, batch 8; 0.48M parameters).
MODEL = {"layers": 2, "dModel": 128, "heads": 4, "context": 128}
# --smoke modes: a tiny model so that every bench script runs end to end in seconds.
SMOKE = {"model": {"layers": 1, "dModel": 32, "heads": 2, "context": 32}, "batchSize": 4}
_smoke = False


def use_smoke_model() -> None:
    global _smoke
    _smoke = True
    RUNS.joinpath("smoke").mkdir(parents=True, exist_ok=True)


def manifest(name: str, *, steps_per_learner: int, groups: list[dict[str, Any]] | None = None,
             syncer: dict[str, Any] | None = None, training: dict[str, Any] | None = None,
             model: dict[str, Any] | None = None, chaos: dict[str, Any] | None = None,
             seed: int = 0) -> dict[str, Any]:
    """A DecoupledDiLoCoJob for the benches. The cosine decay spans one learner's share of the
    token budget, which is also the data-parallel baseline's number of (M-times larger) steps."""
    tr = {"batchSize": 8, "learningRate": 0.003, "warmupSteps": 50, "decaySteps": max(steps_per_learner, 51),
          "evalIntervalSteps": 100, "evalBatches": 16}
    sy = {"quorum": 1, "fragments": 4, "fragmentation": "balanced", "compression": "int4", "merge": "rda",
          "tokenWeighting": True, "checkpointIntervalSeconds": 10}  # the outer step: the product's defaults
    m = {
        "apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": name},
        "spec": {
            "learnerGroups": groups or [{"name": "local", "replicas": 4}],
            "syncer": {**sy, **(syncer or {})},
            "model": {**MODEL, **(model or {})},
            "data": {"seed": seed},
            "training": {**tr, **(training or {})},
        },
    }
    if chaos:
        m["spec"]["chaos"] = {"enabled": True, **chaos}
    if _smoke:
        m["spec"]["model"] = {**m["spec"]["model"], **SMOKE["model"]}
        m["spec"]["training"]["batchSize"] = SMOKE["batchSize"]
    return m


def learners_of(m: dict[str, Any]) -> int:
    return sum(int(g.get("replicas", 1)) for g in m["spec"]["learnerGroups"])


def tokens_per_step(m: dict[str, Any]) -> int:
    sp = m["spec"]
    return int(sp["training"]["batchSize"]) * int(sp["model"]["context"])


# -- real jobs -------------------------------------------------------------------------------------


class _QuietView:
    def update(self, *_: Any) -> None:
        pass


@dataclass
class JobResult:
    name: str
    summary: dict[str, Any]
    events: list[dict[str, Any]]
    trained_steps: int
    trained_tokens: int
    train_seconds: float  # first learner joined -> stop
    curve: list[tuple[float, float]] = field(default_factory=list)  # (tokens trained, eval loss)
    wire: dict[str, tuple[int, int]] = field(default_factory=dict)  # learner -> (bytes up, bytes down)
    late_start: float | None = None  # when held-back learners were started (epoch seconds)

    @property
    def tokens_per_second(self) -> float:
        return self.trained_tokens / self.train_seconds if self.train_seconds > 0 else 0.0


def trained_steps(events: list[dict[str, Any]]) -> tuple[int, list[tuple[float, int]]]:
    """Steps the learners trained (every incarnation counts, also work a kill threw away), and the
    running total over time. Steps are per incarnation; progress/exit events carry the latest."""
    latest: dict[tuple[str, int], int] = {}
    restart: dict[str, int] = {}
    timeline: list[tuple[float, int]] = []
    total = 0
    for e in events:
        src, kind = e.get("source"), e.get("event")
        if kind == "joined":
            restart[src] = int(e.get("restart", 0))
        elif kind in ("progress", "exit", "eval") and src in restart:
            key = (src, restart[src])
            step = int(e.get("step", 0))
            if step > latest.get(key, 0):
                total += step - latest.get(key, 0)
                latest[key] = step
                timeline.append((float(e["t"]), total))
    return total, timeline


def learner_rates(events: list[dict[str, Any]], t_a: float, t_b: float) -> dict[str, float]:
    """Steps per second of each learner slot between t_a and t_b, from its progress events
    (linear between events; an incarnation contributes only while it was up)."""
    series: dict[tuple[str, int], list[tuple[float, int]]] = {}
    restart: dict[str, int] = {}
    for e in events:
        src, kind = e.get("source"), e.get("event")
        if kind == "joined":
            restart[src] = int(e.get("restart", 0))
            series.setdefault((src, restart[src]), []).append((float(e["t"]), 0))
        elif kind in ("progress", "exit") and src in restart:
            series.setdefault((src, restart[src]), []).append((float(e["t"]), int(e.get("step", 0))))

    def at(points: list[tuple[float, int]], t: float) -> float:
        if t <= points[0][0]:
            return float(points[0][1])
        for (t0, s0), (t1, s1) in itertools.pairwise(points):
            if t0 <= t <= t1:
                return s0 + (s1 - s0) * (t - t0) / (t1 - t0) if t1 > t0 else float(s1)
        return float(points[-1][1])

    rates: dict[str, float] = {}
    if t_b <= t_a:
        return rates
    for (src, _), points in series.items():
        rates[src] = rates.get(src, 0.0) + (at(points, t_b) - at(points, t_a)) / (t_b - t_a)
    return rates


def eval_curve(events: list[dict[str, Any]], tps: int) -> list[tuple[float, float]]:
    """(tokens trained by all learners so far, mean of the latest eval losses of the learners up)."""
    latest: dict[tuple[str, int], int] = {}
    restart: dict[str, int] = {}
    last_eval: dict[str, float] = {}
    total = 0
    curve: list[tuple[float, float]] = []
    for e in events:
        src, kind = e.get("source"), e.get("event")
        if kind == "joined":
            restart[src] = int(e.get("restart", 0))
        elif src in restart and kind in ("progress", "exit", "eval"):
            key = (src, restart[src])
            step = int(e.get("step", 0))
            if step > latest.get(key, 0):
                total += step - latest.get(key, 0)
                latest[key] = step
            if kind == "eval":
                last_eval[src] = float(e["eval_loss"])
                curve.append((total * tps, sum(last_eval.values()) / len(last_eval)))
    return curve


def fresh_run_dir(out: Path) -> None:
    """A bench run starts from nothing: no events, summary or checkpoints of an earlier run in
    `out` (the product's runner would resume the job from its checkpoints)."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("events.jsonl", "summary.json"):
        (out / stale).unlink(missing_ok=True)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)


def run_job(m: dict[str, Any], out: Path, *, total_steps: int | None, max_seconds: float,
            late: dict[str, Any] | None = None, proxies: bool = False,
            seconds_after_join: float | None = None) -> JobResult:
    """Run the manifest with the product's local runner; stop once the learners have trained
    `total_steps` steps in total (or after max_seconds). `late`: {"group": name, "after_seconds": s}
    holds that group's learners back until s seconds after the first join (compute scavenging);
    with "min_seconds_joined": t the run also waits until each of them has been joined t seconds,
    so a slow machine's late start still leaves an after-phase to measure.
    `proxies`: route every learner's connection through a byte-counting relay.
    `seconds_after_join`: stop that long after the first learner joined."""
    from diloco.apps.local.runner import LocalRun
    from diloco.spec import parse_job

    job = parse_job(m)
    fresh_run_dir(out)

    class BudgetRun(LocalRun):
        def __init__(self) -> None:
            super().__init__(job, out, max_seconds)
            JAX_CACHE.mkdir(parents=True, exist_ok=True)
            self.sup.env["JAX_COMPILATION_CACHE_DIR"] = str(JAX_CACHE)
            self.held: dict[str, Any] = {}
            if late:
                prefix = f"{late['group']}-"
                for name in [n for n in self.sup.children if n.startswith(prefix)]:
                    self.held[name] = self.sup.children.pop(name)
            self.seen: list[dict[str, Any]] = []
            self.steps = 0
            self.joined_at: float | None = None
            self.late_start: float | None = None
            self.late_joins: dict[str, float] = {}
            self.proxies: dict[str, FaultProxy] = {}
            if proxies:
                for name, child in list(self.sup.children.items()) + list(self.held.items()):
                    if child.kind == "learner":
                        proxy = self.proxies[name] = FaultProxy(self.ports[0]).start()  # one syncer shard
                        i = child.argv.index("--syncer")
                        child.argv[i + 1] = f"127.0.0.1:{proxy.port}"

        def record(self, event: dict[str, Any]) -> None:
            super().record(event)
            self.seen.append(event)
            if event.get("event") == "joined" and self.joined_at is None:
                self.joined_at = float(event["t"])
            if late and event.get("event") == "joined" and str(event.get("source", "")).startswith(f"{late['group']}-"):
                self.late_joins.setdefault(str(event["source"]), float(event["t"]))
            if event.get("event") in ("progress", "exit", "eval"):
                self.steps, _ = trained_steps(self.seen)
                if total_steps and self.steps >= total_steps:
                    self.stopping = True
            if (seconds_after_join and self.joined_at is not None
                    and float(event.get("t", 0)) - self.joined_at >= seconds_after_join
                    and self.late_phase_done(float(event.get("t", 0)))):
                self.stopping = True
            if (self.held and late and self.joined_at is not None
                    and float(event.get("t", 0)) - self.joined_at >= late["after_seconds"]):
                held, self.held = self.held, {}
                self.late_start = time.time()
                for name, child in held.items():
                    self.sup.children[name] = child
                    self.sup.start(name)
                    self.runner_event("late_start", target=name, trained_steps=self.steps)

        def late_phase_done(self, t: float) -> bool:
            """Every held-back learner has been joined for late["min_seconds_joined"] seconds."""
            need = late.get("min_seconds_joined") if late else None
            if not need:
                return True
            expected = sum(1 for c in self.sup.children if c.startswith(f"{late['group']}-")) if late else 0
            return (not self.held and len(self.late_joins) >= expected
                    and all(t - j >= need for j in self.late_joins.values()))

    run = BudgetRun()
    try:
        run.run(_QuietView())
    finally:
        for proxy in run.proxies.values():
            proxy.close()
    wall_end = time.time()
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines() if line.strip()]
    steps, _ = trained_steps(events)
    summary = json.loads((out / "summary.json").read_text())
    stop_t = max((float(e["t"]) for e in events if e.get("event") == "stop"), default=wall_end)
    joined = run.joined_at or stop_t
    tps = tokens_per_step(m)
    wire = {n: (p.stats.upstream_bytes, p.stats.downstream_bytes) for n, p in run.proxies.items()}
    return JobResult(m["metadata"]["name"], summary, events, steps, steps * tps, max(stop_t - joined, 1e-9),
                     eval_curve(events, tps), wire, run.late_start)


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """Plain-text table; columns are (key, header, format)."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append([("-" if r.get(k) is None else format(r[k], f)) if f else str(r.get(k, "-"))
                      for k, _, f in columns])
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c[i].rjust(widths[i]) if i else c[i].ljust(widths[i]) for i in range(len(columns)))
             for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def emit(result: dict[str, Any]) -> None:
    """The last line of every bench: one JSON object."""
    print(json.dumps(result, sort_keys=True), flush=True)


def save_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")


def save_figure(fig: Any, path: Path) -> None:
    """Write a bench's plot (docs/img) and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> dict[str, Any]:
    load = os.getloadavg()
    return {"cpus": len(os.sched_getaffinity(0)), "loadavg_1m_at_start": round(load[0], 2)}


def deep(m: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(m)
