"""Counters a learner cannot lie with (syncer/counter_bounds.py).

A learner holding the job token reports, with every push, the inner steps and tokens since its
anchor and its process's cumulative trained tokens. They set the merge weight (w = tokens x
tokens/steps), the job's trained-token count (the token budget) and every learner's
learning-rate position. Here a liar pushes through the real gRPC syncer (tests/syncer_harness.py).
"""

from __future__ import annotations

import copy

import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from diloco.core.merge import token_weights
from diloco.core.schedule import JobProgress
from diloco.syncer.acceptance import Refused
from diloco.syncer.counter_bounds import RESTART_WINDOW, SLACK_CYCLES, SPEED, Counters, credit_limit
from diloco.wire import auth_metadata, pb
from tests import syncer_harness as sh

TPS = sh.TOKENS_PER_STEP
P = 2  # the harness job's fragments


@pytest.fixture
def syncer():
    h = sh.start()
    yield h
    h.close()


def honest_rounds(h: sh.Harness, rounds: int) -> None:
    """Two honest learners, each push P steps, their processes' counts one step apart per push."""
    for r in range(rounds):
        for p in range(P):
            for i, learner in enumerate(("a-0", "b-0")):
                slot = r * P + p
                assert h.push(p, h.fragment_tensors(p, 0.01 * (i + 1)), learner=learner, steps=P,
                              slot=slot, session_tokens=(slot + 1) * TPS).accepted
            h.clock.now += 10
            assert h.core.merge_ready() == [p]


def job_state(h: sh.Harness) -> tuple[dict[str, np.ndarray], list[int], int, int]:
    return (copy.deepcopy(h.core.model.params), list(h.core.model.versions), h.core.model.tokens_merged,
            h.core.job_tokens())


def refusal(fn) -> str:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # the learner re-syncs, as for an outlier
    return info.value.details()


PAST = -1  # steps one past the bound: 40 s since the liar joined, at 4x the job's 50 ms steps, plus 2 cycles


@pytest.mark.parametrize(("steps", "tokens", "why"), [
    (1, 2**62, "exceed steps x batchSize x context"),  # the weight attack: w = 2^124
    (1, TPS + 1, "exceed steps x batchSize x context"),  # one token past the bound
    (10**6, 10**6 * TPS, "inner steps since the anchor"),  # consistent, but a million steps in 40 s
    (PAST, PAST, "inner steps since the anchor"),  # one step past what 40 s allow
])
def test_a_push_with_counters_out_of_bounds_is_refused_and_nothing_moves(syncer: sh.Harness, steps: int, tokens: int,
                                                                        why: str) -> None:
    syncer.secret("liar-0")  # it joins with the others, and lies two rounds later
    honest_rounds(syncer, 2)
    params, versions, merged, job_tokens = job_state(syncer)
    honest = JobProgress(learners=2, tokens_per_step=TPS, job_tokens=job_tokens)
    position = honest.position()
    bound = syncer.core.registry.counters.steps_bound(("liar-0", 1), 0, versions[0], syncer.clock.now)
    assert bound == pytest.approx(40 / (0.05 / SPEED) + SLACK_CYCLES * P, abs=1)
    if steps == PAST:
        steps, tokens = bound + 1, (bound + 1) * TPS
    details = refusal(lambda: syncer.push(0, syncer.fragment_tensors(0, 0.01), learner="liar-0", steps=steps,
                                          tokens=tokens, slot=2 * P, session_tokens=tokens))
    assert why in details and "re-sync" in details
    syncer.clock.now += 10
    assert syncer.core.merge_ready() == []  # nothing was offered to a round
    after = job_state(syncer)
    assert after[1] == versions and after[2] == merged and after[3] == job_tokens
    assert all(np.array_equal(after[0][k], params[k]) for k in params)  # Θ bit-identical
    honest.observe(syncer.core.job_tokens())
    assert honest.position() == position  # every honest learner's learning rate stays where it was
    assert syncer.core.metrics.contributions.labels("counters")._value.get() == 1
    status = syncer.stub.Status(pb.StatusRequest(), metadata=auth_metadata(sh.TOKEN))
    assert status.contributions_refused == 1
    syncer.clock.now -= 10
    assert syncer.push(0, syncer.fragment_tensors(0, 0.01), learner="liar-0", steps=bound, slot=2 * P,
                       session_tokens=bound * TPS).accepted  # at the bound: taken


def test_a_lie_about_the_processes_trained_tokens_moves_the_count_by_at_most_its_push(syncer: sh.Harness) -> None:
    """Counters within bounds, but a cumulative count of 2^62: the push is taken (its outer
    gradient is as good as any), and the job's count moves by its own tokens at most, so the
    token budget and the learning-rate positions are not steered."""
    honest_rounds(syncer, 2)
    _, _, merged, job_tokens = job_state(syncer)
    assert syncer.push(0, syncer.fragment_tensors(0, 0.01), learner="liar-0", steps=P, slot=2 * P,
                       session_tokens=2**62).accepted
    assert syncer.core.job_tokens() == job_tokens + P * TPS
    syncer.clock.now += 10
    assert syncer.core.merge_ready() == [0]
    assert syncer.core.model.tokens_merged == merged + P * TPS
    budget = 10 * merged
    assert syncer.core.model.tokens_merged < budget  # a budget of 10x what was trained is far from reached


def test_a_fresh_joiner_is_bounded_from_its_join_and_a_rejoiner_after_a_restart_is_not() -> None:
    """Counters start at a Join; processes re-joining a syncer restored moments ago have counters
    from before it (their start is unknown here), so only the token bound applies, for a while."""
    fresh = Counters(TPS, cycle=P, started=-RESTART_WINDOW)
    fresh.observe_step("a-0", 0.1)
    fresh.join(("b-0", 7), now=100.0)
    with pytest.raises(Refused):  # 1 s since its Join at 0.1 s / 4: at most 40 steps, plus 2 cycles
        fresh.check(("b-0", 7), 0, base_version=0, steps=45, tokens=45 * TPS, now=101.0)
    fresh.check(("b-0", 7), 0, base_version=0, steps=44, tokens=44 * TPS, now=101.0)
    restarted = Counters(TPS, cycle=P, started=0.0)
    restarted.observe_step("a-0", 0.1)
    restarted.join(("b-0", 7), now=5.0)
    restarted.check(("b-0", 7), 0, base_version=0, steps=10**6, tokens=10**6 * TPS, now=6.0)
    with pytest.raises(Refused):
        restarted.check(("b-0", 7), 0, base_version=0, steps=1, tokens=2**62, now=6.0)
    with pytest.raises(Refused):  # once the window is over, from its Join
        restarted.check(("b-0", 7), 0, base_version=0, steps=10**6, tokens=10**6 * TPS, now=RESTART_WINDOW)


def test_a_merge_starts_the_counters_over_once_the_learner_holds_its_version() -> None:
    c = Counters(TPS, cycle=P, started=-RESTART_WINDOW)
    c.observe_step("a-0", 0.1)
    c.join(("a-0", 1), now=0.0)
    c.merged_into([(("a-0", 1), 50.0)], 0, version=3)
    assert c.steps_bound(("a-0", 1), 0, base_version=3, now=51.0) == 40 + SLACK_CYCLES * P  # since its merged push
    assert c.steps_bound(("a-0", 1), 0, base_version=2, now=51.0) == 2040 + SLACK_CYCLES * P  # not adopted yet
    c.join(("a-0", 2), now=60.0)  # a restarted process supersedes it
    assert c.steps_bound(("a-0", 2), 0, base_version=3, now=61.0) == 40 + SLACK_CYCLES * P
    assert ("a-0", 1) not in c.joined


def test_one_learner_cannot_move_the_step_time_the_bound_and_the_grace_window_use() -> None:
    c = Counters(TPS, cycle=P, started=0.0)
    for learner in ("a-0", "b-0", "c-0"):
        c.observe_step(learner, 0.1)
    c.observe_step("liar-0", 1e-9)
    assert c.step_median() == pytest.approx(0.1)


def test_the_bound_follows_honest_steps_that_grow_while_rounds_cannot_close() -> None:
    """Quorum 2 with one learner left, or a syncer starved of CPU: nothing merges, and an honest
    learner's pushes carry P, 2P, 3P, ... steps since the same start. Time passes with them."""
    c = Counters(TPS, cycle=4, started=-RESTART_WINDOW)
    c.join(("a-0", 1), now=0.0)
    for k in range(1, 200):
        c.observe_step("a-0", 0.05)
        c.check(("a-0", 1), 0, base_version=0, steps=4 * k, tokens=4 * k * TPS, now=4 * k * 0.05)
    with pytest.raises(Refused):  # 4x faster than it says it steps is the most believed
        c.check(("a-0", 1), 0, base_version=0, steps=10_000, tokens=10_000 * TPS, now=40.0)


def test_a_bounded_liar_gets_a_bounded_share_of_the_merge() -> None:
    """What the bounds leave a liar: SPEED x the steps an honest learner took, tokens at steps x
    batch x context. Its weight is SPEED times an honest one's, not 1e31 times (the issue's
    reproduction)."""
    honest = [(P * TPS, P)] * 2
    liar = (int(SPEED * P) * TPS, int(SPEED * P))
    weights = token_weights([t for t, _ in [*honest, liar]], [s for _, s in [*honest, liar]])
    assert weights[-1] / weights.sum() == pytest.approx(SPEED / (SPEED + 2))
    unbounded = token_weights([P * TPS, P * TPS, 2**63], [P, P, 1])
    assert unbounded[-1] / unbounded.sum() == 1.0  # what admission now refuses: the others' ~1e-31


@given(steps=st.integers(1, 10**9), extra=st.integers(-(10**6), 10**6), seconds=st.floats(0.0, 1e4),
       step=st.floats(1e-3, 10.0))
def test_counters_at_their_bounds_pass_and_past_them_are_refused(steps: int, extra: int, seconds: float,
                                                                 step: float) -> None:
    c = Counters(TPS, cycle=4, started=-RESTART_WINDOW)
    c.observe_step("a-0", step)
    c.join(("a-0", 1), now=0.0)
    tokens = steps * TPS + extra
    bound = c.steps_bound(("a-0", 1), 0, 0, seconds)
    assert bound == int(seconds / (step / SPEED)) + SLACK_CYCLES * 4
    within = steps <= bound and tokens <= steps * TPS
    try:
        c.check(("a-0", 1), 0, base_version=0, steps=steps, tokens=tokens, now=seconds)
        assert within
    except Refused as exc:
        assert not within and exc.outcome == "counters"
    assert c.merged == {}  # checking records nothing


@given(session_tokens=st.integers(0, 2**63), known=st.integers(0, 2**40), tokens=st.integers(1, 2**40))
def test_the_credit_of_one_push_is_at_most_its_tokens(session_tokens: int, known: int, tokens: int) -> None:
    vouched = credit_limit(session_tokens, known, tokens)
    assert vouched <= session_tokens and vouched - known <= tokens
    if session_tokens <= known + tokens:
        assert vouched == session_tokens  # an honest count is taken as is
