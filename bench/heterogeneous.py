"""Mixed-speed learners: Decoupled DiLoCo keeps everyone's throughput; synchronous DiLoCo waits.

    python bench/heterogeneous.py [--seconds 40] [--base-slowdown 3] [--inner-steps 20] [--smoke]

Four learners at relative speeds 1, 1, 1 and 0.5 (group slowdowns b, b, b and 2b: each step's
compute is followed by a sleep of (slowdown - 1) x compute, as the learner's `slowdown` does). b = 5
keeps four learners well below this machine's two cores, so that a learner's speed is mostly its
own, not the scheduler's (two JAX processes on one core still slow each other when their steps
overlap). Learner i runs on core i % 2 in every phase. Three phases, one after another:

1. uncoupled: the four learners' compute as plain AdamW loops, all at once, no syncer: the sum of
   their speeds is the most any scheme can get (the denominator);
2. Decoupled DiLoCo: the real job (`diloco run`'s local runner, one syncer, gRPC), K = 1;
3. synchronous DiLoCo: four real processes in lock-step (multiprocessing barrier), a full-model
   average and Nesterov step every H inner steps; everyone waits for the slowest every round.

Last line: JSON with aggregate tokens/s of each and the ratios to the uncoupled sum
(target: Decoupled >= 0.95).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import arms
import common

TARGET = 0.95


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    learners = [r for r in rows if r.get("speed") is not None]
    total = next(r for r in rows if r.get("speed") is None)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.27
    phases = [("plain", "uncoupled (no syncer)", "grey"), ("decoupled", "Decoupled DiLoCo", "tab:red"),
              ("sync", "synchronous DiLoCo", "tab:blue")]
    for j, (key, label, color) in enumerate(phases):
        ax.bar([i + (j - 1) * width for i in range(len(learners))], [r[key] for r in learners], width,
               label=label, color=color)
        bx.bar(j, total[key] / total["plain"], color=color)
        bx.text(j, total[key] / total["plain"] + 0.01, f"{total[key] / total['plain']:.3f}", ha="center", fontsize=9)
    ax.set_xticks(range(len(learners)), [f"{r['learner']}\n(speed {r['speed']:g})" for r in learners], fontsize=8)
    ax.set_ylabel("steps/s")
    ax.set_title("Each learner's steps/s")
    ax.legend(fontsize=8)
    bx.set_xticks(range(3), ["uncoupled", "Decoupled", "sync DiLoCo"])
    bx.axhline(0.95, color="tab:green", ls=":", lw=1, label="target 0.95")
    bx.set_ylim(0, 1.15)
    bx.set_ylabel("aggregate tokens/s / uncoupled sum")
    bx.set_title("Aggregate throughput")
    bx.legend(fontsize=8, loc="lower left")
    common.save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=40.0, help="measured seconds per phase")
    parser.add_argument("--speeds", default="1,1,1,0.5", help="relative learner speeds; the slowest group last")
    parser.add_argument("--base-slowdown", type=float, default=5.0)
    parser.add_argument("--inner-steps", type=int, default=20, help="synchronous DiLoCo's H")
    parser.add_argument("--warm", type=float, default=4.0, help="seconds after the last join not measured")
    parser.add_argument("--out-dir", type=Path, default=common.RUNS / "heterogeneous")
    parser.add_argument("--plot", type=Path, default=common.IMG / "bench_heterogeneous.png")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the three phases, interleaved")
    parser.add_argument("--smoke", action="store_true", help="two learners (speeds 1 and 0.5), a few seconds per phase")
    args = parser.parse_args()
    if args.smoke:
        common.use_smoke_model()
        args.seconds, args.warm, args.inner_steps, args.speeds = 3.0, 0.5, 4, "1,0.5"
        args.out_dir, args.plot = common.RUNS / "smoke" / "heterogeneous", None
    t_start = time.monotonic()
    speeds = [float(x) for x in args.speeds.split(",")]
    slowdowns = [args.base_slowdown / s for s in speeds]
    # One group per distinct speed, in order, so that learner i is the i-th process (core i % 2).
    groups: list[dict] = []
    names: list[str] = []
    for sd in slowdowns:
        if not groups or groups[-1]["slowdown"] != sd:
            groups.append({"name": f"speed{len(groups)}", "replicas": 0, "slowdown": sd})
        names.append(f"{groups[-1]['name']}-{groups[-1]['replicas']}")
        groups[-1]["replicas"] += 1
    m = common.manifest("heterogeneous", steps_per_learner=2000, groups=groups,
                        training={"evalIntervalSteps": 100_000})
    tps = common.tokens_per_step(m)
    n = len(speeds)

    def uncoupled() -> list[float]:
        handles = [arms.inproc_async("plain", m, i % 2, seconds=args.seconds, slowdown=slowdowns[i], shard=i,
                                       learners=n) for i in range(n)]
        return [h.result()["steps_per_second"] for h in handles]

    def decoupled(k: int) -> list[float]:
        r = common.run_job(m, args.out_dir / f"decoupled-{k}", total_steps=None, max_seconds=args.seconds + 120,
                           seconds_after_join=args.seconds + args.warm + 3)
        joins = [float(e["t"]) for e in r.events if e.get("event") == "joined"]
        stop = max(float(e["t"]) for e in r.events if e.get("event") in ("progress", "exit"))
        t_a = max(joins) + args.warm
        rates = common.learner_rates(r.events, t_a, min(stop, t_a + args.seconds))
        return [rates.get(name, 0.0) for name in names]

    def synchronous() -> tuple[list[float], list[float], float]:
        lock = arms.lockstep(m, slowdowns, args.inner_steps, args.seconds)
        total = sum(x["steps"] for x in lock) / max(x["seconds"] for x in lock)
        return [x["steps"] / x["seconds"] for x in lock], [1 - x["busy"] / x["seconds"] for x in lock], total

    runs: dict[str, list] = {"plain": [], "decoupled": [], "sync": [], "idle": [], "sync_total": []}
    for k in range(args.rounds):  # interleaved, so that a change in the machine's load hits all three
        runs["plain"].append(uncoupled())
        runs["decoupled"].append(decoupled(k))
        rates, idle_k, total = synchronous()
        runs["sync"].append(rates)
        runs["idle"].append(idle_k)
        runs["sync_total"].append(total)
        print(f"round {k + 1}: uncoupled {sum(runs['plain'][-1]) * tps:,.0f}, Decoupled "
              f"{sum(runs['decoupled'][-1]) * tps:,.0f}, sync DiLoCo {total * tps:,.0f} tokens/s", flush=True)

    def mean(rows: list[list[float]]) -> list[float]:
        return [sum(col) / len(col) for col in zip(*rows)]

    plain_rates, dec_rates, sync_rates, idle = (mean(runs[k]) for k in ("plain", "decoupled", "sync", "idle"))
    plain_total, dec_total = sum(plain_rates) * tps, sum(dec_rates) * tps
    sync_total = sum(runs["sync_total"]) / len(runs["sync_total"]) * tps

    rows = []
    for i, name in enumerate(names):
        rows.append({"learner": name, "speed": speeds[i], "slowdown": slowdowns[i],
                     "plain": plain_rates[i], "decoupled": dec_rates[i], "sync": sync_rates[i],
                     "sync_idle": 100 * idle[i]})
    rows.append({"learner": "total (tokens/s)", "plain": plain_total, "decoupled": dec_total, "sync": sync_total})
    print(f"steps/s per learner, {args.seconds:.0f} s per phase, mean of {args.rounds} round(s) (base slowdown {args.base_slowdown}, "
          f"sync DiLoCo H = {args.inner_steps})")
    print(common.table(rows, [("learner", "learner", ""), ("speed", "rel. speed", ".2f"),
                              ("plain", "uncoupled", ",.2f"), ("decoupled", "Decoupled", ",.2f"),
                              ("sync", "sync DiLoCo", ",.2f"), ("sync_idle", "sync idle %", ".0f")]))
    dec_ratio, sync_ratio = dec_total / plain_total, sync_total / plain_total
    ideal_sync = n * min(plain_rates) / sum(plain_rates)
    print(f"Decoupled / uncoupled sum = {dec_ratio:.3f} (target >= {TARGET}: "
          f"{'met' if dec_ratio >= TARGET else f'MISSED by {TARGET - dec_ratio:.3f}'})")
    print(f"sync DiLoCo / uncoupled sum = {sync_ratio:.3f} (lock-step bound M x slowest / sum = {ideal_sync:.3f})")
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")
    result = {"runs": runs, "rows": rows}
    common.save_json(args.out_dir / "result.json", result)
    common.emit({"bench": "heterogeneous", "speeds": speeds, "base_slowdown": args.base_slowdown,
                 "seconds_per_phase": args.seconds, "inner_steps": args.inner_steps, "rounds": args.rounds,
                 "uncoupled_tokens_per_s": plain_total, "decoupled_tokens_per_s": dec_total,
                 "sync_diloco_tokens_per_s": sync_total, "decoupled_ratio": dec_ratio, "sync_diloco_ratio": sync_ratio,
                 "sync_lockstep_bound": ideal_sync, "seconds": round(time.monotonic() - t_start, 1),
                 **common.machine()})


if __name__ == "__main__":
    main()
