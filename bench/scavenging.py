"""Compute scavenging: extra learners join a running job half way.

    python bench/scavenging.py [--seconds 100] [--base 2] [--extra 2] [--slowdown 3] [--smoke]

A real job (`diloco run`'s local runner): `--base` learners start with the syncer; `--extra`
learners of a second group are held back and started when half of `--seconds` has passed since the
first join. They join like any restarted learner: pull the current global model and train at once.
Every learner is slowed down by `--slowdown` (sleep (slowdown - 1) x compute after each step) so
that base + extra learners fit this machine's two cores: on two cores, four learners at full speed
would only share the same CPU and the total could not rise. Measured: aggregate tokens/s before
the join and after the newcomers have joined (ideal: x (base + extra) / base), and the held-out
loss curve across the join (each learner's local model every --eval-interval steps; it should
not rise above its value just before the join). Last line: JSON.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

TARGET = 0.8


def plot(events: list[dict[str, Any]], t0: float, late: float, joins: dict[str, float], tps: int,
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, timeline = common.trained_steps(events)
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    xs, ys = [], []
    window = 4.0
    for t, _ in timeline:
        lo = [s for tt, s in timeline if t - window <= tt <= t]
        span = [tt for tt, _ in timeline if t - window <= tt <= t]
        if len(lo) > 1 and span[-1] > span[0] and t - t0 > window:
            xs.append(t - t0)
            ys.append((lo[-1] - lo[0]) * tps / (span[-1] - span[0]))
    ax.plot(xs, ys, color="tab:blue", lw=1)
    ax.set_ylabel(f"tokens/s ({window:.0f} s window)")
    for name, t in joins.items():
        for a in (ax, bx):
            a.axvline(t - t0, color="tab:green" if name.startswith("extra") else "grey", lw=0.8, ls=":")
    for a in (ax, bx):
        a.axvline(late - t0, color="tab:red", lw=1, ls="--", label="extra learners started")
    by: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("event") == "eval":
            by.setdefault(e["source"], []).append((float(e["t"]) - t0, float(e["eval_loss"])))
        if e.get("event") == "joined":
            by.setdefault(e["source"], []).append((float(e["t"]) - t0, float(e["eval_loss"])))
    for name, pts in sorted(by.items()):
        pts.sort()
        bx.plot(*zip(*pts), marker=".", ms=3, lw=1, label=name)
    bx.set_ylabel("held-out loss (local model)")
    bx.set_xlabel("seconds since the first learner joined (dotted: joins)")
    lo = min(v for pts in by.values() for _, v in pts)
    bx.set_ylim(lo * 0.97, min(3.5, max(v for pts in by.values() for _, v in pts) * 1.02))
    bx.legend(fontsize=7)
    ax.set_title("Compute scavenging: learners join a running job")
    common.save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=100.0, help="total seconds after the first join")
    parser.add_argument("--base", type=int, default=2)
    parser.add_argument("--extra", type=int, default=2)
    parser.add_argument("--slowdown", type=float, default=5.0)
    parser.add_argument("--eval-interval", type=int, default=20)
    parser.add_argument("--warm", type=float, default=4.0, help="seconds after a join not measured")
    parser.add_argument("--out-dir", type=Path, default=common.RUNS / "scavenging")
    parser.add_argument("--plot", type=Path, default=common.IMG / "bench_scavenging.png")
    parser.add_argument("--smoke", action="store_true", help="1 + 1 learners, 10 seconds")
    args = parser.parse_args()
    if args.smoke:
        common.use_smoke_model()
        args.seconds, args.base, args.extra, args.warm, args.eval_interval = 10.0, 1, 1, 0.5, 10
        args.out_dir, args.plot = common.RUNS / "smoke" / "scavenging", None
    t_start = time.monotonic()
    m = common.manifest("scavenging", steps_per_learner=1500, groups=[
        {"name": "base", "replicas": args.base, "slowdown": args.slowdown},
        {"name": "extra", "replicas": args.extra, "slowdown": args.slowdown},
    ], training={"evalIntervalSteps": args.eval_interval, "evalBatches": 8})
    tps = common.tokens_per_step(m)
    r = common.run_job(m, args.out_dir, total_steps=None, max_seconds=args.seconds + 120,
                       late={"group": "extra", "after_seconds": args.seconds / 2,
                             # a newcomer that starts slowly still gets its measured half
                             "min_seconds_joined": args.seconds / 2},
                       seconds_after_join=args.seconds)
    ev = r.events
    joins: dict[str, float] = {}
    for e in ev:
        if e.get("event") == "joined":
            joins.setdefault(e["source"], float(e["t"]))
    t0 = min(joins.values())
    late = r.late_start or t0 + args.seconds / 2
    stop = max(float(e["t"]) for e in ev if e.get("event") in ("progress", "exit"))
    base_joined = max(t for n, t in joins.items() if n.startswith("base"))
    extra_joins = [t for n, t in joins.items() if n.startswith("extra")]
    extra_joined = max(extra_joins) if len(extra_joins) == args.extra else stop
    before = common.learner_rates(ev, base_joined + args.warm, late)
    after = common.learner_rates(ev, extra_joined + args.warm, stop)
    rate_before = sum(before.values()) * tps
    rate_after = sum(after.values()) * tps
    ideal = (args.base + args.extra) / args.base
    fraction = (rate_after / rate_before) / ideal if rate_before else 0.0

    # Loss across the join: the learners' latest evals just before the first newcomer joined,
    # against every eval after it.
    first_extra = min(extra_joins) if extra_joins else stop
    pre: dict[str, float] = {}
    post: list[float] = []
    for e in ev:
        if e.get("event") != "eval":
            continue
        if float(e["t"]) < first_extra:
            pre[e["source"]] = float(e["eval_loss"])
        else:
            post.append(float(e["eval_loss"]))
    pre_join = sum(pre.values()) / len(pre) if pre else float("nan")
    post_max = max(post) if post else float("nan")
    join_evals = {n: float(e["eval_loss"]) for e in ev if e.get("event") == "joined"
                  for n in [e["source"]] if n.startswith("extra")}
    spike = post_max > pre_join
    rise_pct = 100 * (post_max / pre_join - 1) if pre_join == pre_join and post_max == post_max else float("nan")
    # When the highest post-join eval happened, in seconds after the first newcomer joined.
    peak_t = next((float(e["t"]) - first_extra for e in ev if e.get("event") == "eval"
                   and float(e["t"]) >= first_extra and float(e["eval_loss"]) == post_max), float("nan"))

    rows = [{"phase": f"before ({args.base} learners)", "tokens_per_second": rate_before,
             "per_learner": rate_before / args.base},
            {"phase": f"after ({args.base + args.extra} learners)", "tokens_per_second": rate_after,
             "per_learner": rate_after / (args.base + args.extra)}]
    print(common.table(rows, [("phase", "phase", ""), ("tokens_per_second", "tokens/s", ",.0f"),
                              ("per_learner", "per learner", ",.0f")]))
    print(f"after/before = {rate_after / rate_before:.3f}; ideal {ideal:.2f}; fraction of ideal = {fraction:.3f} "
          f"(target >= {TARGET}: {'met' if fraction >= TARGET else 'MISSED'})")
    print(f"held-out loss just before the join {pre_join:.4f}; highest after it {post_max:.4f} "
          f"({rise_pct:+.2f}%, {peak_t:.0f} s after the first newcomer joined: {'spike' if spike else 'no spike'}); "
          "newcomers' join-time loss (global model): "
          + ", ".join(f"{k} {v:.4f}" for k, v in join_evals.items()))
    if args.plot:
        plot(ev, t0, late, joins, tps, args.plot)
        print(f"wrote {args.plot}")
    common.emit({"bench": "scavenging", "base": args.base, "extra": args.extra, "slowdown": args.slowdown,
                 "tokens_per_s_before": rate_before, "tokens_per_s_after": rate_after,
                 "speedup": rate_after / rate_before if rate_before else 0.0, "ideal_speedup": ideal,
                 "fraction_of_ideal": fraction, "loss_before_join": pre_join, "max_loss_after_join": post_max,
                 "spike": spike, "rise_pct": rise_pct, "peak_seconds_after_join": peak_t,
                 "newcomer_join_loss": join_evals, "final_eval_loss": r.summary["final_eval_loss"],
                 "seconds": round(time.monotonic() - t_start, 1), **common.machine()})


if __name__ == "__main__":
    main()
