"""`diloco simulate` and `diloco bandwidth`: size a job on paper before spending a dollar.

Only argparse and the dataclasses load at start-up; numpy work and matplotlib run in the handlers.
"""

from __future__ import annotations

import argparse
import json
import sys

from diloco.apps.sim.bandwidth import BandwidthParams
from diloco.apps.sim.goodput import DAY, HOUR, SYSTEMS, SimParams

_SIM = SimParams()
_BW = BandwidthParams()
DEFAULT_CHIPS = "150000,300000,600000,1200000,2400000"


def _count(text: str) -> int:
    """A positive integer; accepts 150000, 1.5e5, 150K or 2.4M."""
    scale = {"K": 1_000, "M": 1_000_000}.get(text[-1:].upper(), 1)
    try:
        value = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive whole number")
    return int(value)


def _counts(text: str) -> list[int]:
    values = [_count(part.strip()) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} lists no values")
    return values


def _systems(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown system {', '.join(unknown) or repr(text)}; use {', '.join(SYSTEMS)}")
    return names


def _nonneg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return value


def _positive(text: str) -> float:
    value = _nonneg(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def _fraction(text: str) -> float:
    value = _positive(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be strictly between 0 and 1")
    return value


def add_simulate_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate", help="discrete-event goodput simulation of dp, elastic dp and Decoupled DiLoCo",
        description="Replay chip interruptions (Poisson, per-chip MTBI) against data-parallel, "
                    "elastic data-parallel and Decoupled DiLoCo; see docs/simulator.md.")
    p.add_argument("--chips", type=_counts, default=_counts(DEFAULT_CHIPS),
                   help=f"comma-separated chip counts (default {DEFAULT_CHIPS})")
    p.add_argument("--learners", type=_counts, default=[2, 4, 8, 16],
                   help="comma-separated learner counts M for Decoupled DiLoCo (default 2,4,8,16)")
    p.add_argument("--systems", type=_systems, default=SYSTEMS,
                   help=f"comma-separated systems (default {','.join(SYSTEMS)})")
    p.add_argument("--seeds", type=_count, default=3, help="independent runs averaged (default 3)")
    p.add_argument("--days", type=_positive, default=30.0, help="length of the run (default 30)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per row (learners is null for dp and elastic_dp)")
    p.add_argument("--plot", default=None, metavar="PNG", help="also draw goodput against chips into this PNG")
    m = p.add_argument_group("model parameters (docs/simulator.md explains each default)")
    m.add_argument("--mtbi-days", type=_positive, default=_SIM.mtbi_s / DAY,
                   help="mean time between interruptions of one chip (default 365.25)")
    m.add_argument("--chips-per-slice", type=_count, default=_SIM.chips_per_slice,
                   help="chips a failure takes out; elastic jobs drop whole slices (default 256)")
    for flag, default, text in [
        ("--detection-s", _SIM.detection_s, "time to notice a failure"),
        ("--reconfiguration-s", _SIM.reconfiguration_s, "elastic re-mesh without (or with) slices"),
        ("--restart-s", _SIM.restart_s, "dp restart: spare swap, relaunch, checkpoint reload"),
        ("--rejoin-wait-s", _SIM.rejoin_wait_s, "longest a repaired slice waits to rejoin"),
        ("--state-pull-s", _SIM.state_pull_s, "re-admitted learner pulls the model from the syncer"),
        ("--spare-sigma", _SIM.spare_sigma, "dp hot spares above mean in repair, in Poisson std devs"),
    ]:
        m.add_argument(flag, type=_nonneg, default=default, help=f"{text} (default {default:g})")
    m.add_argument("--checkpoint-interval-s", type=_positive, default=_SIM.checkpoint_interval_s,
                   help=f"dp checkpoint interval (default {_SIM.checkpoint_interval_s:g})")
    m.add_argument("--repair-hours", type=_nonneg, default=_SIM.repair_s / HOUR,
                   help=f"until a failed slice is healthy again (default {_SIM.repair_s / HOUR:g})")
    m.add_argument("--quorum", type=_count, default=_SIM.quorum,
                   help="minimum learners K for the syncer to close a round (default 1)")
    p.set_defaults(func=run_simulate)


def _error(message: str) -> int:
    print(f"diloco: error: {message}", file=sys.stderr)
    return 2


def run_simulate(args: argparse.Namespace) -> int:
    from diloco import extras
    from diloco.apps.sim.goodput import PAPER_GOODPUT, n_slices, sweep

    if args.plot and "matplotlib" in extras.missing(extras.LEARNER):  # before minutes of sweeping, not after
        print(extras.missing_message("simulate --plot", extras.LEARNER, ["matplotlib"]), file=sys.stderr)
        return 2

    params = SimParams(
        mtbi_s=args.mtbi_days * DAY, chips_per_slice=args.chips_per_slice,
        detection_s=args.detection_s, reconfiguration_s=args.reconfiguration_s,
        restart_s=args.restart_s, checkpoint_interval_s=args.checkpoint_interval_s,
        repair_s=args.repair_hours * HOUR, rejoin_wait_s=args.rejoin_wait_s,
        state_pull_s=args.state_pull_s, spare_sigma=args.spare_sigma, quorum=args.quorum)
    learners = args.learners if "decoupled" in args.systems else []
    fewest = min(n_slices(c, params) for c in args.chips)
    if learners and max(learners) > fewest:
        return _error(f"--learners {max(learners)} exceeds the {fewest} slices of the smallest "
                      f"--chips value (each learner needs a slice of --chips-per-slice chips)")
    if learners and params.quorum > min(learners):
        return _error(f"--quorum {params.quorum} exceeds the smallest --learners {min(learners)}")
    rows = sweep(args.chips, learners, args.seeds, args.days, params, args.systems)
    if args.json:
        for row in rows:
            print(json.dumps(row.as_json()))
    else:
        print(f"{'system':10} {'chips':>9} {'M':>3} {'goodput':>8} {'uptime':>8} {'paper':>6}"
              f" {'interruptions/run':>18}")
        for r in rows:
            paper = PAPER_GOODPUT.get((r.system, r.chips, r.learners))
            print(f"{r.system:10} {r.chips:9d} {r.learners or '-':>3} {100 * r.goodput:7.1f}%"
                  f" {100 * r.uptime:7.2f}% {'' if paper is None else f'{100 * paper:.0f}%':>6}"
                  f" {r.interruptions:18.0f}")
    if args.plot:
        from diloco.apps.sim.plot import plot_goodput

        print(f"wrote {plot_goodput(rows, args.plot)}", file=sys.stderr)
    return 0


def add_bandwidth_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bandwidth", help="WAN bandwidth data-parallel and Decoupled DiLoCo need",
        description="Per-site WAN bandwidth to keep the target compute utilization; "
                    "see docs/simulator.md for the formulas.")
    p.add_argument("--params", type=_positive, default=_BW.params, help="model parameters (5e9)")
    p.add_argument("--step-seconds", type=_positive, default=_BW.step_s,
                   help="wall-clock step time (default 1)")
    p.add_argument("--sites", type=_count, default=_BW.sites, help="datacenters (default 2)")
    p.add_argument("--utilization", type=_fraction, default=_BW.utilization,
                   help="target compute utilization for data-parallel (default 0.9)")
    p.add_argument("--fragments", type=_count, default=_BW.fragments,
                   help="fragments P; one is sent per step (default 6)")
    p.add_argument("--tau", type=_positive, default=_BW.tau,
                   help="steps a fragment may be in flight (default 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object (GB/s)")
    p.set_defaults(func=run_bandwidth)


def run_bandwidth(args: argparse.Namespace) -> int:
    from diloco.apps.sim.bandwidth import bandwidth_gb_s

    result = bandwidth_gb_s(BandwidthParams(
        params=args.params, step_s=args.step_seconds, sites=args.sites,
        utilization=args.utilization, fragments=args.fragments, tau=args.tau))
    if args.json:
        print(json.dumps({k: round(v, 6) for k, v in result.items()}))
        return 0
    dp = result["dp"]
    print(f"{'method':16} {'GB/s':>9} {'Gbit/s':>9} {'dp / method':>12}")
    for name, value in result.items():
        ratio = f"{dp / value:12.1f}" if value else f"{'-':>12}"
        print(f"{name:16} {value:9.3f} {8 * value:9.2f} {ratio}")
    return 0
