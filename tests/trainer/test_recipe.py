"""The one training recipe (trainer/recipe.py): its learning-rate schedule."""

from __future__ import annotations

import optax
import pytest

from diloco.spec import Training
from diloco.trainer.recipe import learning_rate

SLOTS = [0, 1, 49, 50, 51, 700, 1499, 1500, 1501, 4095, 4096, 4097, 12295, 10**6]


def test_the_learning_rate_is_optax_schedule_and_the_same_whichever_position_is_asked_first() -> None:
    tr = Training(learning_rate=6e-3, warmup_steps=50, decay_steps=1500)
    reference = optax.warmup_cosine_decay_schedule(0.0, 6e-3, 50, 1500, 6e-3 * tr.min_lr_ratio)
    lr = learning_rate(tr)
    values = [lr(s) for s in SLOTS]
    assert values == pytest.approx([float(reference(s)) for s in SLOTS], rel=1e-6, abs=1e-12)
    assert values[0] == 0.0 and values[3] == pytest.approx(6e-3) and values[-1] == pytest.approx(6e-3 * tr.min_lr_ratio)
    again = learning_rate(tr)  # another learner, asking in another order, gets the same bits
    assert [again(s) for s in reversed(SLOTS)] == list(reversed(values))


@pytest.mark.parametrize("warmup", [0, 1, 7])
def test_the_learning_rate_matches_optax_at_every_position_of_short_schedules(warmup: int) -> None:
    """Edges: no warmup (optax's join starts on the cosine), a one-step warmup, every position."""
    tr = Training(learning_rate=1e-2, warmup_steps=warmup, decay_steps=40, min_lr_ratio=0.25)
    reference = optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup, 40, 1e-2 * 0.25)
    lr = learning_rate(tr)
    assert [lr(s) for s in range(-2, 50)] == pytest.approx([float(reference(max(0, s))) for s in range(-2, 50)],
                                                           rel=1e-6, abs=1e-12)
