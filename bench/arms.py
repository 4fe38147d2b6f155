"""The in-process arms of the side-by-side benchmarks: what the product is compared against.

    python bench/arms.py inproc {dp,sync,plain,replay} --manifest JSON [--options JSON]   # internal

* data-parallel (one process, global batch M x B, one AdamW step per global batch);
* synchronous DiLoCo (M learners simulated one after another in one process: the same math as
  lock-step, timed as the slowest learner per round plus the sync);
* a plain loop (one learner's compute without a syncer), and a real lock-step synchronous DiLoCo
  with one process per learner (throughput under stragglers, heterogeneous.py).

Each runs in a fresh process pinned to one core (`inproc`), so two can run side by side. Every
arm uses the job's model, held-out windows, per-learner shards and AdamW schedule (bench/common.py
builds the manifests).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from common import JAX_CACHE

from diloco.launch import learner_runtime


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
        # The learners' own data path (trainer/data/__init__.py Batches): each window once per epoch, in a
        # seeded order, batch k of learner i a function of (seed, i, k), so every arm sees the
        # same batches in the same order and only the algorithm differs.
        self.batches = [data.Batches(s, self.tr.batch_size, self.window, seed=spec.data.seed, shard_index=i)
                        for i, s in enumerate(self.shards)]
        self.taken = [0] * learners
        self.evals = data.eval_batches(held_out, batches=self.tr.eval_batches, batch=self.tr.batch_size, length=self.window)
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


def _slowed_step(s: _Setup, params: Any, opt: Any, learner: int, n: int, slowdown: float) -> tuple[Any, Any]:
    """Step n of `learner` on its shard, stretched by its group's slowdown exactly as the learner
    stretches it (sleep compute x (slowdown - 1))."""
    c0 = time.monotonic()
    params, opt, loss = s.recipe.step(params, opt, s.batch(learner), n)
    float(loss)
    if slowdown > 1:
        time.sleep((time.monotonic() - c0) * (slowdown - 1))
    return params, opt


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
        params, opt = _slowed_step(s, params, opt, shard, n + 1, slowdown)
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
            params, opt = _slowed_step(s, params, opt, rank, steps + 1, slowdown)
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
        from replay_arm import replay_arm

        print(json.dumps(replay_arm(m, **kw)), flush=True)
        return
    fn = {"dp": data_parallel, "sync": sync_diloco, "plain": plain_loop}[args.kind]
    print(json.dumps(fn(m, **kw)), flush=True)


if __name__ == "__main__":
    _main()
