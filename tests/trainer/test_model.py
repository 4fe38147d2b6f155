"""The model families (trainer/model.py): presets, the Llama decoder's parts, your own module."""

from __future__ import annotations

import sys
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pydantic import ValidationError

from diloco.spec import TransformerModel
from diloco.trainer import model


def n_params(cfg: TransformerModel) -> int:
    return sum(int(np.prod(s)) for s in model.parameter_shapes(cfg).values())


def test_presets_have_the_sizes_they_are_named_for_and_fields_beside_them_win() -> None:
    assert n_params(TransformerModel(preset="llama-1b")) == pytest.approx(1.10e9, rel=0.01)  # TinyLlama's shape
    assert n_params(TransformerModel(preset="llama-125m")) == pytest.approx(1.10e8, rel=0.01)  # tied embeddings
    assert TransformerModel.model_validate({"preset": "llama-125m", "layers": 3}).layers == 3
    assert TransformerModel(preset="llama-tiny").hidden == 384  # SwiGLU: 2/3 of 4 x 128, rounded up to 64
    for bad in ([], {"name": "llama-tiny"}, "llama-2t"):  # found by tests/system/test_fuzz.py: a list crashed the parser
        with pytest.raises(ValidationError, match="preset"):
            TransformerModel.model_validate({"preset": bad})


def test_the_gpt_keeps_its_parameter_names_and_tying_drops_the_head() -> None:
    names = set(model.parameter_shapes(TransformerModel()))
    assert {"embed/embedding", "pos_embed/embedding", "head/kernel", "ln_f/scale"} <= names
    assert "head/kernel" not in model.parameter_shapes(TransformerModel(tie_embeddings=True))
    llama = model.parameter_shapes(TransformerModel(preset="llama-tiny"))
    assert llama["layers_0/attn/k/kernel"] == (128, 2, 32)  # two key/value heads of 32 for four query heads


@pytest.mark.slow
def test_llama_is_causal_and_its_bf16_loss_is_close_to_fp32() -> None:
    cfg = TransformerModel(preset="llama-tiny", layers=1, context=16)
    params = model.init_params(cfg, 0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)), jnp.int32)
    changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % 256)
    a, b = model.apply(cfg, params, tokens), model.apply(cfg, params, changed)
    assert np.allclose(a[:, :10], b[:, :10], atol=1e-5) and not np.allclose(a[:, 10:], b[:, 10:])  # no peeking ahead
    batch = jnp.concatenate([tokens, tokens[:, :1]], axis=1)
    fp32 = float(model.loss_fn(cfg, params, batch))
    bf16 = float(model.loss_fn(TransformerModel(preset="llama-tiny", layers=1, context=16, dtype="bfloat16"), params, batch))
    assert bf16 == pytest.approx(fp32, rel=0.02) and bf16 != fp32
    remat = TransformerModel(preset="llama-tiny", layers=1, context=16, remat=True)
    g1 = jax.grad(lambda p: model.loss_fn(cfg, p, batch))(params)
    g2 = jax.grad(lambda p: model.loss_fn(remat, p, batch))(params)
    assert all(np.allclose(g1[n], g2[n], atol=1e-5) for n in g1)  # remat recomputes, it does not change


class _Bigram(nn.Module):
    vocab: int

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        return nn.Embed(self.vocab, self.vocab, name="embed")(tokens)


@pytest.mark.slow
def test_your_own_module_is_built_from_its_factory_and_a_bad_one_is_named() -> None:
    mod = types.ModuleType("my_models")
    mod.bigram = lambda cfg: _Bigram(cfg.vocab_size)  # type: ignore[attr-defined]
    mod.not_a_module = lambda cfg: "nope"  # type: ignore[attr-defined]
    sys.modules["my_models"] = mod
    try:
        cfg = TransformerModel(module="my_models:bigram", context=8)
        assert model.parameter_shapes(cfg) == {"embed/embedding": (256, 256)}
        batch = jnp.zeros((2, 9), jnp.int32)
        assert float(model.loss_fn(cfg, model.init_params(cfg, 0), batch)) > 0
        with pytest.raises(ValueError, match=r"the factory returned str, not a flax\.linen\.Module"):
            model.build(TransformerModel(module="my_models:not_a_module"))
        with pytest.raises(ValueError, match="cannot load it"):
            model.build(TransformerModel(module="no_such_package.models:bigram"))
    finally:
        del sys.modules["my_models"]
