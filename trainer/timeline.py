"""A (re)start's timeline, reported once: what a learner spends before it adds to the model.

A lost learner costs the job its share of compute from the kill until the syncer accepts its
next push, so that interval is the re-admission badput the paper's design keeps small. The
learner marks each phase (the interpreter and imports before `run`, configuring, compiling,
joining, the first step) and, when the syncer first acknowledges a push, prints them as one
`training` event: seconds since the process started, so a slow start names its phase.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from diloco.contract import Event


def process_age() -> float | None:
    """Seconds since this process was started (Linux /proc), None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))


class Timeline:
    """`mark(phase)` as each phase ends; `acked(...)` reports the whole once, at the first
    acknowledged push. Times are seconds since the process started (the interpreter's start
    and imports included: `imports`, the age at `run`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, age: float | None = None) -> None:
        self.clock = clock
        age = process_age() if age is None else age
        self.origin = clock() - (age or 0.0)
        self.marks: dict[str, float] = {"imports": round(age or 0.0, 3)}
        self.reported = False

    def mark(self, phase: str) -> None:
        self.marks.setdefault(phase, round(self.clock() - self.origin, 3))

    def acked(self, acked_seconds: float, emit: Callable[..., Any]) -> None:
        """Report once, when the syncer has first accepted some of this learner's training."""
        if self.reported or acked_seconds <= 0:
            return
        self.mark("first_push_accepted")
        self.reported = True
        emit(Event.TRAINING, **self.marks)
