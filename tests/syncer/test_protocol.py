"""The asynchronous protocol on scripted timelines: shared schedule, exact rebase, tokens.

Learners here are toys whose every step adds a fixed vector to their weights, so progress
is independent of the weights and can be accounted exactly: with fp32 pushes, plain
averaging, outer lr 1 and participation scaling, the global model must end at
Θ₀ + Σ_m (steps_m · direction_m) / M when no progress is lost or counted twice.
"""

from __future__ import annotations

import numpy as np
import pytest

from diloco.apps.sim.replay import Replay, Script, toy_trainer
from diloco.spec import Syncer

SHAPES = {"embed/w": (16, 8), "l0/a": (8, 8), "l0/b": (8,), "l1/a": (8, 8), "head/w": (8, 16)}
M = 4


def directions(seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{n: (rng.standard_normal(s) * 0.01).astype(np.float32) for n, s in SHAPES.items()} for _ in range(M)]


def exact_spec(**kw: object) -> Syncer:
    base: dict[str, object] = {"fragments": 4, "compression": "fp32", "merge": "average", "token_weighting": False,
                               "outer_learning_rate": 1.0, "outer_momentum": 0.0}
    return Syncer(**{**base, **kw})  # type: ignore[arg-type]


def replay(scripts: list[Script], adoption: str = "rebase", steps: int = 100, **spec: object) -> Replay:
    r = Replay(exact_spec(**spec), {n: np.zeros(s, np.float32) for n, s in SHAPES.items()},
               toy_trainer(DIRS), scripts, steps=steps, adoption=adoption)
    r.result = r.run()  # type: ignore[attr-defined]
    return r


def progress_error(r: Replay) -> float:
    """Relative distance of Θ from the sum of every learner's progress over M."""
    expect = {n: sum(lr.steps * DIRS[lr.m][n] for lr in r.learners) / M for n in SHAPES}
    got = r.result.params  # type: ignore[attr-defined]
    return max(float(np.abs(got[n] - expect[n]).max() / np.abs(expect[n]).max()) for n in SHAPES)


DIRS = directions()
TIMELINES = {
    "in phase": [Script() for _ in range(M)],
    "out of phase": [Script(start=0.3 * m) for m in range(M)],
    "unequal speeds": [Script(step_seconds=1.0 + m) for m in range(M)],
    "a frozen learner": [Script(), Script(), Script(pauses=[(30.2, 6.5)]), Script()],
    "slow network": [Script(start=0.45 * m) for m in range(M)],
}


@pytest.mark.parametrize("timeline", sorted(TIMELINES))
def test_rebase_loses_no_progress_and_counts_none_twice(timeline: str) -> None:
    r = replay(TIMELINES[timeline])
    assert progress_error(r) < 1e-4
    assert r.result.tokens_merged == r.result.tokens_trained  # type: ignore[attr-defined]


def test_overwrite_loses_progress() -> None:
    """The first release's rule, kept as an ablation: θ_p ← Θ_p drops unmerged steps."""
    assert progress_error(replay(TIMELINES["out of phase"], adoption="overwrite")) > 0.1


def test_healthy_rounds_hold_every_learner_once_per_slot() -> None:
    r = replay(TIMELINES["out of phase"])
    rounds = r.result.rounds  # type: ignore[attr-defined]
    assert len(rounds) <= 100 + 8  # one round per slot, plus the final flush
    assert sum(n == M for n in rounds) >= 0.9 * len(rounds)


def test_a_late_joiner_fits_into_the_schedule() -> None:
    scripts = [Script(), Script(), Script(), Script(start=50.37)]
    r = replay(scripts)
    joiner = r.learners[3]
    assert joiner.schedule is not None and joiner.schedule.skipped <= 3
    # After it joined, rounds hold all four learners: it pushes in the same slots as the others.
    rounds = r.result.rounds  # type: ignore[attr-defined]
    late = rounds[55:100]
    assert sum(n == M for n in late) >= 0.9 * len(late)


def test_a_slow_learner_never_blocks_and_catches_up_by_skipping() -> None:
    scripts = [Script(), Script(), Script(), Script(step_seconds=2.0)]
    r = replay(scripts)
    fast, slow = r.learners[0], r.learners[3]
    assert fast.steps >= 95  # the job's 100 slots at the fast learners' pace
    assert 40 <= slow.steps <= 55 and slow.schedule is not None and slow.schedule.skipped >= 40
    assert progress_error(r) < 1e-4


def test_a_frozen_learner_skips_the_slots_it_missed() -> None:
    r = replay(TIMELINES["a frozen learner"])
    frozen = r.learners[2]
    assert frozen.schedule is not None and 6 <= frozen.schedule.skipped <= 12  # ~6.5 slots, plus jitter
    assert r.result.refused == 0  # type: ignore[attr-defined]


def test_kills_lose_only_unpushed_work_and_tokens_stay_exact() -> None:
    scripts = [Script(), Script(outages=[(20.5, 26.0)]), Script(), Script(outages=[(61.2, 64.0)])]
    r = replay(scripts)
    res = r.result  # type: ignore[attr-defined]
    # A kill loses at most the steps since its learner's last accepted push of each fragment.
    assert res.tokens_trained - 2 * 8 <= res.tokens_merged < res.tokens_trained


def test_a_learner_down_does_not_make_the_others_decay_ahead_of_the_job() -> None:
    # Learner 3 is down for 40 slots: the others keep filling slots, so slots run ahead of
    # the job's tokens; every learner's learning rate, the re-joiner's too, follows the tokens.
    scripts = [Script(), Script(), Script(), Script(outages=[(20.5, 60.5)])]
    r = replay(scripts)
    res = r.result  # type: ignore[attr-defined]
    job_steps = res.tokens_merged / M  # the toy trains one token a step
    for lr in r.learners:
        assert lr.progress is not None and lr.schedule is not None
        assert abs(lr.progress.position() - job_steps) <= 3
        assert lr.progress.position() <= lr.schedule.slot - 5  # a slot-driven schedule was ~10 ahead


def test_stale_downweighting_is_an_absolute_factor() -> None:
    from diloco.core.rounds import Closed, Contribution
    from diloco.syncer.global_model import GlobalModel

    spec = exact_spec(fragments=1)
    model = GlobalModel.fresh(spec, {"w": np.zeros(4, np.float32)})
    one = {"w": np.ones(4, np.float32)}
    model.apply(Closed(0, 0, [Contribution(learner="a", fragment=0, base_version=0, steps=1, tokens=1, payload=one)],
                       [0.5], 0.0))
    assert np.allclose(model.params["w"], -0.5)  # half of a lone stale push, not renormalised away


class Watched(Replay):
    """Checks, after each learner step, that every fragment a learner holds at the published
    version is anchored on the publisher's view V_p itself, bit for bit (what the product's
    learners decode from the broadcast's bytes)."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.matched = self.mismatched = 0

    def _on_step(self, m: int, life: int) -> None:
        super()._on_step(m, life)
        ledger = self.learners[m].ledger
        for p, head in self.publisher.heads.items():
            if ledger is not None and ledger.books[p].version == head.version:
                same = all(np.array_equal(ledger.books[p].anchor[n], v) for n, v in head.view.items())
                self.matched += same
                self.mismatched += not same


@pytest.mark.parametrize("codec,bound", [("fp32", 0.0), ("int8", 1e-3), ("int4", 2e-2), ("nf4", 2e-2)])
def test_the_broadcast_codec_moves_what_learners_hold_not_the_global_model(codec: str, bound: float) -> None:
    """Learners adopt the broadcast's view V_p, within the codec's error of Θ_p (exact in fp32),
    and push progress against it, so Θ still ends at every learner's progress over M."""
    r = Watched(exact_spec(broadcast_compression=codec), {n: np.zeros(s, np.float32) for n, s in SHAPES.items()},
                toy_trainer(DIRS), TIMELINES["out of phase"], steps=100)
    r.result = r.run()  # type: ignore[attr-defined]
    assert progress_error(r) < 1e-4
    assert r.matched > 100 and r.mismatched == 0
    theta = r.result.params  # type: ignore[attr-defined]
    gap = max(float(np.abs(v - theta[n]).max() / np.abs(theta[n]).max())
              for head in r.publisher.heads.values() for n, v in head.view.items())
    assert gap <= bound and (gap > 0) == (codec != "fp32")
