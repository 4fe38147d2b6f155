"""What one pass observed, as the pure status and goodput logic read it: the syncer's answer
and the pods' state. Its own module so that operator/status/job.py and operator/status/goodput.py both read it and neither
imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco.operator.failures import capacity
from diloco.operator.render.access import Blocker


@dataclass(frozen=True)
class RegionView:
    """One region as the syncer sees it, whichever cluster its learners run in."""

    region: str
    learners: int
    active_learners: int
    tokens_merged: int
    bytes_received: int
    contributions: int
    mean_staleness: float
    step_seconds: float = 0.0  # the median of its learners' step times (0: none reported yet)


@dataclass(frozen=True)
class SyncerView:
    """The parts of the syncer's StatusReply the job status shows."""

    incarnation: str
    outer_version: int
    tokens_merged: int
    active_learners: int
    readmissions: int  # re-joins the syncer saw: joins beyond each learner's first
    regions: tuple[RegionView, ...] = ()
    refused: int = 0  # pushes refused for what they held (stale, counters, outlier, ...): work thrown away


@dataclass(frozen=True)
class Observation:
    now: float
    ready: dict[str, int] = field(default_factory=dict)  # group -> ready pods
    syncer_endpoint: str = ""
    syncer_ready: bool = False
    syncer_restarts: int = 0
    syncer: SyncerView | None = None  # None: the Status RPC did not answer
    syncer_error: str = ""  # its gRPC status code's name then (UNAVAILABLE, UNAUTHENTICATED, ...)
    exposed_address: str = ""  # where other clusters dial this syncer, once known
    blocker: Blocker | None = None  # why no pods run (a Secret the job names, a refused token)
    unschedulable: tuple[capacity.Waiting, ...] = ()  # pods waiting for capacity, longest first
    image_stuck: str | None = None  # a whole group unable to pull its image (failures.image_stuck)
    finished: tuple[str, ...] = ()  # learners that reached spec.training.steps and exited 0 (operator/status/steps.py)
    syncer_switch: tuple[str, ...] = ()  # old syncer pods a sharded standby's change waits for (reconcile/syncer_switch.py)
