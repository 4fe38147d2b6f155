"""Model quality at the same training tokens: data-parallel, synchronous DiLoCo, Decoupled DiLoCo.

    python bench/quality.py [--steps 300] [--learners 4] [--arms all] [--smoke]
    python bench/quality.py --sweep-sync      # how synchronous DiLoCo's H / outer lr / momentum were chosen

Every arm: the quickstart model (2 layers, d_model 128, context 128, local batch 8), the same
held-out windows, and the same number of training tokens: M x --steps x 8 x 128.

* data-parallel: one process, global batch M x 8 (one local batch from each learner's shard),
  --steps AdamW steps. The exact equivalent of synchronous data-parallel training. Run twice
  (data seed 0 and 1) when --noise is on, to show how much a loss moves with the seed alone.
* sync-diloco: M learners in lock-step, full-model sync every H inner steps, Nesterov outer step
  on the plain average. Simulated one learner after another in one process (the same math).
* decoupled*: the product: `diloco run`'s local runner, M learner processes + one syncer over
  gRPC, K = 1, P = 4 balanced fragments, int4, RDA, token weighting, outer lr 1.0 / momentum 0;
  stopped once the learners have trained the token budget. Variants: chaos (learners SIGKILLed
  and restarted), one learner at half speed, one-knob ablations, and two diagnostics that locate
  the gap to data-parallel (quorum K = M; blend 0.5 on adoption).

Prints a table; the last line is a JSON object with every arm's final loss and its ratio to the
data-parallel baseline (seed 0).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

# name -> (description, changes to the decoupled manifest)
DECOUPLED_ARMS: dict[str, tuple[str, dict[str, Any]]] = {
    "decoupled": ("Decoupled DiLoCo: M=4, K=1, P=4 balanced, int4, RDA, token weighting", {}),
    "decoupled-chaos": ("... with chaos: a learner SIGKILLed every ~15 s, restarted 3 s later", {"chaos": True}),
    "decoupled-slow": ("... with one learner at half speed (slowdown 2)", {"slow": True}),
    "ablate-average": ("ablation: plain weighted average instead of RDA", {"syncer": {"merge": "average"}}),
    "ablate-bf16": ("ablation: bf16 outer gradients instead of int4", {"syncer": {"compression": "bf16"}}),
    "ablate-fp32": ("ablation: fp32 outer gradients instead of int4", {"syncer": {"compression": "fp32"}}),
    "ablate-layer": ("ablation: by-layer fragments instead of balanced", {"syncer": {"fragmentation": "layer"}}),
    "ablate-no-token-weighting": ("ablation: uniform merge weights", {"syncer": {"tokenWeighting": False}}),
}
# Diagnostics: how much of the gap to data-parallel is the asynchrony? (see docs/BENCHMARKS.md)
DIAGNOSTIC_ARMS: dict[str, tuple[str, dict[str, Any]]] = {
    "diag-quorum-all": ("diagnostic: quorum K = M (every round waits for all learners)", {"quorum_all": True}),
    "diag-blend-half": ("diagnostic: blend 0.5 (keep half the local weights on adoption)", {"syncer": {"blend": 0.5}}),
}
# Runnable with --arms, not part of "all".
EXTRA_ARMS: dict[str, tuple[str, dict[str, Any]]] = {
    "diag-outer-diloco": ("diagnostic: DiLoCo's outer lr 0.7 / momentum 0.9 instead of 1.0 / 0",
                          {"syncer": {"outerLearningRate": 0.7, "outerMomentum": 0.9}}),
    "ablate-no-participation-scaling": ("ablation: every round moves Θ by its full merged update",
                                        {"syncer": {"participationScaling": False}}),
}
TARGETS = {"decoupled": 0.02, "decoupled-chaos": 0.03}


def training(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"evalIntervalSteps": args.eval_interval}
    if args.decay_steps:
        out["decaySteps"] = args.decay_steps
    return out


def decoupled_manifest(name: str, args: argparse.Namespace, change: dict[str, Any]) -> dict[str, Any]:
    groups = [{"name": "local", "replicas": args.learners}]
    if change.get("slow"):
        groups = [{"name": "local", "replicas": args.learners - 1}, {"name": "slow", "replicas": 1, "slowdown": 2.0}]
    syncer = dict(change.get("syncer") or {})
    if change.get("quorum_all"):
        syncer["quorum"] = args.learners
    chaos = None
    if change.get("chaos"):
        chaos = {"meanSecondsBetweenKills": args.chaos_mean, "restartDelaySeconds": 3, "seed": 1, "maxConcurrent": 1}
    return common.manifest(name, steps_per_learner=args.steps, groups=groups, syncer=syncer,
                           chaos=chaos, training=training(args))


def run_decoupled(name: str, args: argparse.Namespace) -> dict[str, Any]:
    desc, change = {**DECOUPLED_ARMS, **DIAGNOSTIC_ARMS, **EXTRA_ARMS}[name]
    m = decoupled_manifest(name, args, change)
    total = args.learners * args.steps
    t0 = time.monotonic()
    r = common.run_job(m, args.out_dir / name, total_steps=total, max_seconds=args.max_seconds)
    s = r.summary
    return {"arm": name, "description": desc, "final_eval_loss": s["final_eval_loss"],
            "initial_eval_loss": s["initial_eval_loss"], "tokens": r.trained_tokens,
            "tokens_merged_reported": s["tokens_merged"], "train_seconds": r.train_seconds,
            "wall_seconds": time.monotonic() - t0, "tokens_per_second": r.tokens_per_second,
            "learner_kills": s["learner_kills"], "readmissions": s["readmissions"],
            "outer_steps": s["outer_steps"], "bytes_sent": s["bytes_sent"], "bytes_received": s["bytes_received"],
            "contributions_refused": s.get("contributions_refused", 0), "cores": "2 (M procs + syncer)",
            "curve": r.curve}


def sweep_sync(args: argparse.Namespace) -> None:
    """Grid over H and the outer optimizer for synchronous DiLoCo at this token budget, two
    configurations side by side (one per core)."""
    m = common.manifest("quality-sweep", steps_per_learner=args.steps)
    grid = [(h, lr, mu) for h in args.sweep_h for lr, mu in ((1.0, 0.0), (0.7, 0.9), (1.0, 0.5))]
    if args.sweep_only:
        grid = [(int(h), float(lr), float(mu)) for h, lr, mu in (x.split(":") for x in args.sweep_only.split(","))]
    rows: list[dict[str, Any]] = []
    for i in range(0, len(grid), 2):
        handles = [common.inproc_async("sync", m, cpu, learners=args.learners, steps=args.steps, inner_steps=h,
                                       outer_lr=lr, outer_momentum=mu)
                   for cpu, (h, lr, mu) in enumerate(grid[i:i + 2])]
        for h in handles:
            r = h.result()
            r.pop("curve")
            rows.append(r)
            print(f"H={r['inner_steps']:4d} lr={r['outer_lr']:.1f} mu={r['outer_momentum']:.1f} "
                  f"loss={r['final_eval_loss']:.4f}", flush=True)
    print(common.table(rows, [("inner_steps", "H", "d"), ("outer_lr", "outer lr", ".1f"),
                              ("outer_momentum", "momentum", ".1f"), ("final_eval_loss", "final loss", ".4f")]))
    best = min(rows, key=lambda r: r["final_eval_loss"])
    common.emit({"bench": "quality-sweep-sync", "steps_per_learner": args.steps, "learners": args.learners,
                 "rows": rows, "best": {k: best[k] for k in ("inner_steps", "outer_lr", "outer_momentum",
                                                             "final_eval_loss")}})


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    styles = {"data-parallel": ("black", "-"), "sync-diloco-H4": ("tab:blue", "-"),
              "sync-diloco-H20": ("tab:cyan", "-"), "decoupled": ("tab:red", "-"),
              "decoupled-chaos": ("tab:orange", "-"), "decoupled-slow": ("tab:purple", "-")}
    for r in rows:
        if r["arm"] in styles and r.get("curve"):
            c, ls = styles[r["arm"]]
            xs, ys = zip(*r["curve"])
            ax.plot([x / 1e6 for x in xs], ys, color=c, ls=ls, marker=".", ms=3, lw=1.2, label=r["arm"])
    ax.set_xlabel("training tokens (millions, all learners)")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
    ax.set_title("Held-out loss against tokens (decoupled: learners' local models)")
    ax.legend(fontsize=8)
    names = [r["arm"] for r in rows]
    vals = [r["final_eval_loss"] for r in rows]
    colors = ["black" if n.startswith("data") else "tab:blue" if n.startswith("sync") else
              "tab:red" if n.startswith("decoupled") else "tab:grey" for n in names]
    bx.barh(range(len(rows)), vals, color=colors)
    bx.set_yticks(range(len(rows)), names, fontsize=7)
    bx.invert_yaxis()
    lo = min(vals) * 0.97
    bx.set_xlim(lo, max(vals) * 1.01)
    base = next((r["final_eval_loss"] for r in rows if r["arm"] == "data-parallel"), None)
    if base:
        bx.axvline(base, color="black", lw=0.8, ls="--")
        bx.axvline(base * 1.02, color="tab:green", lw=0.8, ls=":", label="DP + 2%")
        bx.legend(fontsize=7, loc="lower right")
    bx.set_xlabel("final held-out loss of the global model")
    bx.set_title("Final loss at the same tokens")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="inner steps per learner (token budget / M / 1024)")
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--inner-steps", type=lambda s: [int(x) for x in s.split(",")], default=[4, 20],
                        help="synchronous DiLoCo's H, one arm each (4: the same sync bytes per step as P = 4)")
    parser.add_argument("--sync-lr", type=float, default=1.0, help="sync DiLoCo outer lr (best of --sweep-sync)")
    parser.add_argument("--sync-momentum", type=float, default=0.0, help="sync DiLoCo outer momentum")
    parser.add_argument("--arms", default="all", help="comma list of decoupled arms, 'all' or 'none'")
    parser.add_argument("--noise", action=argparse.BooleanOptionalAction, default=True,
                        help="also run data-parallel with data seed 1: how far a loss moves with the seed alone")
    parser.add_argument("--chaos-mean", type=float, default=15.0, help="mean seconds between learner kills")
    parser.add_argument("--eval-interval", type=int, default=100)
    parser.add_argument("--decay-steps", type=int, help="AdamW cosine decay length (default: --steps)")
    parser.add_argument("--max-seconds", type=float, default=600.0, help="safety stop per decoupled arm")
    parser.add_argument("--out-dir", type=Path, default=common.RUNS / "quality")
    parser.add_argument("--plot", type=Path, default=common.IMG / "bench_quality.png")
    parser.add_argument("--baseline-from", type=Path, help="reuse the in-process arms of an earlier result.json")
    parser.add_argument("--smoke", action="store_true", help="seconds, not minutes: 2 learners, 24 steps, 2 arms")
    parser.add_argument("--sweep-sync", action="store_true")
    parser.add_argument("--sweep-h", type=lambda s: [int(x) for x in s.split(",")], default=[4, 20, 50])
    parser.add_argument("--sweep-only", default="", help="H:lr:mu,... instead of the grid")
    args = parser.parse_args()
    if args.smoke:
        common.use_smoke_model()
        args.steps, args.learners, args.inner_steps, args.noise = 24, 2, [8], False
        args.arms = "decoupled" if args.arms == "all" else args.arms
        args.eval_interval, args.max_seconds = 12, 120.0
        args.out_dir, args.plot = common.RUNS / "smoke" / "quality", None
    if args.sweep_sync:
        sweep_sync(args)
        return
    t_start = time.monotonic()
    env = common.machine()
    arms = ([*DECOUPLED_ARMS, *DIAGNOSTIC_ARMS] if args.arms == "all" else [] if args.arms == "none"
            else args.arms.split(","))
    unknown = [a for a in arms if a not in {**DECOUPLED_ARMS, **DIAGNOSTIC_ARMS, **EXTRA_ARMS}]
    if unknown:
        parser.error(f"unknown arms {unknown}; choose from {[*DECOUPLED_ARMS, *DIAGNOSTIC_ARMS, *EXTRA_ARMS]}")

    base = common.manifest("quality", steps_per_learner=args.steps, training=training(args))
    # In-process arms, two at a time (one per core): data-parallel, synchronous DiLoCo at each H,
    # and with --noise data-parallel again with data seed 1.
    jobs: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
        ("data-parallel", "dp", base, {"learners": args.learners, "steps": args.steps})]
    for h in args.inner_steps:
        jobs.append((f"sync-diloco-H{h}", "sync", base, {
            "learners": args.learners, "steps": args.steps, "inner_steps": h, "outer_lr": args.sync_lr,
            "outer_momentum": args.sync_momentum}))
    if args.noise:
        jobs.append(("data-parallel-seed1", "dp", common.manifest("quality", steps_per_learner=args.steps, seed=1,
                                                                     training=training(args)),
                     {"learners": args.learners, "steps": args.steps}))
    rows: list[dict[str, Any]] = []
    if args.baseline_from:
        import json

        rows = [r for r in json.loads(args.baseline_from.read_text()) if "lockstep_seconds" in r or
                r["arm"].startswith("data-parallel")]
        jobs = []
    for i in range(0, len(jobs), 2):
        pair = jobs[i:i + 2]
        handles = [common.inproc_async(kind, m, cpu, **kw) for cpu, (_, kind, m, kw) in enumerate(pair)]
        for (name, kind, _, _), h in zip(pair, handles):
            r = h.result()
            r.update(arm=name, cores="1" if kind == "dp" else "1 (M simulated)")
            if name.endswith("seed1"):
                r["curve"] = None
            rows.append(r)
            print(f"{name}: final loss {r['final_eval_loss']:.4f}", flush=True)
    for name in arms:
        rows.append(run_decoupled(name, args))
        print(f"{name}: final loss {rows[-1]['final_eval_loss']:.4f} in {rows[-1]['wall_seconds']:.0f} s", flush=True)

    dp_loss = rows[0]["final_eval_loss"]
    for r in rows:
        r["ratio_to_dp"] = r["final_eval_loss"] / dp_loss
        r["gap_pct"] = 100 * (r["ratio_to_dp"] - 1)
        seconds = r.get("train_seconds") or r.get("lockstep_seconds") or r.get("compute_seconds")
        r["seconds"] = seconds
    print(f"\nquality at {rows[0]['tokens']:,} training tokens; M = {args.learners}; "
          f"sync DiLoCo outer lr {args.sync_lr}, momentum {args.sync_momentum}")
    print(common.table(rows, [("arm", "arm", ""), ("final_eval_loss", "final loss", ".4f"),
                              ("ratio_to_dp", "/ DP", ".4f"), ("gap_pct", "gap %", "+.2f"),
                              ("tokens", "tokens", ",d"), ("seconds", "seconds", ".1f"),
                              ("tokens_per_second", "tokens/s", ",.0f"), ("cores", "cores", ""),
                              ("learner_kills", "kills", "d")]))
    print("seconds: decoupled = first join to stop (wall); data-parallel = compute; sync DiLoCo = sum over rounds "
          "of the slowest learner + sync (lock-step equivalent)")
    for name, tol in TARGETS.items():
        r = next((x for x in rows if x["arm"] == name), None)
        if r:
            verdict = "met" if r["ratio_to_dp"] <= 1 + tol else f"MISSED by {100 * (r['ratio_to_dp'] - 1 - tol):.2f} pts"
            print(f"target {name} within {100 * tol:.0f}% of data-parallel: {r['gap_pct']:+.2f}% -> {verdict}")
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")
    common.save_json(args.out_dir / ("result.json" if args.arms == "all" else f"result-{args.arms}.json"), rows)
    common.emit({
        "bench": "quality", "learners": args.learners, "steps_per_learner": args.steps,
        "tokens": rows[0]["tokens"], "sync_diloco": {"inner_steps": args.inner_steps, "outer_lr": args.sync_lr,
                                                     "outer_momentum": args.sync_momentum},
        "final_loss": {r["arm"]: round(r["final_eval_loss"], 5) for r in rows},
        "ratio_to_dp": {r["arm"]: round(r["ratio_to_dp"], 5) for r in rows},
        "tokens_trained": {r["arm"]: r["tokens"] for r in rows},
        "seconds": round(time.monotonic() - t_start, 1), **env,
    })


if __name__ == "__main__":
    main()
