"""Run-to-run spread: the same 2-learner job twice, stopped by step count, not by time.

    python bench/repeatability.py              # 2 learners, batch 16, 900 slots of the schedule
    python bench/repeatability.py --steps 300

Both runs use one manifest (the quickstart's model and defaults, two learners at batch 16,
`training.steps` = --steps), so they differ only in timing: which pushes land in which round.
Prints both final held-out losses and their relative difference (target: within 1%).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=900)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        common.use_smoke_model()
        args.steps = 30
    rows = []
    for i in range(args.runs):
        m = common.manifest("repeat", steps_per_learner=args.steps, groups=[{"name": "local", "replicas": 2}],
                            training={"batchSize": 16, "steps": args.steps, "evalIntervalSteps": 300})
        if args.smoke:
            m["spec"]["training"]["batchSize"] = 4
        r = common.run_job(m, common.RUNS / "repeatability" / f"run{i}", total_steps=None, max_seconds=1800)
        s = r.summary
        rows.append({"run": i, "final_eval_loss": s["final_eval_loss"], "tokens_trained": s["tokens_trained"],
                     "tokens_merged": s["tokens_merged"], "outer_steps": s["outer_steps"],
                     "wall_seconds": s["wall_seconds"]})
        print(f"run {i}: final loss {s['final_eval_loss']:.4f}, {s['tokens_trained']:,} tokens trained, "
              f"{s['tokens_merged']:,} merged", flush=True)
    losses = [r["final_eval_loss"] for r in rows]
    spread = (max(losses) - min(losses)) / min(losses)
    print(f"spread: {100 * spread:.2f}% (target within 1%)")
    common.emit({"bench": "repeatability", "steps": args.steps, "learners": 2, "batch": 16, "runs": rows,
                 "relative_spread": round(spread, 5), **common.machine()})


if __name__ == "__main__":
    main()
