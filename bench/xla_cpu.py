"""What a learner's XLA:CPU flags (diloco/launch.py, XLA_CPU_FLAGS) cost and save, side by side.

    python bench/xla_cpu.py [--config examples/quickstart.yaml] [--model '{"preset": "llama-tiny"}']
                            [--rounds 4] [--steps 40] [--smoke]

A restarted learner loads its train step from the persistent compilation cache, then runs its
first step; with XLA's default, every dot that XLA hands to YNNPACK builds its runtime during
that first execution, in every new process. Each round starts one fresh process per setting
(XLA's default, then the learner's flags; the first round of each fills its cache and is not
counted), all on core 0, and measures what a restart pays: the CPU to build the recipe (reading
its exported programs, trainer/caches/step_cache.py), place Θ, initialise AdamW and dispatch the first
step (lowering it and loading the executable from the compilation cache), and the CPU of that
step's execution; then the steady step, as wall time
per step over `--steps` steps. Last line: JSON with the medians per setting and
`first_step_cpu_ratio`, `restart_cpu_ratio` and `steady_step_ratio` (learner flags ÷ default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, time
os.sched_setaffinity(0, {0})
from diloco.launch import keep_freed_memory, xla_cpu_flags
keep_freed_memory()
if sys.argv[3] == "learner":
    xla_cpu_flags()
import jax, numpy as np
from diloco.spec import load_job
from diloco.trainer import data, model, sharding
from diloco.trainer.recipe import Recipe
job = load_job(sys.argv[1]); cfg, tr = job.spec.model, job.spec.training
if sys.argv[2]:
    cfg = cfg.model_validate({**cfg.model_dump(), **json.loads(sys.argv[2])})
corpus = data.load(job.spec.data, cfg.vocab_size, cfg.context + 1)
batches = data.Batches(corpus.train, tr.batch_size, cfg.context + 1, seed=0, shard_index=0)
shapes = model.parameter_shapes(cfg)
theta0 = model.init_params(cfg, 0)
jax.block_until_ready(theta0)
t = time.process_time()  # what a restart does: the recipe (its exported programs), Θ placed, AdamW, the step
recipe = Recipe(cfg, tr, sharding.layout(tr.mesh, shapes, tr.batch_size), shapes=shapes,
                cache_dir=os.environ["JAX_COMPILATION_CACHE_DIR"])
params = recipe.place(theta0)
opt = recipe.init_state(params)
out = recipe.step(params, opt, batches.batch(0), 0); load = time.process_time() - t
jax.block_until_ready(out); first = time.process_time() - t - load
for n in range(1, 4):
    out = recipe.step(out[0], out[1], batches.batch(n), n)
jax.block_until_ready(out)
steps = int(sys.argv[4]); t = time.perf_counter()
for n in range(steps):
    out = recipe.step(out[0], out[1], batches.batch(n), n)
jax.block_until_ready(out)
print(json.dumps({"load_cpu": load, "first_step_cpu": first, "step_seconds": (time.perf_counter() - t) / steps}))
"""


def one(config: str, model: str, setting: str, steps: int, cache: str) -> dict[str, float]:
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0", "PYTHONPATH": ""}
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-P", "-c", CHILD, config, model, setting, str(steps)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"{setting} run failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "examples" / "quickstart.yaml"))
    parser.add_argument("--model", default="", help="JSON overriding spec.model fields, e.g. '{\"preset\": \"llama-tiny\"}'")
    parser.add_argument("--rounds", type=int, default=4, help="counted rounds, after one that fills the caches")
    parser.add_argument("--steps", type=int, default=40, help="steady steps timed per process")
    parser.add_argument("--smoke", action="store_true", help="a 1-layer d_model 32 model, one counted round, 3 steps")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.rounds, args.steps = '{"layers": 1, "d_model": 32, "heads": 2, "context": 32}', 1, 3
    settings = ("default", "learner")
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in settings}
    with tempfile.TemporaryDirectory(prefix="xla-cpu-") as cache:
        for r in range(args.rounds + 1):
            for s in settings:
                row = one(args.config, args.model, s, args.steps, cache)
                if r > 0:  # round 0 compiled and filled the cache
                    runs[s].append(row)
                print(f"round {r} {s:8s} " + " ".join(f"{k} {v * 1000:7.1f} ms" for k, v in row.items())
                      + ("" if r else "  (fills the cache; not counted)"), flush=True)
    med = {s: {k: statistics.median(row[k] for row in runs[s]) for k in runs[s][0]} for s in settings}
    restart = {s: med[s]["load_cpu"] + med[s]["first_step_cpu"] for s in settings}
    print(json.dumps({
        "bench": "xla_cpu", "model": args.model or "the config's", "rounds": args.rounds,
        "median_ms": {s: {k: round(v * 1000, 1) for k, v in med[s].items()} for s in settings},
        "first_step_cpu_ratio": round(med["learner"]["first_step_cpu"] / med["default"]["first_step_cpu"], 3),
        "restart_cpu_ratio": round(restart["learner"] / restart["default"], 3),
        "steady_step_ratio": round(med["learner"]["step_seconds"] / med["default"]["step_seconds"], 3),
    }))


if __name__ == "__main__":
    main()
