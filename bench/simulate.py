"""The full goodput sweep of the paper, timed: the simulator must stay event-driven.

    python bench/simulate.py [--seeds 3] [--days 30]

Five chip counts from 150K to 2.4M, data-parallel, elastic data-parallel and Decoupled DiLoCo
with M in {2, 4, 8, 16}, defaults only. Each system replays every sampled interruption, so
events = interruptions x replays; the sweep should take well under a minute on two cores.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

from diloco.apps.sim.goodput import PAPER_GOODPUT, SimParams, sweep

CHIPS = [150_000, 300_000, 600_000, 1_200_000, 2_400_000]
LEARNERS = [2, 4, 8, 16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--days", type=float, default=30.0)
    args = parser.parse_args()
    start = time.perf_counter()
    rows = sweep(CHIPS, LEARNERS, args.seeds, args.days, SimParams())
    seconds = time.perf_counter() - start
    interruptions = sum(r.interruptions for r in rows if r.system == "dp") * args.seeds
    events = sum(r.interruptions for r in rows) * args.seeds
    errors = {}
    print(f"{'system':10} {'chips':>9} {'M':>3} {'goodput':>8} {'uptime':>8} {'paper':>6}")
    for r in rows:
        paper = PAPER_GOODPUT.get((r.system, r.chips, r.learners))
        if paper is not None:
            errors[f"{r.system}/{r.chips}/{r.learners}"] = round(100 * (r.goodput - paper), 2)
        print(f"{r.system:10} {r.chips:9d} {r.learners or '-':>3} {100 * r.goodput:7.1f}%"
              f" {100 * r.uptime:7.2f}% {'' if paper is None else f'{100 * paper:.0f}%':>6}")
    print(f"{interruptions:.0f} interruptions sampled, {events:.0f} events replayed "
          f"in {seconds:.2f} s: {events / seconds:,.0f} events/s")
    print(json.dumps({
        "seconds": round(seconds, 3), "interruptions": round(interruptions),
        "events": round(events), "events_per_second": round(events / seconds),
        "seeds": args.seeds, "days": args.days, "error_vs_paper_pp": errors,
        "max_abs_error_vs_paper_pp": max(abs(e) for e in errors.values()),
        "rows": [r.as_json() for r in rows],
    }))


if __name__ == "__main__":
    main()
