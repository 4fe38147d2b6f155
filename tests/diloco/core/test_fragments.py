"""Fragment plans: coverage, determinism, balance."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.core.fragments import TensorSpec, plan_fragments
from diloco.core.schedule import due_fragments

METHODS = ["balanced", "layer", "strided"]


def transformer_specs(layers: int, d: int, vocab: int = 256, ctx: int = 128) -> list[TensorSpec]:
    specs = [TensorSpec("embed/embedding", (vocab, d)), TensorSpec("pos_embed/embedding", (ctx, d))]
    for i in range(layers):
        specs += [
            TensorSpec(f"layers_{i}/attn/qkv/kernel", (d, 3 * d)),
            TensorSpec(f"layers_{i}/attn/out/kernel", (d, d)),
            TensorSpec(f"layers_{i}/mlp/up/kernel", (d, 4 * d)),
            TensorSpec(f"layers_{i}/mlp/down/kernel", (4 * d, d)),
            TensorSpec(f"layers_{i}/ln1/scale", (d,)),
            TensorSpec(f"layers_{i}/ln2/scale", (d,)),
        ]
    return specs + [TensorSpec("ln_f/scale", (d,)), TensorSpec("head/kernel", (d, vocab))]


spec_lists = st.lists(
    st.tuples(st.text("abcdefgh_/0123", min_size=1, max_size=12), st.lists(st.integers(1, 64), min_size=0, max_size=3)),
    min_size=1, max_size=40, unique_by=lambda t: t[0],
).map(lambda items: [TensorSpec(n, tuple(s)) for n, s in items])


@settings(max_examples=150, deadline=None)
@given(specs=spec_lists, p=st.integers(1, 12), method=st.sampled_from(METHODS))
def test_every_tensor_exactly_once_and_no_empty_fragment(specs, p, method) -> None:
    if p > len(specs):
        with pytest.raises(ValueError, match="exceeds"):
            plan_fragments(specs, p, method)
        return
    plan = plan_fragments(specs, p, method)
    names = [n for frag in plan.fragments for n in frag]
    assert sorted(names) == sorted(s.name for s in specs)
    assert plan.num_fragments == p and all(plan.fragments)
    # Same plan whatever order the tensors arrive in: every party derives the same one.
    assert plan_fragments(list(reversed(specs)), p, method) == plan


@pytest.mark.parametrize("layers,p", [(2, 4), (4, 4), (8, 6), (12, 8)])
def test_balanced_beats_layer(layers: int, p: int) -> None:
    specs = transformer_specs(layers, 128)
    balanced = plan_fragments(specs, p, "balanced").imbalance(specs)
    by_layer = plan_fragments(specs, p, "layer").imbalance(specs)
    assert balanced < by_layer
    assert balanced < 1.35


def test_layer_plan_keeps_layers_together() -> None:
    specs = transformer_specs(4, 64)
    plan = plan_fragments(specs, 4, "layer")
    for i in range(4):
        homes = {plan.fragment_of(s.name) for s in specs if s.name.startswith(f"layers_{i}/")}
        assert len(homes) == 1


def test_round_robin() -> None:
    assert [due_fragments(s, 3)[0] for s in range(7)] == [0, 1, 2, 0, 1, 2, 0]
