"""A region's goodput at its failure rate: the goodput simulator run on that region's chips.

Each region's learners fail on their own chips, at that region's rate, so the simulator
(apps/sim/goodput.py) runs once per region with the region's chips, learners, interruption
rate and the time a re-admitted learner needs to pull the model over its link. It models the
learners only: the syncer and the WAN are assumed to keep up, which the rest of the plan checks.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import numpy as np

from diloco.apps.plan import figures as F
from diloco.apps.plan.inputs import PlanInput, Region
from diloco.apps.sim.goodput import DAY, SimParams, sample_interruptions, simulate_decoupled

YEAR_S = 365.25 * DAY
MAX_LEARNERS = 64  # searched up to here: beyond the 48 learners a shard was measured with (BENCHMARKS §5)
SLICE = SimParams().chips_per_slice  # the simulator's 256-chip slice: one learner's unit when chips are not given


@dataclass(frozen=True)
class RegionGoodput:
    chips: int
    learners: int
    goodput: float
    uptime: float  # some learner of the region trains
    pull_s: float  # a re-admitted learner's Join, paced by joinBytesPerSecond and the link
    interruptions: float  # per simulated run


def pull_seconds(params: float, wan_gbps: float) -> float:
    """A Join pulls Θ in fp32 (BENCHMARKS §9) at the slower of the link and the syncer's pacing
    (spec.syncer.joinBytesPerSecond, BENCHMARKS §5)."""
    rate = min(wan_gbps * 1e9 / 8, F.JOIN_BYTES_PER_SECOND.value)
    return params * F.JOIN_BYTES_PER_PARAM.value / rate


def region_goodput(params: float, region: Region, learners: int, plan: PlanInput) -> RegionGoodput:
    """The simulator's mean over plan.seeds runs of plan.days for this region's learners."""
    chips = region.chips or learners * SLICE
    pull = pull_seconds(params, region.wan_gbps)
    if region.failure_rate == 0:
        return RegionGoodput(chips, learners, 1.0, 1.0, pull, 0.0)
    sim = replace(SimParams(), mtbi_s=YEAR_S / region.failure_rate, state_pull_s=pull,
                  chips_per_slice=max(1, min(SLICE, chips // learners)))
    sim.validate()
    good, up, events = [], [], 0
    for seed in range(plan.seeds):
        # Regions fail independently: each its own stream, fixed by its name (the same plan, the same figures).
        rng = np.random.default_rng([seed, chips, zlib.crc32(region.name.encode())])
        ev = sample_interruptions(chips, plan.days, sim, rng)
        out = simulate_decoupled(ev, min(learners, ev.n_slices), sim)
        good.append(out.goodput)
        up.append(out.uptime)
        events += ev.times.size
    return RegionGoodput(chips, learners, float(np.mean(good)), float(np.mean(up)), pull, events / plan.seeds)


def choose_learners(params: float, region: Region, plan: PlanInput) -> tuple[int, RegionGoodput]:
    """The fewest learners (1, 2, 4, ...) whose goodput reaches the target utilization: fewer
    learners mean less WAN and syncer work; more mean a failure stops a smaller part. Without
    chips, one learner (on one slice)."""
    if region.chips is None:
        return 1, region_goodput(params, region, 1, plan)
    most = min(MAX_LEARNERS, max(1, region.chips // SLICE))  # a learner holds at least one slice
    best: tuple[int, RegionGoodput] | None = None
    n = 1
    while n <= most:
        good = region_goodput(params, region, n, plan)
        if good.goodput >= plan.utilization:
            return n, good
        if best is None or good.goodput > best[1].goodput:
            best = (n, good)
        n *= 2
    assert best is not None
    return best
