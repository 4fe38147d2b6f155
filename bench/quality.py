"""Model quality at the same tokens: data-parallel, synchronous DiLoCo, Decoupled DiLoCo, over seeds.

    python bench/quality.py                              # 3 seeds, lr tuned per arm, contiguous shards
    python bench/quality.py --sharding interleaved
    python bench/quality.py --seeds 0 --lrs 3e-3 --smoke # seconds: the plumbing only

Every arm: M = 4 learners' worth of data, the quickstart model (2 layers, d_model 128, context
128, local batch 8), the same held-out windows and the same number of training tokens,
M x --steps x 8 x 128: 4,915,200 at the default 1,200 steps, about as many as each learner of
`make run` trains (~1,370). Shorter runs stop while the loss still falls fastest, where drift
between syncs costs local-update methods the most (docs/BENCHMARKS.md §1 reports 300 steps too).
Each arm runs at every inner learning rate of --lrs (or of its own --dp-lrs, --sync-lrs,
--decoupled-lrs) and every seed of --seeds; an arm's figure is its best learning rate's mean over
the seeds (chosen per arm, so no arm is handicapped by a shared setting).

* data-parallel: one process, global batch M x 8 (one local batch from each learner's shard).
* sync-diloco: M learners in lock-step, the whole model synced every H = P = 4 steps (the same
  bytes per step as Decoupled with P = 4 fragments), the product's default outer optimizer on
  the plain average. Simulated one learner after another in one process (the same math).
* decoupled: the product, `diloco run`'s local runner with the manifest defaults (K = 1, P = 4,
  int4, RDA, token weighting, rebase, shared schedule, the default outer step): M learner
  processes and a syncer over gRPC, stopped once the learners have trained the token budget.
* decoupled-chaos: the same at decoupled's best learning rate, a learner SIGKILLed every ~15 s
  and restarted 3 s later.
* decoupled-chaos-fresh (with --fresh-moments-arm): the same kills, with re-joining learners
  starting AdamW at zero moments instead of a peer's (spec.training.peerOptimizerState false).

Prints a table; the last line is one JSON object: decoupled_over_dp, decoupled_over_sync,
chaos_over_dp (means over the seeds of the per-seed ratios, each arm at its best learning rate),
seeds, std (each arm's standard deviation over the seeds) and every row.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import arms
import common

TARGETS = {"decoupled_over_sync": 1.00, "decoupled_over_dp": 1.02}


def manifest(args: argparse.Namespace, seed: int, lr: float, **kw: Any) -> dict[str, Any]:
    m = common.manifest("quality", steps_per_learner=args.steps, seed=seed,
                        training={"learningRate": lr, "evalIntervalSteps": args.eval_interval}, **kw)
    m["spec"]["data"]["sharding"] = args.sharding
    return m


def outer_step(args: argparse.Namespace) -> tuple[float, float]:
    """The outer lr and momentum of the synchronous and decoupled arms: the product's defaults,
    or --outer-lr for both."""
    from diloco.spec import Syncer

    s = Syncer()
    return args.outer_lr or s.outer_learning_rate, s.outer_momentum


def in_process(args: argparse.Namespace, skip: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Data-parallel and synchronous DiLoCo (but the arms in `skip`) at every (lr, seed), two at a
    time (one per core)."""
    outer_lr, outer_mu = outer_step(args)
    jobs = []
    for lr in args.dp_lrs or args.lrs:
        for seed in args.seeds:
            jobs.append(("data-parallel", lr, seed, "dp", manifest(args, seed, lr),
                         {"learners": args.learners, "steps": args.steps}))
    for lr in args.sync_lrs or args.lrs:
        for seed in args.seeds:
            jobs.append(("sync-diloco", lr, seed, "sync", manifest(args, seed, lr), {
                "learners": args.learners, "steps": args.steps, "inner_steps": args.sync_h,
                "outer_lr": outer_lr, "outer_momentum": outer_mu}))
    jobs = [j for j in jobs if j[0] not in skip]
    rows = []
    for i in range(0, len(jobs), 2):
        pair = jobs[i:i + 2]
        handles = [arms.inproc_async(kind, m, cpu, **kw) for cpu, (_, _, _, kind, m, kw) in enumerate(pair)]
        for (arm, lr, seed, *_), h in zip(pair, handles):
            r = h.result()
            r.update(arm=arm, lr=lr, seed=seed)
            rows.append(r)
            print(f"{arm} lr {lr:g} seed {seed}: final loss {r['final_eval_loss']:.4f}", flush=True)
    return rows


def decoupled(args: argparse.Namespace, arm: str, lr: float, seed: int) -> dict[str, Any]:
    chaos = ({"meanSecondsBetweenKills": args.chaos_mean, "restartDelaySeconds": 3, "seed": seed + 1,
              "maxConcurrent": 1} if arm.startswith("decoupled-chaos") else None)
    m = manifest(args, seed, lr, chaos=chaos, groups=[{"name": "local", "replicas": args.learners}])
    if arm == "decoupled-chaos-fresh":
        m["spec"]["training"]["peerOptimizerState"] = False
    if args.outer_lr:
        m["spec"].setdefault("syncer", {})["outerLearningRate"] = args.outer_lr
    t0 = time.monotonic()
    r = common.run_job(m, args.out_dir / f"{arm}-lr{lr:g}-s{seed}", total_steps=args.learners * args.steps,
                       max_seconds=args.max_seconds)
    s = r.summary
    row = {"arm": arm, "lr": lr, "seed": seed, "final_eval_loss": s["final_eval_loss"], "tokens": r.trained_tokens,
           "tokens_merged": s["tokens_merged"], "train_seconds": r.train_seconds,
           "wall_seconds": time.monotonic() - t0, "learner_kills": s["learner_kills"],
           "readmissions": s["readmissions"], "outer_steps": s["outer_steps"],
           "contributions_refused": s.get("contributions_refused", 0), "curve": r.curve}
    print(f"{arm} lr {lr:g} seed {seed}: final loss {row['final_eval_loss']:.4f} "
          f"({row['learner_kills']} kills, {row['wall_seconds']:.0f} s)", flush=True)
    return row


def best(rows: list[dict[str, Any]], arm: str) -> tuple[float, dict[int, float]]:
    """The arm's learning rate with the lowest mean loss, and its loss per seed."""
    import numpy as np

    by_lr: dict[float, dict[int, float]] = {}
    for r in rows:
        if r["arm"] == arm:
            by_lr.setdefault(r["lr"], {})[r["seed"]] = r["final_eval_loss"]
    lr = min(by_lr, key=lambda k: float(np.mean(list(by_lr[k].values()))))
    return lr, by_lr[lr]


def ratio(a: dict[int, float], b: dict[int, float]) -> float:
    seeds = sorted(set(a) & set(b))
    return sum(a[s] / b[s] for s in seeds) / len(seeds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1200, help="inner steps per learner (token budget / M / 1024)")
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    parser.add_argument("--lrs", type=lambda s: [float(x) for x in s.split(",")], default=[1.5e-3, 3e-3, 6e-3],
                        help="inner (AdamW peak) learning rates, each arm tuned over them")
    for arm in ("dp", "sync", "decoupled"):  # an arm's own grid, around where it is known to be best
        parser.add_argument(f"--{arm}-lrs", type=lambda s: [float(x) for x in s.split(",")],
                            help=f"the {arm} arm's learning rates (default: --lrs)")
    parser.add_argument("--sharding", choices=["contiguous", "interleaved"], default="contiguous")
    parser.add_argument("--sync-h", type=int, default=4, help="sync DiLoCo's H (4: the bytes per step of P = 4)")
    parser.add_argument("--no-chaos", action="store_true", help="skip the chaos arm")
    parser.add_argument("--chaos-mean", type=float, default=15.0, help="mean seconds between learner kills")
    parser.add_argument("--fresh-moments-arm", action="store_true",
                        help="also the chaos arm with re-joiners at zero AdamW moments (no peer's)")
    parser.add_argument("--outer-lr", type=float, help="the synchronous and decoupled arms' outer lr (default: the spec's)")
    parser.add_argument("--eval-interval", type=int, default=100)
    parser.add_argument("--max-seconds", type=float, default=1800.0, help="safety stop per decoupled run")
    parser.add_argument("--out-dir", type=Path, default=common.RUNS / "quality")
    parser.add_argument("--baseline-from", type=Path,
                        help="reuse the data-parallel and synchronous DiLoCo rows of an earlier result JSON")
    parser.add_argument("--baseline-arms", type=lambda s: s.split(","), default=["data-parallel", "sync-diloco"],
                        help="which in-process arms --baseline-from reuses; the others run again (synchronous "
                             "DiLoCo takes the product's default outer step, so it runs again when that changes)")
    parser.add_argument("--smoke", action="store_true", help="seconds, not minutes: 2 learners, 24 steps")
    args = parser.parse_args()
    if args.smoke:
        common.use_smoke_model()
        args.steps, args.learners, args.eval_interval, args.max_seconds = 24, 2, 12, 120.0
        args.seeds, args.lrs = args.seeds[:1], args.lrs[1:2]
        args.out_dir = common.RUNS / "smoke" / "quality"
    t_start = time.monotonic()
    env = common.machine()
    if args.baseline_from:
        import json

        rows = [r for r in json.loads(args.baseline_from.read_text()) if r["arm"] in args.baseline_arms]
        rows += in_process(args, skip=args.baseline_arms)
    else:
        rows = in_process(args)
    for lr in args.decoupled_lrs or args.lrs:
        for seed in args.seeds:
            rows.append(decoupled(args, "decoupled", lr, seed))
    dec_lr, _dec = best(rows, "decoupled")
    if not args.no_chaos:
        for seed in args.seeds:
            rows.append(decoupled(args, "decoupled-chaos", dec_lr, seed))
            if args.fresh_moments_arm:  # paired: the same seed, so the same kill schedule
                rows.append(decoupled(args, "decoupled-chaos-fresh", dec_lr, seed))

    import numpy as np

    names = (["data-parallel", "sync-diloco", "decoupled"] + ([] if args.no_chaos else ["decoupled-chaos"])
            + (["decoupled-chaos-fresh"] if args.fresh_moments_arm and not args.no_chaos else []))
    chosen = {arm: best(rows, arm) for arm in names}
    dp = chosen["data-parallel"][1]
    table = []
    for arm in names:
        lr, losses = chosen[arm]
        vals = list(losses.values())
        table.append({"arm": arm, "lr": lr, "mean": float(np.mean(vals)),
                      "std": float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0,
                      "over_dp": ratio(losses, dp), "seeds": len(vals)})
    print(f"\nquality at {rows[0]['tokens']:,} training tokens; M = {args.learners}; {args.sharding} shards; "
          f"seeds {args.seeds}; each arm at its best inner lr of {sorted({r['lr'] for r in rows})}")
    print(common.table(table, [("arm", "arm", ""), ("lr", "inner lr", "g"), ("mean", "final loss", ".4f"),
                               ("std", "std", ".4f"), ("over_dp", "/ DP", ".4f"), ("seeds", "seeds", "d")]))
    result = {
        "bench": "quality", "learners": args.learners, "steps_per_learner": args.steps, "sharding": args.sharding,
        "tokens": rows[0]["tokens"], "seeds": args.seeds, "lrs": args.lrs, "sync_h": args.sync_h,
        "outer_step": dict(zip(("lr", "momentum"), outer_step(args))),
        "decoupled_over_dp": round(ratio(chosen["decoupled"][1], dp), 5),
        "decoupled_over_sync": round(ratio(chosen["decoupled"][1], chosen["sync-diloco"][1]), 5),
        "best_lr": {t["arm"]: t["lr"] for t in table},
        "mean": {t["arm"]: round(t["mean"], 5) for t in table},
        "std": {t["arm"]: round(t["std"], 5) for t in table},
        "seconds": round(time.monotonic() - t_start, 1), **env,
    }
    if not args.no_chaos:
        result["chaos_over_dp"] = round(ratio(chosen["decoupled-chaos"][1], dp), 5)
    if "decoupled-chaos-fresh" in chosen:
        result["chaos_fresh_moments_over_dp"] = round(ratio(chosen["decoupled-chaos-fresh"][1], dp), 5)
    for key, target in TARGETS.items():
        verdict = "met" if result[key] <= target else f"MISSED by {100 * (result[key] - target):.2f} points"
        print(f"target {key} <= {target:.2f}: {result[key]:.4f} -> {verdict}")
    if "chaos_over_dp" in result:
        target = result["decoupled_over_dp"] + 0.01
        verdict = "met" if result["chaos_over_dp"] <= target else "MISSED"
        print(f"target chaos_over_dp <= decoupled_over_dp + 0.01 = {target:.4f}: {result['chaos_over_dp']:.4f} -> {verdict}")
    common.save_json(args.out_dir / f"result-{args.sharding}.json", rows)
    common.emit(result)


if __name__ == "__main__":
    main()
