"""The learner's start timeline (trainer/timeline.py): each phase once, reported once, at the first
acknowledged push."""

from __future__ import annotations

from typing import Any

from diloco.contract import Event
from diloco.trainer.timeline import Timeline, process_age


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_phases_are_seconds_since_the_process_started_and_reported_once_at_the_first_ack() -> None:
    clock, said = Clock(), []

    def emit(event: str, **fields: Any) -> None:
        said.append((event, fields))

    timeline = Timeline(clock, age=0.5)  # the interpreter and imports took 0.5 s before run()
    clock.now += 1.0
    timeline.mark("configured")
    clock.now += 2.0
    timeline.mark("compiled")
    timeline.mark("compiled")  # a phase ends once: a second mark is ignored
    clock.now += 0.25
    timeline.mark("first_step")
    timeline.acked(0.0, emit)  # nothing acknowledged yet: nothing said
    assert said == []
    clock.now += 0.25
    timeline.acked(0.05, emit)
    timeline.acked(0.10, emit)  # later acknowledgements say nothing more
    assert said == [(Event.TRAINING, {"imports": 0.5, "configured": 1.5, "compiled": 3.5, "first_step": 3.75,
                                      "first_push_accepted": 4.0})]


def test_this_process_has_an_age() -> None:
    age = process_age()
    assert age is not None and 0.0 <= age < 24 * 3600
