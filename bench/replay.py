"""Decoupled DiLoCo in the deterministic replay harness (apps/sim/replay.py) with the real model.

    python bench/replay.py --arms decoupled,ablate-average --seeds 0,1,2
    python bench/replay.py --sweep-outer                  # outer lr x momentum for frequent syncs

One process per arm (two side by side, one per core), a virtual clock, scripted learner
speeds: the real learner books and schedule, the real round logic, merging and outer step,
the real int4 push codec and the real JAX model and inner step. Two runs of one arm and
seed are bit-for-bit the same, so an ablation's difference from its baseline is the knob
it turns plus the seed's noise, never timing. Every arm: M = 4 learners, the quickstart
model, the same shards, held-out windows and token budget as bench/quality.py.

Prints a table of mean ± std over the seeds; the last line is a JSON object.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import arms
import common

# name -> (description, replay options); options: syncer (spec.syncer changes), scripts
# (timeline kind), adoption, shared (the shared schedule on/off).
ARMS: dict[str, tuple[str, dict[str, Any]]] = {
    "decoupled": ("the defaults: K=1, P=4 balanced, int4 both ways, RDA, token weighting, rebase, shared schedule", {}),
    "decoupled-chaos": ("... a learner killed every ~40 slots, back 10 slots later", {"scripts": "chaos"}),
    "ablate-chaos-fresh-moments": ("... a re-joining learner starts AdamW at zero moments, not a peer's",
                                   {"scripts": "chaos", "training": {"peerOptimizerState": False}}),
    "decoupled-slow": ("... one learner at half speed", {"scripts": "slow"}),
    "ablate-average": ("plain weighted average instead of RDA", {"syncer": {"merge": "average"}}),
    "ablate-no-token-weighting": ("uniform merge weights", {"syncer": {"tokenWeighting": False}}),
    "ablate-layer": ("by-layer fragments instead of balanced", {"syncer": {"fragmentation": "layer"}}),
    "ablate-bf16": ("bf16 outer gradients instead of int4", {"syncer": {"compression": "bf16"}}),
    "ablate-no-schedule": ("each learner picks its fragment from its own step count", {"shared": False}),
    "ablate-overwrite": ("adoption overwrites (θ_p ← Θ_p) instead of rebasing", {"adoption": "overwrite"}),
    "ablate-no-grace": ("no grace window (γ = 0): rounds close at quorum", {"syncer": {"graceWindow": {"gamma": 0.0}}}),
    # The broadcast's codec (spec.syncer.broadcastCompression) named outright, all else the
    # defaults: what each down-link costs, without the real bench's timing noise
    # (bench/broadcast_quality.py), whatever the default of the day.
    **{f"broadcast-{c}": (f"the broadcast's deltas in {c}", {"syncer": {"broadcastCompression": c}})
       for c in ("fp32", "int8", "int4", "nf4")},
    "ablate-no-participation-scaling": ("partial rounds move Θ by their full merged update",
                                        {"syncer": {"participationScaling": False}}),
}


def arm_manifest(args: argparse.Namespace, change: dict[str, Any], seed: int, lr: float | None = None,
                 outer: tuple[float, float] | None = None) -> dict[str, Any]:
    syncer = common.deep(change.get("syncer") or {})
    if outer:
        syncer.update(outerLearningRate=outer[0], outerMomentum=outer[1])
    training = {**change.get("training", {}), **({"learningRate": lr} if lr else {}),
                **({"evalBatches": args.eval_batches} if args.eval_batches else {})} or None
    m = common.manifest("replay", steps_per_learner=args.steps, syncer=syncer, seed=seed, training=training,
                        groups=[{"name": "local", "replicas": args.learners}])
    m["spec"]["data"]["sharding"] = args.sharding
    return m


def run_grid(jobs: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i in range(0, len(jobs), 2):
        pair = jobs[i:i + 2]
        handles = [arms.inproc_async("replay", m, cpu, **kw) for cpu, (_, m, kw) in enumerate(pair)]
        for (name, _, kw), h in zip(pair, handles):
            r = h.result()
            r.update(arm=name, seed=kw["seed"])
            rows.append(r)
            print(f"{name} seed {kw['seed']}: final loss {r['final_eval_loss']:.4f} "
                  f"(rounds of {r['mean_round']:.2f}, {r['skipped_slots']} skipped, {r['wall_seconds']:.0f} s)",
                  flush=True)
    return rows


def summarise(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    import numpy as np

    out: dict[str, dict[str, float]] = {}
    for name in dict.fromkeys(r["arm"] for r in rows):
        vals = [r["final_eval_loss"] for r in rows if r["arm"] == name]
        out[name] = {"mean": float(np.mean(vals)), "std": float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0,
                     "n": len(vals)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="schedule slots (inner steps per learner)")
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    parser.add_argument("--arms", default="decoupled", help=f"comma list from {sorted(ARMS)} or 'all'")
    parser.add_argument("--lr", type=float, help="inner learning rate (default: the bench's 3e-3)")
    # Held-out windows of 8 x 128 tokens (unset: the benches' 16). Two arms' models differ by more
    # than their knob (any perturbation sends training its own way), and how that difference
    # reads on a few windows is noise: 128 (132K tokens, half the held-out split) quarter it.
    parser.add_argument("--eval-batches", type=int, help="held-out batches a loss is measured on")
    parser.add_argument("--sharding", choices=["contiguous", "interleaved"], default="contiguous")
    parser.add_argument("--sweep-outer", action="store_true", help="outer lr x momentum grid on the decoupled arm")
    parser.add_argument("--outer-lrs", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 1.3, 1.5, 2.0])
    parser.add_argument("--outer-momenta", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.5, 0.9])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=common.RUNS / "replay" / "result.json")
    args = parser.parse_args()
    if args.smoke:
        common.use_smoke_model()
        args.steps, args.seeds = 24, [0]
        args.out = common.RUNS / "smoke" / "replay" / "result.json"
    t0 = time.monotonic()
    jobs: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    base_kw = {"learners": args.learners, "steps": args.steps}
    if args.sweep_outer:
        for lr in args.outer_lrs:
            for mu in args.outer_momenta:
                for seed in args.seeds:
                    jobs.append((f"outer-lr{lr:g}-mu{mu:g}", arm_manifest(args, {}, seed, args.lr, (lr, mu)),
                                 {**base_kw, "seed": seed}))
    else:
        names = list(ARMS) if args.arms == "all" else args.arms.split(",")
        unknown = [n for n in names if n not in ARMS]
        if unknown:
            parser.error(f"unknown arms {unknown}; choose from {sorted(ARMS)}")
        for name in names:
            change = ARMS[name][1]
            opts = {k: change[k] for k in ("scripts", "adoption", "shared") if k in change}
            for seed in args.seeds:
                jobs.append((name, arm_manifest(args, change, seed, args.lr), {**base_kw, "seed": seed, **opts}))
    rows = run_grid(jobs)
    stats = summarise(rows)
    print(f"\nreplay, M = {args.learners}, {args.steps} slots, seeds {args.seeds}, inner lr {args.lr or 3e-3:g}, "
          f"{args.sharding} shards")
    print(common.table([{"arm": k, **v} for k, v in stats.items()],
                       [("arm", "arm", ""), ("mean", "final loss (mean)", ".4f"), ("std", "std", ".4f"),
                        ("n", "seeds", "d")]))
    common.save_json(args.out, rows)
    common.emit({"bench": "replay", "learners": args.learners, "steps": args.steps, "seeds": args.seeds,
                 "inner_lr": args.lr or 3e-3, "sharding": args.sharding, "arms": stats, "seconds": round(time.monotonic() - t0, 1)})


if __name__ == "__main__":
    main()
