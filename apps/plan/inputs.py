"""What the user gives the plan: the model's size and its regions, with the targets to plan for.

Apart from the plan (model.py) so that the parts it calls, as the goodput simulation
(goodput.py), read the inputs without importing the plan that imports them.
"""

from __future__ import annotations

from dataclasses import dataclass

SPEC_MAX_FRAGMENTS = 4096  # spec.syncer.fragments' upper bound


@dataclass(frozen=True)
class Region:
    """One region's learners and link to the syncer's region, as the user gives them."""

    name: str
    step_s: float = 1.0  # the paper's example step
    wan_gbps: float = 2.5  # the middle of the paper's 2-5 Gbit/s links
    latency_ms: float = 30.0  # a US cross-region round trip's one way, roughly
    failure_rate: float = 1.0  # interruptions per chip-year: the paper's assumption
    learners: int | None = None  # None: as few as reach the target goodput
    chips: int | None = None  # None: one 256-chip slice (the simulator's) per learner


@dataclass(frozen=True)
class PlanInput:
    params: float
    regions: tuple[Region, ...]
    utilization: float = 0.9  # the paper's compute-utilization target (its bandwidth example)
    fragments: int | None = None  # P fixed by the user; None: the smallest the links carry
    link_share: float = 0.8  # plan a link to at most 80%: other traffic and TCP need the rest
    tau: int = 2  # spec.syncer.graceWindow.tau's default
    host_cores: int = 32  # a common CPU host
    host_memory_gb: float = 256.0  # the same host's memory
    cores_per_shard: int = 1  # BENCHMARKS §5 measured one shard per core
    syncer_region: str | None = None  # None: the first region hosts the syncer
    days: float = 7.0  # simulated days: long enough for failures at a few thousand chips
    seeds: int = 2  # the simulator's runs per figure (common random numbers keep them steady)
    max_fragments: int = SPEC_MAX_FRAGMENTS  # P x shards cannot exceed the model's tensors
