"""The built-in models' shapes from the spec alone (diloco/shapes.py, what the operator sizes the
checkpoint volume with, without JAX) are exactly what Flax's init makes, names and order included."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.shapes import parameter_count, parameter_shapes
from diloco.spec import PRESETS, TransformerModel
from diloco.trainer import model


def traced(cfg: TransformerModel) -> dict[str, tuple[int, ...]]:
    return dict(model.traced_shapes(cfg.model_dump_json()))


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.slow
def test_every_preset_matches_what_flax_makes(preset: str) -> None:
    cfg = TransformerModel(preset=preset)
    assert parameter_shapes(cfg) == traced(cfg)
    assert list(parameter_shapes(cfg) or {}) == list(traced(cfg))  # the order init gives, too


@settings(max_examples=25, deadline=None)
@given(family=st.sampled_from(["gpt", "llama"]), layers=st.integers(1, 3), head_dim=st.sampled_from([8, 16]),
       heads=st.sampled_from([1, 2, 4]), kv=st.sampled_from([None, 1, 2]), vocab=st.integers(2, 300),
       context=st.integers(8, 40), hidden=st.one_of(st.none(), st.integers(8, 90)), tied=st.booleans(),
       remat=st.booleans())
@pytest.mark.slow
def test_odd_sizes_match_too(family: str, layers: int, head_dim: int, heads: int, kv: int | None, vocab: int,
                             context: int, hidden: int | None, tied: bool, remat: bool) -> None:
    kv_heads = kv if family == "llama" and kv is not None and heads % kv == 0 else None
    cfg = TransformerModel(family=family, layers=layers, d_model=heads * head_dim, heads=heads, kv_heads=kv_heads,
                           vocab_size=vocab, context=context, mlp_hidden=hidden, tie_embeddings=tied, remat=remat)
    assert parameter_shapes(cfg) == traced(cfg)


def test_a_users_module_has_no_shapes_without_its_code() -> None:
    cfg = TransformerModel(module="my_models.wide:build")
    assert parameter_shapes(cfg) is None and parameter_count(cfg) is None


def test_the_1b_preset_counts_about_a_billion() -> None:
    count = parameter_count(TransformerModel(preset="llama-1b"))
    assert count is not None and 1.0e9 < count < 1.2e9
