"""The plan: from a model and its regions to learners, fragments, syncer shards, WAN and goodput.

Pure arithmetic over the measured figures in apps/plan/figures.py, the bandwidth model
(apps/sim/bandwidth.py) and the goodput simulator (apps/sim/goodput.py); no I/O, randomness
only through the simulator's seeded generators, so the same inputs give the same plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from diloco.apps.plan import figures as F
from diloco.apps.plan.goodput import RegionGoodput, choose_learners, region_goodput
from diloco.apps.plan.inputs import SPEC_MAX_FRAGMENTS, PlanInput, Region
from diloco.apps.sim.bandwidth import BandwidthParams, bandwidth_gb_s

# The plan's P when the links allow it: every measured figure (BENCHMARKS §2, §5, §9) is at P = 24.
MIN_FRAGMENTS = 24
SPEC_MAX_SHARDS = 64  # spec.syncer.shards' upper bound (diloco/spec/syncer.py)
DEFAULT_CHECKPOINT_S = 30.0  # spec.syncer.checkpointIntervalSeconds' default
# A checkpoint writer busy at most a quarter of the time leaves the disk to the rest of the job.
CHECKPOINT_BUSY = 0.25

# Largest fragment (parameters) of a plan of n fragments; from the model's real tensors.
FragmentSizer = Callable[[int], float]


@dataclass(frozen=True)
class RegionPlan:
    region: Region
    learners: int
    chips: int
    up_bps: float  # bytes/s the region sends the syncer (its pushes)
    down_bps: float  # bytes/s it receives (the broadcast's deltas)
    link_bps: float
    round_trip_s: float  # one fragment: push, the syncer's chain, the delta back
    pull_s: float  # a re-admitted learner's Join over this link
    goodput: RegionGoodput
    remote: bool


@dataclass(frozen=True)
class Plan:
    inputs: PlanInput
    problems: list[str]  # what to change; non-empty: the plan cannot run as given
    limits: list[str] = field(default_factory=list)  # what binds, tightest first
    regions: list[RegionPlan] = field(default_factory=list)
    fragments: int = 0
    shards: int = 1
    shard_load: float = 0.0  # the chain's share of a slot on one shard's core
    shard_memory_b: float = 0.0
    hosts: int = 0
    fragment_params: float = 0.0  # the largest fragment one shard handles in a slot (whole tensors)
    checkpoint_b: float = 0.0
    checkpoint_interval_s: float = 0.0
    checkpoint_write_s: float = 0.0
    goodput: float = 0.0
    uptime: float = 0.0
    paper: dict[str, float] = field(default_factory=dict)  # bandwidth_gb_s at this plan's P

    @property
    def learners(self) -> int:
        return sum(r.learners for r in self.regions)

    @property
    def step_s(self) -> float:
        return min(r.region.step_s for r in self.regions)

    @property
    def period_s(self) -> float:
        """A fragment syncs every P slots."""
        return self.fragments * self.step_s


def input_problems(p: PlanInput) -> list[str]:
    """Numbers that make no plan, each naming the flag to change."""
    out = []
    if not (p.params > 0 and math.isfinite(p.params)):
        out.append(f"--params: {p.params} parameters; give a positive size such as 12e9")
    if not p.regions:
        out.append("--region: no regions; give at least one, e.g. --region name=us-east,wan-gbps=2.5")
    names = [r.name for r in p.regions]
    for name in sorted({n for n in names if names.count(n) > 1}):
        out.append(f"--region: {name!r} appears twice; give each region its own name")
    checks: list[tuple[str, float, float]] = [("step-time", 0, math.inf), ("wan-gbps", 0, math.inf),
                                              ("latency-ms", -1e-12, math.inf), ("failure-rate", -1e-12, math.inf)]
    for r in p.regions:
        values = {"step-time": r.step_s, "wan-gbps": r.wan_gbps, "latency-ms": r.latency_ms,
                  "failure-rate": r.failure_rate}
        for key, low, high in checks:
            if not (low < values[key] < high):
                out.append(f"--region {r.name}: {key}={values[key]} must be a finite number above {max(low, 0):g}")
        if r.learners is not None and r.learners < 1:
            out.append(f"--region {r.name}: learners={r.learners}; give at least 1")
        if r.chips is not None and r.chips < max(1, r.learners or 1):
            out.append(f"--region {r.name}: chips={r.chips} cannot hold {r.learners or 1} learner(s)")
    if not 0 < p.utilization < 1:
        out.append(f"--utilization: {p.utilization} must be strictly between 0 and 1 (the paper's is 0.9)")
    if not 0 < p.link_share <= 1:
        out.append(f"--link-share: {p.link_share} must be in (0, 1]")
    if p.fragments is not None and not 1 <= p.fragments <= SPEC_MAX_FRAGMENTS:
        out.append(f"--fragments: {p.fragments} must be between 1 and {SPEC_MAX_FRAGMENTS}")
    if p.syncer_region is not None and p.syncer_region not in names:
        out.append(f"--syncer-region: {p.syncer_region!r} is none of the regions ({', '.join(names)})")
    for flag, value in (("--host-cores", p.host_cores), ("--host-memory-gb", p.host_memory_gb),
                        ("--cores-per-shard", p.cores_per_shard), ("--tau", p.tau), ("--days", p.days),
                        ("--seeds", p.seeds)):
        if not value > 0:
            out.append(f"{flag}: {value} must be positive")
    return out


def _candidates(p: PlanInput) -> list[int]:
    """P to try, smallest first: the user's, else 24 and up (24, 32, 48, 64, 96, 128, ...)."""
    if p.fragments is not None:
        return [p.fragments]
    top = min(p.max_fragments, SPEC_MAX_FRAGMENTS)
    out = [v for k in range(12) for v in (MIN_FRAGMENTS * 2**k, MIN_FRAGMENTS * 2**k * 4 // 3)
           if MIN_FRAGMENTS <= v <= top]
    return sorted(set(out)) or [top]


def wire_rates(params: float, fragments: int, learners: int, step_s: float) -> tuple[float, float]:
    """(up, down) bytes/s of a region: each learner pushes 1/P of the model and receives it back
    as the broadcast's delta every step, each in the spec's default codec (figures.UP_CODEC,
    DOWN_CODEC), plus the protocol's measured overhead (BENCHMARKS §2)."""
    fragment = params / fragments
    up = learners * fragment * F.UP_BITS.value / 8 * F.PROTOCOL_OVERHEAD.value / step_s
    down = learners * fragment * F.DOWN_BITS.value / 8 * F.PROTOCOL_OVERHEAD.value / step_s
    return up, down


def shard_load(fragment_params: float, step_s: float, pushes_per_s: float) -> float:
    """The chain's share of one slot on one shard's core (1.0: the measured limit, BENCHMARKS §5)."""
    scale = fragment_params / F.REF_FRAGMENT_PARAMS.value
    return scale * (F.CHAIN_FIXED_S.value / step_s + F.CHAIN_PER_PUSH_S.value * pushes_per_s)


def max_pushes(fragment_params: float, step_s: float) -> float:
    """Pushes per second one shard keeps up with at this fragment size (shard_load = 1)."""
    scale = fragment_params / F.REF_FRAGMENT_PARAMS.value
    return (1 / scale - F.CHAIN_FIXED_S.value / step_s) / F.CHAIN_PER_PUSH_S.value


def shard_memory(params: float, shards: int) -> float:
    """Peak RSS of one shard: the process plus its share of the model (BENCHMARKS §9, §5)."""
    return F.SYNCER_FIXED_BYTES.value + F.SYNCER_BYTES_PER_PARAM.value * params / shards


def _region_rates(p: PlanInput, learners: dict[str, int], fragments: int, largest: float,
                  chain_s: float) -> dict[str, tuple[float, float, float, float]]:
    """Per region: up, down, link (bytes/s) and the largest fragment's round trip (its learners'
    pushes over the link, the syncer's chain, the deltas back)."""
    out = {}
    for r in p.regions:
        up, down = wire_rates(p.params, fragments, learners[r.name], r.step_s)
        link = r.wan_gbps * 1e9 / 8
        per = largest * F.PROTOCOL_OVERHEAD.value / 8
        transfer = learners[r.name] * per * (F.UP_BITS.value + F.DOWN_BITS.value) / link
        out[r.name] = (up, down, link, transfer + 2 * r.latency_ms / 1e3 + chain_s)
    return out


def _fits(p: PlanInput, rates: dict[str, tuple[float, float, float, float]], what: str) -> list[str]:
    """Regions whose link cannot carry the plan, or whose round trip misses tau steps, with what to change."""
    out = []
    for r in p.regions:
        up, down, link, rtt = rates[r.name]
        need = max(up, down)
        if need > p.link_share * link:
            gbps = need * 8 / 1e9 / p.link_share
            out.append(f"region {r.name}: needs {need * 8 / 1e9:.2f} Gbit/s each way at {what}, over "
                       f"{p.link_share:.0%} of its {r.wan_gbps:g} Gbit/s link; raise wan-gbps to {gbps:.2f}, "
                       "or fewer learners there, or a larger --fragments")
        elif rtt > p.tau * r.step_s:
            out.append(f"region {r.name}: the largest fragment's round trip takes {rtt:.2f} s at {what}, over "
                       f"tau x step = {p.tau * r.step_s:g} s; raise --tau to {math.ceil(rtt / r.step_s)}, "
                       "a longer step-time, or lower latency-ms")
    return out


def make_plan(p: PlanInput, largest_fragment: FragmentSizer) -> Plan:
    """The whole plan, or one whose `problems` say what to change."""
    problems = input_problems(p)
    if problems:
        return Plan(p, problems)
    home = p.syncer_region or p.regions[0].name
    chosen: dict[str, tuple[int, RegionGoodput]] = {}
    for r in p.regions:
        chosen[r.name] = (r.learners, region_goodput(p.params, r, r.learners, p)) if r.learners else \
            choose_learners(p.params, r, p)
    learners = {name: lg[0] for name, lg in chosen.items()}
    step = min(r.step_s for r in p.regions)
    pushes = sum(learners[r.name] / r.step_s for r in p.regions)
    fragments, why = 0, ["--fragments: no P fits the model's tensors"]
    for cand in _candidates(p):  # the links first: bytes per step fall as P grows
        why = _fits(p, _region_rates(p, learners, cand, p.params / cand, 0.0), f"P = {cand}")
        if not why:
            fragments = cand
            break
    if not fragments:
        return Plan(p, why)
    shards, first, top = 0, list[str](), min(SPEC_MAX_SHARDS, max(1, p.max_fragments // fragments))
    for n in range(1, top + 1):  # then the syncer: its work per slot falls as shards grow
        largest = largest_fragment(fragments * n)
        load = shard_load(p.params / (fragments * n), step, pushes)
        peak = shard_load(largest, step, pushes) * step
        mem = shard_memory(p.params, n)
        why = _fits(p, _region_rates(p, learners, fragments, largest, peak), f"P = {fragments}, {n} shard(s)")
        if load <= 1.0 and mem <= p.host_memory_gb * 1e9:
            if not why:
                shards = n
                break
            first = [f"syncer: at P = {fragments}, {n} shard(s) keep up with {pushes:.1f} pushes/s, but the largest "
                     f"fragment ({largest / 1e6:.0f}M parameters: a whole tensor, which more shards cannot split) "
                     "misses its round trip:", *why]
            break
    if not shards:
        bound = "spec.syncer.shards' maximum" if top == SPEC_MAX_SHARDS else \
            f"the model's {p.max_fragments} tensors over P = {fragments}"
        head = (f"syncer: {sum(learners.values())} learners at {pushes:.1f} pushes/s fit no syncer of up to "
                f"{top} shards ({bound}) at P = {fragments}")
        if first:
            return Plan(p, first)
        most = max_pushes(p.params / (fragments * top), step) * step
        return Plan(p, [f"{head}; they take at most {max(0, math.floor(most))} learners at {step:g} s steps: fewer "
                        "learners, longer steps, or larger hosts (--host-memory-gb)"])
    paper = bandwidth_gb_s(BandwidthParams(p.params, step, max(2, len(p.regions)), p.utilization,
                                           fragments, float(p.tau)))
    limits: list[str] = []
    frag = largest_fragment(fragments * shards)
    load = shard_load(p.params / (fragments * shards), step, pushes)
    rates = _region_rates(p, learners, fragments, frag, shard_load(frag, step, pushes) * step)
    mem = shard_memory(p.params, shards)
    per_host = max(1, min(p.host_cores // p.cores_per_shard, int(p.host_memory_gb * 1e9 // mem)))
    ckpt = F.CHECKPOINT_BYTES_PER_PARAM.value * p.params
    write_s = ckpt / shards / F.CHECKPOINT_WRITE_BPS.value
    interval = max(DEFAULT_CHECKPOINT_S, math.ceil(write_s / CHECKPOINT_BUSY / 10) * 10)
    regions = []
    for r in p.regions:
        up, down, link, rtt = rates[r.name]
        n, good = chosen[r.name]
        regions.append(RegionPlan(r, n, good.chips, up, down, link, rtt, good.pull_s, good, r.name != home))
    chips = sum(rp.chips for rp in regions)
    goodput = sum(rp.goodput.goodput * rp.chips for rp in regions) / chips
    uptime = 1.0 - math.prod(1.0 - rp.goodput.uptime for rp in regions)
    plan = Plan(p, [], limits, regions, fragments, shards, load, mem, math.ceil(shards / per_host), frag,
                ckpt, interval, write_s, goodput, uptime, paper)
    limits.extend(_limits(plan))
    return plan


def _limits(plan: Plan) -> list[str]:
    """What binds the plan, tightest first: each as a fraction of what it may use."""
    p = plan.inputs
    rows: list[tuple[float, str]] = []
    for rp in plan.regions:
        need = max(rp.up_bps, rp.down_bps) / rp.link_bps
        rows.append((need / p.link_share, f"region {rp.region.name}'s link: {need:.1%} of {rp.region.wan_gbps:g} "
                                          f"Gbit/s (the plan allows {p.link_share:.0%})"))
        if rp.goodput.goodput < p.utilization:
            rows.append((1.5, f"region {rp.region.name}'s goodput {rp.goodput.goodput:.1%} is under the "
                              f"{p.utilization:.0%} target: more learners there (smaller ones fail alone)"))
    rows.append((plan.shard_load, f"syncer shard's chain: {plan.shard_load:.0%} of a {plan.step_s:g} s slot "
                                  "on average (BENCHMARKS §5 model)"))
    worst = max(plan.regions, key=lambda rp: rp.round_trip_s / rp.region.step_s)
    rows.append((worst.round_trip_s / (p.tau * worst.region.step_s),
                 f"the largest fragment ({plan.fragment_params / 1e6:.0f}M parameters: whole tensors) round trip "
                 f"from {worst.region.name}: {worst.round_trip_s:.2f} s of tau x step = "
                 f"{p.tau * worst.region.step_s:g} s"))
    rows.append((plan.shard_memory_b / (p.host_memory_gb * 1e9),
                 f"syncer shard's memory: {plan.shard_memory_b / 1e9:.1f} GB of a {p.host_memory_gb:g} GB host"))
    if plan.learners > F.SHARD_MAX_LEARNERS_MEASURED.value:
        rows.append((1.2, f"{plan.learners} learners on each shard: more than the "
                          f"{F.SHARD_MAX_LEARNERS_MEASURED.value:g} any shard was measured with (BENCHMARKS §5)"))
    return [text for _, text in sorted(rows, key=lambda r: -r[0])]
