"""The round every merge goes through (syncer/round.py), driven directly: a push's header into
the merge input, two pushes of one process in one round added, and the driver's offer -> close
-> merge -> commit -> publish on an injected clock, with no lock, no transport and no threads."""

from __future__ import annotations

import numpy as np
import pytest

from diloco.core.rounds import Contribution, Verdict
from diloco.spec import Syncer
from diloco.syncer.acceptance import Admission
from diloco.syncer.global_model import GlobalModel
from diloco.syncer.round import Round, RoundDriver, Taken, combine, contribution
from diloco.wire import pb
from tests import syncer_harness as sh

SPEC = Syncer(fragments=2, compression="fp32", broadcast_compression="fp32", outer_learning_rate=1.0, outer_momentum=0.0)


class Driven:
    """A driver over a fresh model, its clock and what it published."""

    def __init__(self, spec: Syncer = SPEC) -> None:
        self.now = 100.0
        self.model = GlobalModel(spec, sh.params(0), [0] * spec.plan_size)
        self.published: list[tuple[int, int, dict[str, np.ndarray], int]] = []
        self.driver = RoundDriver(
            model=self.model, admission=Admission(num_fragments=self.model.plan.num_fragments, max_norm_ratio=None),
            publish=lambda p, v, values, slot: self.published.append((p, v, {k: np.array(a) for k, a in values.items()}, slot)),
            clock=lambda: self.now)

    def names(self, p: int) -> tuple[str, ...]:
        return self.model.plan.fragments[p]

    def offer(self, p: int, learner: str = "a-0", *, base: int = 0, value: float = 0.5, push_id: int = 1,
              steps: int = 4, tokens: int = 2048) -> tuple[Taken, dict[str, np.ndarray]]:
        delta = {n: np.full(self.model.fragment(p)[n].shape, value, np.float32) for n in self.names(p)}
        header = pb.PushHeader(learner=learner, fragment=p, base_version=base, steps=steps, tokens=tokens, session=1,
                               push_id=push_id, slot=p, session_tokens=tokens)
        return self.driver.offer(header, delta, norm=1.0, step_time=None, received_at=self.now), delta


def test_a_header_becomes_the_merge_input_field_by_field() -> None:
    h = pb.PushHeader(learner="eu-1", fragment=3, base_version=7, steps=5, tokens=640, session=9, push_id=11, slot=13,
                      session_tokens=9_999)
    payload = {"w": np.ones(2, np.float32)}
    c = contribution(h, payload, session_tokens=1_234, received_at=5.5)
    assert (c.learner, c.fragment, c.base_version, c.steps, c.tokens, c.session, c.push_id, c.slot) == \
        ("eu-1", 3, 7, 5, 640, 9, 11, 13)
    assert c.session_tokens == 1_234 and c.received_at == 5.5 and c.payload is payload  # credited, not as claimed
    # A learner from before the shared schedule sends no push id: on schedule by definition, no slot.
    assert contribution(pb.PushHeader(learner="a-0", slot=13), {}, session_tokens=0, received_at=0.0).slot is None


def test_two_pushes_of_one_process_in_one_round_add_up() -> None:
    old: Contribution[dict[str, np.ndarray]] = Contribution(
        learner="a-0", fragment=0, base_version=3, steps=2, tokens=100, payload={"w": np.array([1.0, 2.0])},
        session_tokens=500)
    new = Contribution(learner="a-0", fragment=0, base_version=4, steps=3, tokens=150,
                       payload={"w": np.array([0.5, 0.5])}, session_tokens=650)
    both = combine(old, new)
    assert (both.base_version, both.steps, both.tokens, both.session_tokens) == (3, 5, 250, 650)
    np.testing.assert_array_equal(both.payload["w"], [1.5, 2.5])


def test_an_accepted_push_is_merged_committed_and_published_once() -> None:
    d = Driven()
    before = {n: a.copy() for n, a in d.model.fragment(0).items()}
    taken, delta = d.offer(0)
    assert taken.accepted and taken.merged_into == 1
    rounds = d.driver.merge_ready(lambda: {"a-0"})
    assert [type(r) for r in rounds] == [Round] and rounds[0].fragment == 0
    assert rounds[0].result.version == 1 and d.model.versions == [1, 0]
    assert rounds[0].closed_at == d.now
    # Θ_0 moved by lr x the one learner's outer gradient (fp32, no momentum): Θ - 1.0 * Δ.
    for n in d.names(0):
        np.testing.assert_allclose(d.model.fragment(0)[n], before[n] - delta[n], rtol=1e-6, atol=1e-6)
    [(p, version, values, slot)] = d.published
    assert (p, version, slot) == (0, 1, 0)
    for n in d.names(0):
        np.testing.assert_array_equal(values[n], d.model.fragment(0)[n])
    assert d.driver.merge_ready(lambda: {"a-0"}) == [] and len(d.published) == 1  # nothing due twice


def test_a_push_taken_while_its_fragment_merges_goes_into_the_version_after() -> None:
    d = Driven()
    d.driver.in_merge = 0  # a closed round of fragment 0 is being merged outside the lock
    taken, _ = d.offer(0)
    assert taken.merged_into == 2
    d.driver.in_merge = None
    assert d.offer(1, push_id=2)[0].merged_into == 1


def test_a_push_from_a_version_never_published_is_refused_and_changes_nothing() -> None:
    d = Driven()
    taken, _ = d.offer(0, base=5)
    assert taken.offer.verdict is Verdict.FUTURE and not taken.accepted
    assert d.driver.merge_ready(lambda: {"a-0"}, flush=True) == []
    assert d.model.versions == [0, 0] and d.published == []


@pytest.mark.parametrize("flush", [False, True])
def test_flush_closes_every_round_holding_anything(flush: bool) -> None:
    """Before the final checkpoint every round holding a push is merged, due or not."""
    d = Driven(Syncer(fragments=2, compression="fp32", broadcast_compression="fp32", quorum=2))
    d.offer(0)  # one of the quorum of two: not due
    d.offer(1, push_id=2)
    merged = d.driver.merge_ready(lambda: {"a-0", "b-0"}, flush=flush)
    assert sorted(r.fragment for r in merged) == ([0, 1] if flush else [])
    assert d.model.versions == ([1, 1] if flush else [0, 0])
