"""Discrete-event goodput simulator: data-parallel, elastic data-parallel and Decoupled DiLoCo.

Interruptions of the whole chip population are one Poisson process (rate chips / MTBI); each hits
a uniformly random slice. The three systems replay the *same* interruptions (common random
numbers, so comparisons are not noise), and the cost of a run grows with the number of
interruptions, not with the number of chips. Goodput = useful chip-time / provisioned chip-time;
uptime = fraction of wall time in which some training progresses (for Decoupled DiLoCo: at least
K learners train, so the syncer can close rounds). docs/simulator.md explains every choice.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass

import numpy as np

DAY = 86_400.0
HOUR = 3_600.0

SYSTEMS = ("dp", "elastic_dp", "decoupled")

# The paper (arXiv 2604.21428, Table 2): goodput by (system, chips, learners); learners is None for dp systems.
PAPER_GOODPUT: dict[tuple[str, int, int | None], float] = {
    ("dp", 150_000, None): 0.72,
    ("elastic_dp", 150_000, None): 0.88,
    ("dp", 2_400_000, None): 0.18,
    ("elastic_dp", 2_400_000, None): 0.40,
    ("decoupled", 2_400_000, 8): 0.80,
    ("decoupled", 2_400_000, 16): 0.86,
}


@dataclass(frozen=True)
class SimParams:
    """Every knob of the model, in seconds unless the name says otherwise."""

    # The paper: one interruption per chip-year (failures, preemptions, maintenance).
    mtbi_s: float = 365.25 * DAY
    # A TPU v5e/v6e pod (256 chips) is the usual data-parallel replica of multi-slice training.
    # A failed host breaks its slice's ICI torus, so the slice is the smallest unit an elastic
    # job can drop and the unit a non-elastic job swaps for a hot spare.
    chips_per_slice: int = 256
    # Dedicated health monitoring (1 s heartbeats, dead after 5 misses, a second to act) finds
    # a dead host in seconds; the job hangs in its next collective from the moment of failure.
    detection_s: float = 6.0
    # Elastic reconfiguration: rebuild the data-parallel mesh and its collectives without the
    # lost slice and switch to a precompiled executable; no state moves (every surviving
    # replica holds the model). With detection_s an interruption costs ~18 s of global pause:
    # the ratio of the paper's elastic entries (88% at 150K, 40% at 2.4M) pins that to 13-26 s.
    reconfiguration_s: float = 12.0
    # Non-elastic restart: swap in a spare slice, relaunch every host with a warm compilation
    # cache, restore the last in-memory checkpoint from peer host RAM. Optimistic (state of the
    # art, not typical); the paper's dp row (72% / 18%) is unreachable with slower restarts.
    restart_s: float = 40.0
    # In-memory checkpoints every few steps (GEMINI, SOSP'23 checkpoints to host RAM every
    # iteration). At one interruption every 13 s (2.4M chips) minutes-apart persistent
    # checkpoints would leave dp with no progress at all.
    checkpoint_interval_s: float = 5.0
    # Time until a failed slice is healthy again: drain, host swap or reboot, burn-in checks.
    # Two and a half hours keeps ~7% of an elastic job's slices in repair (256 chips x 2.5 h
    # / 1 chip-year); this capacity loss is what keeps elastic dp below 90% even at 150K chips.
    repair_s: float = 2.5 * HOUR
    # A repaired slice rejoins at the next reconfiguration; if none comes this soon it forces
    # its own (reconfiguration_s pause). At scale failures come every seconds to minutes, so
    # this only binds for small jobs, where waiting would idle a slice for hours.
    rejoin_wait_s: float = 600.0
    # A learner that lost every slice is re-admitted by pulling the whole current model from
    # the syncer (docs/ALGORITHM.md, "The syncer"): e.g. 100B parameters in fp32 over a 100 Gbit/s link.
    state_pull_s: float = 30.0
    # Hot spares held by non-elastic dp: mean slices in repair plus this many standard
    # deviations (Poisson), so that a restart almost never waits for a repair.
    spare_sigma: float = 3.0
    # docs/ALGORITHM.md, "The syncer": minimum quorum K = 1 -- the syncer merges whenever one learner contributes.
    quorum: int = 1

    def validate(self) -> None:
        """Reject values that make the model meaningless, naming the offending field."""
        positive = {"mtbi_s": self.mtbi_s, "chips_per_slice": self.chips_per_slice}
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        for name in ("detection_s", "reconfiguration_s", "restart_s", "repair_s",
                     "rejoin_wait_s", "state_pull_s", "spare_sigma"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if not self.checkpoint_interval_s > 0:
            raise ValueError(f"checkpoint_interval_s must be positive, got {self.checkpoint_interval_s}")
        if self.quorum < 1:
            raise ValueError(f"quorum must be at least 1, got {self.quorum}")


@dataclass(frozen=True)
class Interruptions:
    """One run's interruptions: sorted times (s) and the slice each one hits."""

    chips: int
    n_slices: int
    horizon_s: float
    times: np.ndarray
    slices: np.ndarray


@dataclass(frozen=True)
class Outcome:
    """Goodput and uptime of one run, both fractions of the run."""

    goodput: float
    uptime: float


def n_slices(chips: int, params: SimParams) -> int:
    """Slices of (about) chips_per_slice chips; every slice has chips / n_slices chips."""
    return max(1, round(chips / params.chips_per_slice))


def sample_interruptions(chips: int, days: float, params: SimParams,
                         rng: np.random.Generator) -> Interruptions:
    """Poisson process of rate chips/MTBI over the run, each event on a uniform random slice."""
    if chips <= 0 or days <= 0:
        raise ValueError(f"chips and days must be positive, got {chips} and {days}")
    horizon = days * DAY
    count = rng.poisson(chips * horizon / params.mtbi_s)
    times = np.sort(rng.uniform(0.0, horizon, count))
    n = n_slices(chips, params)
    return Interruptions(chips, n, horizon, times, rng.integers(0, n, count))


def _stopped_time(starts: list[float], ends: list[float], horizon: float) -> float:
    """Total length of disjoint [start, end) intervals clipped to the run."""
    if not starts:
        return 0.0
    s, e = np.asarray(starts), np.minimum(np.asarray(ends), horizon)
    return float(np.clip(e - s, 0.0, None).sum())


def spare_slices(chips: int, params: SimParams) -> int:
    """Hot-spare slices dp must hold: mean slices in repair + spare_sigma Poisson deviations."""
    in_repair = chips * params.repair_s / params.mtbi_s  # failures per second x repair time
    return min(n_slices(chips, params) - 1,
               math.ceil(in_repair + params.spare_sigma * math.sqrt(in_repair)))


def simulate_dp(ev: Interruptions, params: SimParams) -> Outcome:
    """Data-parallel without elasticity: every interruption stops the whole job.

    The job hangs at the failure, notices it detection_s later and restarts (restart_s) from
    its last checkpoint, losing the progress since then. The restart swaps every slice that
    failed before the job resumes (failures during a restart are absorbed), but it must wait
    while more slices are in repair than there are spares. The spares idle, so they count as
    provisioned but not useful.
    """
    spares = spare_slices(ev.chips, params)
    failed = ev.times.tolist()
    repaired = (ev.times + params.repair_s).tolist()
    hits = ev.times[ev.slices >= spares].tolist()  # slices [0, spares) play the spare pool
    det, ckpt = params.detection_s, params.checkpoint_interval_s
    resume, progress, stopped, i = 0.0, 0.0, 0.0, 0
    while i < len(hits):
        t = hits[i]
        run = t - resume
        progress += run - run % ckpt
        start = t + det
        while True:  # wait until the slices in repair fit in the spare pool
            done = bisect_right(repaired, start)
            excess = bisect_right(failed, start) - done - spares
            if excess <= 0:
                break
            start = repaired[done + excess - 1]
        resume = start + params.restart_s
        stopped += min(resume, ev.horizon_s) - t
        i = bisect_left(hits, resume, i + 1)
    progress += max(0.0, ev.horizon_s - resume)  # the run ends without a failure: nothing lost
    job_fraction = (ev.n_slices - spares) / ev.n_slices
    return Outcome(progress * job_fraction / ev.horizon_s, 1.0 - stopped / ev.horizon_s)


def _elastic_job(times: list[float], slices: list[int], size: int, horizon: float,
                 p: SimParams) -> tuple[float, list[float], list[float]]:
    """One elastic job (elastic dp, or one Decoupled learner) on `size` slices.

    A failure in a training slice stops the job for detection + reconfiguration; failures
    during a stop are absorbed by it. The slice is out for repair_s, then rejoins at the next
    reconfiguration (or forces one after rejoin_wait_s). A job left with no slice is down until
    a slice is repaired, then re-admitted after reconfiguration + state pull.
    Returns useful slice-seconds and the disjoint [start, end) intervals of no training.
    """
    det, rcf, rep, wait = p.detection_s, p.reconfiguration_s, p.repair_s, p.rejoin_wait_s
    out = bytearray(size)
    waiting: deque[tuple[float, int]] = deque()  # slices out, in order of repair completion
    n_in, resume, useful = size, 0.0, 0.0
    down_since: float | None = None
    starts: list[float] = []
    ends: list[float] = []

    def rejoin(upto: float) -> int:
        joined = 0
        while waiting and waiting[0][0] <= upto:
            out[waiting.popleft()[1]] = 0
            joined += 1
        return joined

    for t, s in zip([*times, horizon], [*slices, -1]):
        while waiting:  # rejoin or re-admission stops due before t
            ready = waiting[0][0]
            at = max(ready if down_since is not None else ready + wait, resume)
            if at >= t:
                break
            useful += (at - resume) * n_in
            start = at if down_since is None else down_since
            extra = 0.0 if down_since is None else p.state_pull_s
            n_in += rejoin(at)
            resume, down_since = at + rcf + extra, None
            starts.append(start)
            ends.append(resume)
        if s < 0 or out[s]:
            continue  # the end of the run, or a failure on a slice already out of the job
        out[s] = 1
        waiting.append((t + rep, s))
        if down_since is not None:
            continue
        if t >= resume:  # training: this failure stops the job
            useful += (t - resume) * n_in
            n_in -= 1
            if n_in == 0:
                down_since, resume = t, t
                continue
            n_in += rejoin(t + det)
            resume = t + det + rcf
            starts.append(t)
            ends.append(resume)
        else:  # absorbed by the stop in progress
            n_in -= 1
            if n_in == 0:
                down_since = resume
    if down_since is None and resume < horizon:
        useful += (horizon - resume) * n_in
    elif down_since is not None:
        starts.append(down_since)
        ends.append(horizon)
    return useful, starts, ends


def simulate_elastic(ev: Interruptions, params: SimParams) -> Outcome:
    """Elastic data-parallel: one elastic job on every slice; pauses are global."""
    useful, starts, ends = _elastic_job(ev.times.tolist(), ev.slices.tolist(), ev.n_slices,
                                        ev.horizon_s, params)
    return Outcome(useful / (ev.n_slices * ev.horizon_s),
                   1.0 - _stopped_time(starts, ends, ev.horizon_s) / ev.horizon_s)


def learner_of_slice(count: int, learners: int) -> np.ndarray:
    """Contiguous, near-equal blocks of `count` slices per learner (sizes differ by at most one)."""
    return np.arange(count) * learners // count


def simulate_decoupled(ev: Interruptions, learners: int, params: SimParams) -> Outcome:
    """Decoupled DiLoCo: M independent elastic learners; only the hit learner stops."""
    if not 1 <= learners <= ev.n_slices:
        raise ValueError(f"learners must be between 1 and the {ev.n_slices} slices, got {learners}")
    if params.quorum > learners:
        raise ValueError(f"quorum {params.quorum} exceeds learners {learners}")
    owner = learner_of_slice(ev.n_slices, learners)
    first = np.searchsorted(owner, np.arange(learners))  # first slice of each learner
    sizes = np.diff(np.append(first, ev.n_slices))
    hit = owner[ev.slices]
    order = np.argsort(hit, kind="stable")  # stable: times stay sorted within each learner
    bounds = np.searchsorted(hit[order], np.arange(learners + 1))
    useful = 0.0
    edges: list[np.ndarray] = []
    for m in range(learners):
        idx = order[bounds[m]:bounds[m + 1]]
        u, starts, ends = _elastic_job(ev.times[idx].tolist(), (ev.slices[idx] - first[m]).tolist(),
                                       int(sizes[m]), ev.horizon_s, params)
        useful += u
        edges.append(np.array([starts, ends]))
    return Outcome(useful / (ev.n_slices * ev.horizon_s),
                   _quorum_uptime(edges, learners - params.quorum, ev.horizon_s))


def _quorum_uptime(edges: list[np.ndarray], max_stopped: int, horizon: float) -> float:
    """Fraction of the run in which at most max_stopped learners are stopped."""
    both = np.concatenate(edges, axis=1) if edges else np.zeros((2, 0))
    times = np.minimum(np.concatenate([both[0], both[1]]), horizon)
    steps = np.concatenate([np.ones(both.shape[1]), -np.ones(both.shape[1])])
    order = np.argsort(times, kind="stable")
    times, stopped = times[order], np.cumsum(steps[order])
    spans = np.diff(np.append(times, horizon))
    return 1.0 - float(spans[stopped > max_stopped].sum()) / horizon


@dataclass(frozen=True)
class Row:
    """One line of the sweep, averaged over seeds; learners is None for the dp systems."""

    system: str
    chips: int
    learners: int | None
    goodput: float
    uptime: float
    interruptions: float

    def as_json(self) -> dict[str, object]:
        return {"system": self.system, "chips": self.chips, "learners": self.learners,
                "goodput": round(self.goodput, 4), "uptime": round(self.uptime, 4),
                "interruptions": round(self.interruptions)}


def sweep(chips: list[int], learners: list[int], seeds: int, days: float,
          params: SimParams, systems: tuple[str, ...] = SYSTEMS) -> list[Row]:
    """Every system at every chip count (and every M for decoupled), mean over seeds."""
    params.validate()
    rows: list[Row] = []
    for n in chips:
        runs: dict[tuple[str, int | None], list[Outcome]] = {}
        events = 0
        for seed in range(seeds):
            ev = sample_interruptions(n, days, params, np.random.default_rng([seed, n]))
            events += ev.times.size
            if "dp" in systems:
                runs.setdefault(("dp", None), []).append(simulate_dp(ev, params))
            if "elastic_dp" in systems:
                runs.setdefault(("elastic_dp", None), []).append(simulate_elastic(ev, params))
            if "decoupled" in systems:
                for m in learners:
                    runs.setdefault(("decoupled", m), []).append(simulate_decoupled(ev, m, params))
        for (system, group_count), outs in runs.items():
            rows.append(Row(system, n, group_count, float(np.mean([o.goodput for o in outs])),
                            float(np.mean([o.uptime for o in outs])), events / seeds))
    return rows
