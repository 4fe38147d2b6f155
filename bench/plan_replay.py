"""A plan checked on this machine: `diloco plan`'s syncer topology, scaled down, under its load.

    python bench/plan_replay.py [--plan "ARGS of diloco plan"] [--slots 120] [--warmup-cycles 0] [--smoke]

Runs `diloco plan ARGS --json`, then the planned syncer (its shard count, P, tau) as real
`diloco syncer` processes over a small GPT with at least P x shards tensors (the fragment
schedule needs that many), and the load generator (`diloco.apps.testkit.loadgen`, as
bench/syncer_scale.py drives it) as the plan's learners: the same number, the same step time,
so the same pushes per second per shard and the same schedule of due fragments, at a scaled-down
fragment size. Each slot's merge must reach every learner; the grace window allows a fragment
tau steps in flight, so a merge later than tau x step is a late merge beyond the allowance.

What it checks: the planned topology, schedule and push rate run (every push accepted and sent
on time, no merge beyond the allowance, each shard's core below 1). What it cannot check here:
the chain's time at the real fragment size (a 12B model does not fit this machine); that part of
the plan is the BENCHMARKS §5 model the plan prints.

Last line: JSON with `kept` per shard and the figures behind it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from syncer_scale import REPO, manifest, placement, shapes_of, start_syncer, trial

from diloco.apps.testkit.loadgen import seed

# The 12B x 4 US regions plan of docs/PLANNING.md (tau 3: at 2 the embedding's fragment misses it).
PLAN_12B = ("--params 12e9 --tau 3 --region name=us-central,chips=4096,wan-gbps=5,latency-ms=5 "
            "--region name=us-east,chips=4096,wan-gbps=2,latency-ms=20 "
            "--region name=us-west,chips=4096,wan-gbps=3,latency-ms=25 "
            "--region name=us-south,chips=4096,wan-gbps=4,latency-ms=15")
D_MODEL = 128  # the scaled model's width by default: fragments of ~25K parameters, far below the plan's
GPT_TENSORS_PER_LAYER = 8  # ln1, query, key, value, out, ln2, up, down (diloco/shapes.py)
GPT_OTHER_TENSORS = 4  # embed, pos_embed, ln_f, head


def plan_of(args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "diloco.apps.cli", "plan", *shlex.split(args), "--json"],
                         capture_output=True, text=True, cwd=REPO, check=False)
    result = json.loads(out.stdout)
    if out.returncode != 0:
        raise SystemExit(f"the plan does not run: {result.get('problems')}")
    return dict(result)


def replay(plan: dict[str, Any], slots: int, warmup: int, tmp: Path, d_model: int = D_MODEL) -> dict[str, Any]:
    fragments, shards, tau, step = plan["fragments"], plan["shards"], plan["tau"], plan["step_s"]
    learners = plan["learners"]
    layers = max(1, math.ceil((fragments * shards - GPT_OTHER_TENSORS) / GPT_TENSORS_PER_LAYER))
    shapes = shapes_of(layers, d_model)
    params = sum(math.prod(s) for s in shapes.values())
    config, shapes_file = tmp / "replay.yaml", tmp / "shapes.json"
    job = manifest(layers, d_model, fragments, shards, graceWindow={"tau": tau})
    config.write_text(yaml.safe_dump(job))
    shapes_file.write_text(json.dumps(shapes))
    token = secrets.token_hex(16)
    cores, generator = placement(shards)
    syncers = [start_syncer(config, token, tmp / f"shard-{i}.log", i, cores[i]) for i in range(shards)]
    address = ",".join(a for _, a in syncers)
    try:
        seed([a for _, a in syncers], token, {n: tuple(v) for n, v in shapes.items()}, fragments)
        print(f"replay: {shards} shard(s) P = {fragments} tau = {tau}, {learners} learners at {step:g} s steps, "
              f"a {params:,}-parameter GPT ({layers} layers x {d_model}); shards on {cores}, load generator on "
              f"{generator}", flush=True)
        t0 = time.monotonic()
        row = trial(address, token, shapes_file, learners, step, slots, warmup, "replay", generator,
                    [proc.pid for proc, _ in syncers], 0.0, len(generator or os.sched_getaffinity(0)))
        wall = time.monotonic() - t0
    finally:
        for proc, _ in syncers:
            proc.terminate()
        for proc, _ in syncers:
            proc.wait(timeout=120)
    if "error" in row:
        raise SystemExit(f"the load generator failed: {row['error']}")
    allowance = tau * step
    beyond = {s: t for s, t in row.get("missed", {}).items() if t > allowance}
    per_shard = [{"shard": i, "core_busy": busy,
                  "pushes_per_s": round(learners / step, 3),
                  "kept": bool(row["refused"] == 0 and row["late_pushes"] == 0 and not beyond and busy < 1.0)}
                 for i, busy in enumerate(row["syncer_cpu"])]
    return {"bench": "plan_replay", "plan": {k: plan[k] for k in ("fragments", "shards", "tau", "step_s", "learners",
                                                                 "pushes_per_s_per_shard", "shard_load")},
            "scaled_parameters": params, "scaled_layers": layers, "scaled_d_model": d_model,
            "scaled_fragment_params": round(params / (fragments * shards)), "slots_counted": row["slots"],
            "in_time_one_step": row["in_time"], "late_merges": len(row.get("missed", {})),
            "late_beyond_allowance": len(beyond), "allowance_s": allowance,
            "worst_merge_s": row["worst_merge_seconds"], "refused": row["refused"], "late_pushes": row["late_pushes"],
            "loadgen_cpu": row["loadgen_cpu"], "wall_s": round(wall, 1), "shards_kept": per_shard,
            "kept": all(s["kept"] for s in per_shard)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", default=PLAN_12B, help="the arguments of `diloco plan` (default: the 12B x 4 "
                                                         "regions plan of docs/PLANNING.md)")
    parser.add_argument("--slots", type=int, default=120, help="slots pushed (two minutes at 1 s steps)")
    parser.add_argument("--warmup-cycles", type=int, default=0,
                        help="cycles of P slots not counted (0: a scaled model's first publishes are small)")
    parser.add_argument("--d-model", type=int, default=D_MODEL,
                        help="the scaled model's width (larger: fragments closer to the plan's; memory permitting)")
    parser.add_argument("--smoke", action="store_true", help="a 5B x 2 sites plan (3 shards at P = 24), 30 slots")
    args = parser.parse_args()
    if args.smoke:
        args.plan = "--params 5e9 --fragments 24 --region name=a,wan-gbps=20 --region name=b,wan-gbps=20"
        args.slots = 30
    plan = plan_of(args.plan)
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(replay(plan, args.slots, args.warmup_cycles, Path(tmp), args.d_model)))


if __name__ == "__main__":
    main()
