"""The learner loop's one place where pushes go out (trainer/learner.py, `_around_step`).

The step boundary's host work (adopt, send the due pushes) goes before the next step's dispatch
where the host work would share the step's core, behind it where it has a core of its own; a
step that cannot be dispatched (bad input) still gets its boundary.
"""

from __future__ import annotations

from typing import Any

import pytest

from diloco.trainer.learner import _around_step
from diloco.trainer.sync.messages import Updates


class Recorder:
    """The two of Fragments' operations a boundary uses, recording their order."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def at_boundary(self, u: Updates) -> list[str]:
        self.log.append("adopt")
        return ["push"]

    def send(self, waiting: list[str]) -> None:
        self.log.extend(f"send {w}" for w in waiting)


@pytest.mark.parametrize(("overlap", "order"), [(False, ["adopt", "send push", "step"]),
                                                (True, ["step", "adopt", "send push"])])
@pytest.mark.parametrize("result", ["stepped", None], ids=["a step", "bad input"])
def test_the_boundary_goes_before_the_step_or_behind_it(overlap: bool, order: list[str], result: Any) -> None:
    log: list[str] = []

    def dispatch() -> Any:
        log.append("step")
        return result

    got = _around_step(Recorder(log), Updates(None, {}, [], []), dispatch, overlap=overlap)  # type: ignore[arg-type]
    assert got == result
    assert log == order  # once each: one boundary, one dispatch, whatever the order
