"""The replay runs the syncer's round: a scripted replay's arrivals, fed to a real SyncerCore
(pushes as bytes through `admit`, the same subscriptions, the same clock), give the same
merges, bit for bit (syncer/round.py RoundDriver is the one both run)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from diloco.apps.sim.replay import Replay, Script, Sent, toy_trainer
from diloco.spec import Syncer
from diloco.syncer.core import SyncerCore
from diloco.syncer.global_model import GlobalModel
from diloco.syncer.metrics import SyncerMetrics
from diloco.wire import pb

SHAPES = {"embed/w": (16, 8), "l0/a": (8, 8), "l0/b": (8,), "l1/a": (8, 8), "head/w": (8, 16)}
Merge = tuple[int, int, dict[str, np.ndarray], int]  # fragment, version, Θ_p, slot


class Recorded(Replay):
    """A replay that records what reaches its syncer (joins, kills, pushes, ticks, the final
    flush) in order, with the virtual time, and every merge its driver publishes."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.trace: list[tuple[float, str, tuple[Any, ...]]] = []
        self.merges: list[Merge] = []

    def _on_join(self, m: int) -> None:
        if not self.learners[m].done:
            self.trace.append((self.now, "join", (f"l{m}", self.learners[m].life + 1)))
        super()._on_join(m)

    def _on_kill(self, m: int) -> None:
        if self.learners[m].alive:
            self.trace.append((self.now, "kill", (f"l{m}",)))
        super()._on_kill(m)

    def _on_arrive(self, m: int, life: int, sent: Sent) -> None:
        if self.killed_at.get((m, life), float("inf")) >= sent.at:  # what the replay's syncer receives
            header = pb.PushHeader.FromString(sent.header.SerializeToString())
            self.trace.append((self.now, "arrive", (header, bytes(sent.blob))))
        super()._on_arrive(m, life, sent)

    def _on_tick(self) -> None:
        self.trace.append((self.now, "tick", ()))
        super()._on_tick()

    def _merge(self, flush: bool = False) -> None:
        if flush:
            self.trace.append((self.now, "flush", ()))
        super()._merge(flush)

    def _publish(self, p: int, version: int, values: Mapping[str, np.ndarray], slot: int) -> None:
        self.merges.append((p, version, {n: np.array(v) for n, v in values.items()}, slot))
        super()._publish(p, version, values, slot)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def syncer_merges(spec: Syncer, params0: dict[str, np.ndarray], trace: list[tuple[float, str, tuple[Any, ...]]]
                  ) -> tuple[SyncerCore, list[Merge]]:
    """The same arrivals through a real SyncerCore: Join opens a session and a subscription
    (the learner is active), a kill ends the subscription, a push is admitted from its bytes,
    and the merge thread's `merge_ready` runs after each push and at each tick, as the replay's
    syncer does."""
    clock = Clock()
    core = SyncerCore(spec=spec, model=GlobalModel.fresh(spec, params0), store=None, metrics=SyncerMetrics(),
                      clock=clock, tokens_per_step=1)
    merges: list[Merge] = []
    publish = core.driver.publish

    def recorded(p: int, version: int, values: Mapping[str, np.ndarray], slot: int) -> None:
        merges.append((p, version, {n: np.array(v) for n, v in values.items()}, slot))
        publish(p, version, values, slot)

    core.driver.publish = recorded
    secrets: dict[str, bytes] = {}
    subscriptions: dict[str, contextlib.AbstractContextManager[None]] = {}
    for t, kind, args in trace:
        clock.now = t
        if kind == "join":
            learner, session = args
            secrets[learner] = core.open_session(learner, process=session, supersede=True)
            subscriptions[learner] = core.subscribed(learner)
            subscriptions[learner].__enter__()
        elif kind == "kill":
            subscriptions.pop(args[0]).__exit__(None, None, None)
        elif kind == "arrive":
            h, blob = args
            header = pb.PushHeader.FromString(h.SerializeToString())
            header.incarnation, header.session_secret = core.incarnation, secrets[h.learner]
            core.admit(header, lambda blob=blob: memoryview(blob))
            core.merge_ready()
        elif kind == "tick":
            core.merge_ready()
        else:
            core.merge_ready(flush=True)
    return core, merges


UNEQUAL = [Script(step_seconds=1.0), Script(step_seconds=1.7, start=0.2), Script(start=0.45, outages=[(9.3, 13.0)]),
           Script(step_seconds=0.8, start=0.1)]
# The product's codecs (int4 pushes, int4 broadcast), Nesterov and token weighting, quorum 2.
SPEC: dict[str, object] = {"fragments": 4, "quorum": 2}
TIMELINES: dict[str, tuple[list[Script], dict[str, object]]] = {
    "steady": ([Script(), Script(start=0.3), Script(start=0.6)], SPEC),
    "unequal speeds and a kill": (UNEQUAL, SPEC),
    "a frozen learner": ([Script(), Script(pauses=[(6.2, 4.5)]), Script(start=0.25)], SPEC),
    "stale pushes refused": (UNEQUAL, {**SPEC, "staleness": {"max_versions": 2, "policy": "drop"}}),
}


@pytest.mark.parametrize("timeline", sorted(TIMELINES))
def test_replay_merges_equal_the_syncers_bit_for_bit(timeline: str) -> None:
    scripts, settings = TIMELINES[timeline]
    spec = Syncer(**settings)  # type: ignore[arg-type]
    rng = np.random.default_rng(7)
    params0 = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    directions = [{n: (rng.standard_normal(s) * 0.01).astype(np.float32) for n, s in SHAPES.items()} for _ in scripts]
    replay = Recorded(spec, params0, toy_trainer(directions), scripts, steps=30)
    result = replay.run()

    core, merges = syncer_merges(spec, params0, replay.trace)

    assert len(replay.merges) > 20 and len(merges) == len(replay.merges)
    for (p, v, values, slot), (q, w, theirs, their_slot) in zip(replay.merges, merges):
        assert (p, v, slot) == (q, w, their_slot)
        assert values.keys() == theirs.keys() and all(np.array_equal(values[n], theirs[n]) for n in values)
    assert core.model.versions == replay.model.versions
    assert all(np.array_equal(core.model.params[n], result.params[n]) for n in SHAPES)
    assert core.model.tokens_merged == result.tokens_merged and core.tallies.refused == result.refused
    if timeline == "stale pushes refused":
        assert result.refused > 0
