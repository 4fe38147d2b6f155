"""Counters a learner cannot lie with (syncer/admission.py `Counters`, `credit_limit`).

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
from diloco.syncer.admission import STEPS_RATIO, Counters, Refused, credit_limit
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
                              slot=slot, trained_tokens=(slot + 1) * TPS).accepted
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


@pytest.mark.parametrize(("steps", "tokens", "why"), [
    (1, 2**62, "exceed steps x batchSize x context"),  # the weight attack: w = 2^124
    (1, TPS + 1, "exceed steps x batchSize x context"),  # one token past the bound
    (10**6, 10**6 * TPS, "inner steps since the anchor"),  # consistent, but a million steps in one cycle
    (int(STEPS_RATIO * P) + 1, (int(STEPS_RATIO * P) + 1) * TPS, "inner steps since the anchor"),
])
def test_a_push_with_counters_out_of_bounds_is_refused_and_nothing_moves(syncer: sh.Harness, steps: int, tokens: int,
                                                                        why: str) -> None:
    honest_rounds(syncer, 2)
    params, versions, merged, job_tokens = job_state(syncer)
    honest = JobProgress(learners=2, tokens_per_step=TPS, tokens=job_tokens)
    position = honest.position()
    details = refusal(lambda: syncer.push(0, syncer.fragment_tensors(0, 0.01), learner="liar-0", steps=steps,
                                          tokens=tokens, slot=2 * P, trained_tokens=tokens))
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
    assert status.contributions_refused == 1 and status.max_steps_ratio >= steps / P


def test_a_lie_about_the_processes_trained_tokens_moves_the_count_by_at_most_its_push(syncer: sh.Harness) -> None:
    """Counters within bounds, but a cumulative count of 2^62: the push is taken (its outer
    gradient is as good as any), and the job's count moves by its own tokens at most, so the
    token budget and the learning-rate positions are not steered."""
    honest_rounds(syncer, 2)
    _, _, merged, job_tokens = job_state(syncer)
    assert syncer.push(0, syncer.fragment_tensors(0, 0.01), learner="liar-0", steps=P, slot=2 * P,
                       trained_tokens=2**62).accepted
    assert syncer.core.job_tokens() == job_tokens + P * TPS
    syncer.clock.now += 10
    assert syncer.core.merge_ready() == [0]
    assert syncer.core.model.tokens_merged == merged + P * TPS
    budget = 10 * merged
    assert syncer.core.model.tokens_merged < budget  # a budget of 10x what was trained is far from reached


def test_the_bound_follows_honest_steps_that_grow_while_rounds_cannot_close() -> None:
    """Quorum 2 with one learner left: nothing merges, so its pushes carry P, 2P, 3P, ... steps
    since the same anchor. The median grows with them: never refused."""
    counters = Counters(TPS, cycle=4, num_fragments=4)
    for k in range(1, 60):
        counters.check(0, 4 * k, 4 * k * TPS)
        counters.taken(0, 4 * k)
    with pytest.raises(Refused):  # a jump far past the recent pushes is still refused
        counters.check(0, 10_000, 10_000 * TPS)


def test_a_bounded_liar_gets_at_most_a_bounded_share_of_the_merge() -> None:
    """What the bounds leave a liar: steps at the bound, tokens at steps x batch x context. Its
    weight is STEPS_RATIO times an honest learner's, not 1e31 times (the issue's reproduction)."""
    honest = [(P * TPS, P)] * 2
    liar = (int(STEPS_RATIO * P) * TPS, int(STEPS_RATIO * P))
    weights = token_weights([t for t, _ in [*honest, liar]], [s for _, s in [*honest, liar]])
    assert weights[-1] / weights.sum() == pytest.approx(STEPS_RATIO / (STEPS_RATIO + 2))
    unbounded = token_weights([P * TPS, P * TPS, 2**63], [P, P, 1])
    assert unbounded[-1] / unbounded.sum() == 1.0  # what admission now refuses: the others' ~1e-31


@given(steps=st.integers(1, 10**9), extra=st.integers(-(10**6), 10**6), history=st.lists(st.integers(1, 40), max_size=70))
def test_counters_at_their_bounds_pass_and_past_them_are_refused(steps: int, extra: int, history: list[int]) -> None:
    counters = Counters(TPS, cycle=4, num_fragments=1)
    for h in history:
        counters.taken(0, h)
    tokens = steps * TPS + extra
    within = steps <= counters.steps_bound(0) and tokens <= steps * TPS
    before = list(counters.steps[0])
    try:
        counters.check(0, steps, tokens)
        assert within
    except Refused as exc:
        assert not within and exc.outcome == "counters"
    assert list(counters.steps[0]) == before  # checking records nothing


@given(trained=st.integers(0, 2**63), known=st.integers(0, 2**40), tokens=st.integers(1, 2**40))
def test_the_credit_of_one_push_is_at_most_its_tokens(trained: int, known: int, tokens: int) -> None:
    vouched = credit_limit(trained, known, tokens)
    assert vouched <= trained and vouched - known <= tokens
    if trained <= known + tokens:
        assert vouched == trained  # an honest count is taken as is
