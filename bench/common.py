"""Shared helpers for the side-by-side benchmarks (quality, bandwidth, heterogeneous, scavenging).

Two kinds of arms:

* **Real jobs** (`run_job`): the product itself, `diloco run`'s `LocalRun` (one syncer process,
  one pinned learner process per replica, gRPC on loopback, chaos as the manifest says), stopped
  when the learners have *trained* a fixed number of steps in total. The runner's own
  `tokenBudget` counts tokens the syncer merged, which is not the same thing (see
  docs/BENCHMARKS.md), so the bench counts the learners' steps from their progress events.
* **In-process arms** (`python bench/common.py inproc ...`): data-parallel (one process, global
  batch M x B, one AdamW step per global batch) and synchronous DiLoCo (M learners simulated one
  after another in one process: same math as lock-step, timed as the slowest learner per round
  plus the sync). Each runs in its own process pinned to one core, so two can run side by side.

Every arm uses the same model, the same held-out windows (`data.eval_batches` with the job's
`evalBatches`), the same per-learner shards and the same AdamW schedule.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco.launch import learner_runtime
from diloco.testing.relay import FaultProxy

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
    from diloco.local.runner import LocalRun
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


# -- in-process arms ---------------------------------------------------------------------------------


def inproc(kind: str, m: dict[str, Any], cpu: int | None, **kw: Any) -> dict[str, Any]:
    """Run an in-process arm in a fresh process pinned to `cpu`; returns its JSON result."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "inproc", kind, "--manifest", json.dumps(m),
           "--options", json.dumps(kw)]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(JAX_CACHE), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"in-process arm {kind} failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def inproc_async(kind: str, m: dict[str, Any], cpu: int | None, **kw: Any) -> Any:
    """Start `inproc` on a thread; call .result() to wait (two arms side by side on two cores)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = inproc(kind, m, cpu, **kw)
        except Exception as exc:
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()

    class Handle:
        def result(self) -> dict[str, Any]:
            t.join()
            if "error" in box:
                raise box["error"]
            return box["value"]

    return Handle()


class _Setup:
    """Model, shards, eval windows and AdamW for the in-process arms (imports JAX)."""

    def __init__(self, m: dict[str, Any], learners: int):
        import jax
        import jax.numpy as jnp
        import numpy as np

        from diloco.spec import parse_job
        from diloco.trainer import data, model
        from diloco.trainer.recipe import Recipe

        self.jax, self.jnp, self.np, self.data = jax, jnp, np, data
        spec = parse_job(m).spec
        self.spec, self.cfg, self.tr = spec, spec.model, spec.training
        train, held_out = data.split(data.corpus_bytes(), spec.data.held_out_fraction)
        # The same shards the job's learners get: learner i of M has the i-th slice.
        self.shards = [data.shard(train, i, learners, spec.data.sharding) for i in range(learners)]
        self.window = spec.model.context + 1
        # The learners' own data path (trainer/data.py Batches): each window once per epoch, in a
        # seeded order, batch k of learner i a function of (seed, i, k), so every arm sees the
        # same batches in the same order and only the algorithm differs.
        self.batches = [data.Batches(s, self.tr.batch_size, self.window, spec.data.seed, i)
                        for i, s in enumerate(self.shards)]
        self.taken = [0] * learners
        self.evals = data.eval_batches(held_out, self.tr.eval_batches, self.tr.batch_size, self.window)
        self.recipe = Recipe(self.cfg, self.tr)  # the learner's own step, schedule and eval
        self.params0 = self.recipe.place(model.init_params(self.cfg, spec.data.seed))

    def eval_loss(self, params: Any) -> float:
        return self.recipe.eval_loss(params, self.evals)

    def batch(self, i: int) -> Any:
        """Learner i's next batch."""
        self.taken[i] += 1
        return self.batches[i].batch(self.taken[i] - 1)


def data_parallel(m: dict[str, Any], learners: int, steps: int, eval_every: int = 50) -> dict[str, Any]:
    """One process, global batch = M local batches (one from each learner's shard): exactly what
    synchronous data-parallel over M workers computes. `steps` global steps."""
    s = _Setup(m, learners)
    np = s.np
    params = s.params0
    opt = s.recipe.init_state(params)
    warm = np.concatenate([s.data.sample_batch(s.shards[i], s.tr.batch_size, s.window, np.random.default_rng(99))
                           for i in range(learners)])
    s.jax.block_until_ready(s.recipe.step(params, opt, warm, 0))  # compile outside the timed loop
    initial = s.eval_loss(params)
    tps = s.tr.batch_size * s.cfg.context * learners
    curve = [(0, initial)]
    compute = 0.0
    t0 = time.monotonic()
    for step in range(1, steps + 1):
        batch = np.concatenate([s.batch(i) for i in range(learners)])
        c0 = time.monotonic()
        params, opt, loss = s.recipe.step(params, opt, batch, step - 1)
        float(loss)
        compute += time.monotonic() - c0
        if step % eval_every == 0 or step == steps:
            curve.append((step * tps, s.eval_loss(params)))
    wall = time.monotonic() - t0
    return {"arm": "data-parallel", "final_eval_loss": curve[-1][1], "initial_eval_loss": initial,
            "tokens": steps * tps, "wall_seconds": wall, "compute_seconds": compute,
            "tokens_per_second": steps * tps / compute, "curve": curve}


def sync_diloco(m: dict[str, Any], learners: int, steps: int, inner_steps: int, outer_lr: float,
                outer_momentum: float) -> dict[str, Any]:
    """Synchronous DiLoCo: M learners in lock-step, each `inner_steps` AdamW steps on its own shard,
    then the plain average outer gradient Δ = mean(Θ − θ_m) and one Nesterov step on the full model;
    every learner restarts from Θ and keeps its AdamW state. Simulated one learner after another in
    this process; wall time counts each round as its slowest learner plus the sync."""
    from diloco.core.outer import NesterovSGD

    s = _Setup(m, learners)
    np, jnp = s.np, s.jnp
    glob = {k: np.array(v, dtype=np.float32) for k, v in s.params0.items()}
    outer = NesterovSGD(outer_lr, outer_momentum)
    opts = [s.recipe.init_state(s.params0) for _ in range(learners)]
    warm = s.data.sample_batch(s.shards[0], s.tr.batch_size, s.window, np.random.default_rng(99))
    s.jax.block_until_ready(s.recipe.step(s.params0, opts[0], warm, 0))
    initial = s.eval_loss(s.params0)
    tps = s.tr.batch_size * s.cfg.context
    curve = [(0, initial)]
    lockstep, sync_total, done = 0.0, 0.0, 0
    t0 = time.monotonic()
    while done < steps:
        h = min(inner_steps, steps - done)
        locals_, times = [], []
        for i in range(learners):
            params = {k: jnp.asarray(v) for k, v in glob.items()}
            c0 = time.monotonic()
            for j in range(h):
                params, opts[i], loss = s.recipe.step(params, opts[i], s.batch(i), done + j)
                float(loss)
            times.append(time.monotonic() - c0)
            locals_.append(params)
        c0 = time.monotonic()
        host = [{k: np.asarray(v) for k, v in p.items()} for p in locals_]
        delta = {k: np.mean([glob[k] - p[k] for p in host], axis=0) for k in glob}
        glob = outer.step(glob, delta)
        sync = time.monotonic() - c0
        lockstep += max(times) + sync
        sync_total += sync
        done += h
        curve.append((done * tps * learners, s.eval_loss({k: jnp.asarray(v) for k, v in glob.items()})))
    wall = time.monotonic() - t0
    tokens = steps * tps * learners
    return {"arm": "sync-diloco", "final_eval_loss": curve[-1][1], "initial_eval_loss": initial, "tokens": tokens,
            "wall_seconds": wall, "lockstep_seconds": lockstep, "sync_seconds": sync_total,
            "tokens_per_second": tokens / lockstep, "inner_steps": inner_steps, "outer_lr": outer_lr,
            "outer_momentum": outer_momentum, "curve": curve}


def plain_loop(m: dict[str, Any], seconds: float, slowdown: float, shard: int, learners: int) -> dict[str, Any]:
    """A learner's compute without any syncer: AdamW steps on its shard, each stretched by the
    group's slowdown exactly as the learner stretches it (sleep compute x (slowdown - 1))."""
    s = _Setup(m, learners)
    params = s.params0
    opt = s.recipe.init_state(params)
    params, opt, loss = s.recipe.step(params, opt, s.batch(shard), 0)
    float(loss)
    n, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        c0 = time.monotonic()
        params, opt, loss = s.recipe.step(params, opt, s.batch(shard), n + 1)
        float(loss)
        if slowdown > 1:
            time.sleep((time.monotonic() - c0) * (slowdown - 1))
        n += 1
    wall = time.monotonic() - t0
    tps = s.tr.batch_size * s.cfg.context
    return {"steps": n, "seconds": wall, "steps_per_second": n / wall, "tokens_per_second": n * tps / wall}


def lockstep_worker(rank: int, m: dict[str, Any], learners: int, inner_steps: int, seconds: float,
                    slowdown: float, cpu: int, barrier: Any, locals_buf: Any, global_buf: Any, stop: Any,
                    results: Any) -> None:
    """One learner of a real lock-step synchronous DiLoCo (multiprocessing, spawn): H inner steps,
    write θ_m, barrier; rank 0 averages Δ and takes the Nesterov step; barrier; everyone adopts Θ.
    Used for throughput (heterogeneous.py): the fast learners wait for the slowest every round."""
    os.sched_setaffinity(0, {cpu})
    learner_runtime()  # the learner's allocator and XLA settings, so the two schemes compare fairly
    s = _Setup(m, learners)
    np, jnp = s.np, s.jnp
    from diloco.core.outer import NesterovSGD

    names = sorted(s.params0)
    shapes = {k: tuple(s.params0[k].shape) for k in names}
    sizes = [int(np.prod(shapes[k])) for k in names]
    n = sum(sizes)
    glob = np.frombuffer(global_buf, dtype=np.float32, count=n)
    local = np.frombuffer(locals_buf, dtype=np.float32, count=n * learners).reshape(learners, n)
    if rank == 0:
        glob[:] = np.concatenate([np.asarray(s.params0[k]).reshape(-1) for k in names])
    outer = NesterovSGD(0.7, 0.9)
    opt = s.recipe.init_state(s.params0)
    params, opt, loss = s.recipe.step(s.params0, opt, s.batch(rank), 0)
    float(loss)

    def unflat(flat: Any) -> dict[str, Any]:
        out, off = {}, 0
        for k, size in zip(names, sizes):
            out[k] = jnp.asarray(flat[off:off + size].reshape(shapes[k]))
            off += size
        return out

    barrier.wait()  # everyone has compiled
    steps, rounds, busy, t0 = 0, 0, 0.0, time.monotonic()
    while True:
        params = unflat(glob.copy())
        b0 = time.monotonic()
        for _ in range(inner_steps):
            c0 = time.monotonic()
            params, opt, loss = s.recipe.step(params, opt, s.batch(rank), steps + 1)
            float(loss)
            if slowdown > 1:
                time.sleep((time.monotonic() - c0) * (slowdown - 1))
            steps += 1
        busy += time.monotonic() - b0
        local[rank] = np.concatenate([np.asarray(params[k]).reshape(-1) for k in names])
        barrier.wait()
        if rank == 0:
            new = outer.step({"all": glob}, {"all": glob - local.mean(axis=0)})["all"]
            glob[:] = new
            stop.value = int(time.monotonic() - t0 >= seconds)
        barrier.wait()
        rounds += 1
        if stop.value:
            break
    results.put({"rank": rank, "steps": steps, "rounds": rounds, "seconds": time.monotonic() - t0, "busy": busy})


def lockstep(m: dict[str, Any], slowdowns: list[float], inner_steps: int, seconds: float) -> list[dict[str, Any]]:
    """Run lock-step synchronous DiLoCo with one process per learner (learner i on core i % ncpu)."""
    import multiprocessing as mp

    import jax

    from diloco.spec import parse_job
    from diloco.trainer import model

    ctx = mp.get_context("spawn")
    spec = parse_job(m).spec
    n = int(sum(int(v.size) for v in jax.eval_shape(lambda: model.init_params(spec.model, 0)).values()))
    learners = len(slowdowns)
    ncpu = len(os.sched_getaffinity(0))
    barrier = ctx.Barrier(learners)
    locals_buf = ctx.RawArray("f", n * learners)
    global_buf = ctx.RawArray("f", n)
    stop = ctx.RawValue("i", 0)
    results = ctx.Queue()
    env_before = dict(os.environ)
    os.environ.update(JAX_COMPILATION_CACHE_DIR=str(JAX_CACHE), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    try:
        procs = [ctx.Process(target=lockstep_worker, args=(i, m, learners, inner_steps, seconds, slowdowns[i],
                                                           i % ncpu, barrier, locals_buf, global_buf, stop, results))
                 for i in range(learners)]
        for p in procs:
            p.start()
        out = [results.get(timeout=seconds + 300) for _ in procs]
        for p in procs:
            p.join(30)
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    return sorted(out, key=lambda r: r["rank"])


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


def machine() -> dict[str, Any]:
    load = os.getloadavg()
    return {"cpus": len(os.sched_getaffinity(0)), "loadavg_1m_at_start": round(load[0], 2)}


def deep(m: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(m)


def _main() -> None:
    learner_runtime()  # before JAX, as the learner does: plain loops then run as fast as its steps
    parser = argparse.ArgumentParser(description="internal: run one in-process arm and print its JSON")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("inproc")
    p.add_argument("kind", choices=["dp", "sync", "plain", "replay"])
    p.add_argument("--manifest", required=True)
    p.add_argument("--options", default="{}")
    args = parser.parse_args()
    m, kw = json.loads(args.manifest), json.loads(args.options)
    if args.kind == "replay":
        from replay import replay_arm

        print(json.dumps(replay_arm(m, **kw)), flush=True)
        return
    fn = {"dp": data_parallel, "sync": sync_diloco, "plain": plain_loop}[args.kind]
    print(json.dumps(fn(m, **kw)), flush=True)


if __name__ == "__main__":
    _main()
