"""A byte-level decoder-only transformer (pre-LayerNorm, learned positions, untied head).

Parameter names are flat `a/b/c` paths; fragments, codecs and checkpoints all key on
them, and `embed`-prefixed tables are merged by plain averaging (docs/ALGORITHM.md, "The syncer": Merge).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from diloco.spec import TransformerModel

VOCAB = 256  # bytes: no tokenizer to download, any text works
Params = dict[str, jax.Array]


class Block(nn.Module):
    d_model: int
    heads: int
    mlp_ratio: int

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        h = nn.LayerNorm(use_bias=False, name="ln1")(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=self.heads, qkv_features=self.d_model, use_bias=False, name="attn"
        )(h, h, mask=mask)
        x = x + h
        h = nn.LayerNorm(use_bias=False, name="ln2")(x)
        h = nn.Dense(self.mlp_ratio * self.d_model, use_bias=False, name="up")(h)
        h = nn.Dense(self.d_model, use_bias=False, name="down")(nn.gelu(h))
        return x + h


class Transformer(nn.Module):
    cfg: TransformerModel

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.cfg
        t = tokens.shape[-1]
        x = nn.Embed(VOCAB, c.d_model, name="embed")(tokens)
        x = x + nn.Embed(c.context, c.d_model, name="pos_embed")(jnp.arange(t))
        mask = nn.make_causal_mask(tokens)
        for i in range(c.layers):
            x = Block(c.d_model, c.heads, c.mlp_ratio, name=f"layers_{i}")(x, mask)
        x = nn.LayerNorm(use_bias=False, name="ln_f")(x)
        return nn.Dense(VOCAB, use_bias=False, name="head")(x)


def init_params(cfg: TransformerModel, seed: int) -> Params:
    """Flat fp32 parameters; every learner and the syncer get the same ones from the same seed."""
    model = Transformer(cfg)
    # Jitted: one compile instead of dozens of eagerly dispatched ops (3.6 s -> well under 1 s).
    variables = jax.jit(model.init)(jax.random.PRNGKey(seed), jnp.zeros((1, cfg.context), jnp.int32))
    return {"/".join(k): v for k, v in flatten_dict(variables["params"]).items()}


def apply(cfg: TransformerModel, params: Params, tokens: jax.Array) -> jax.Array:
    nested = unflatten_dict({tuple(k.split("/")): v for k, v in params.items()})
    logits: jax.Array = Transformer(cfg).apply({"params": nested}, tokens)  # type: ignore[assignment]  # no mutable collections: logits only
    return logits


def loss_fn(cfg: TransformerModel, params: Params, batch: jax.Array) -> jax.Array:
    """Mean next-byte cross-entropy in nats; batch is (B, context + 1) bytes."""
    logits = apply(cfg, params, batch[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch[:, 1:, None], axis=-1))


def shapes(params: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(int(d) for d in np.shape(v)) for k, v in params.items()}


@functools.lru_cache(maxsize=64)
def _shapes_of(cfg_json: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    cfg = TransformerModel.model_validate_json(cfg_json)
    abstract = jax.eval_shape(Transformer(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, cfg.context), jnp.int32))
    return tuple(("/".join(k), tuple(v.shape)) for k, v in flatten_dict(abstract["params"]).items())


def parameter_shapes(cfg: TransformerModel) -> dict[str, tuple[int, ...]]:
    """The model's parameter shapes without computing any (for sizing volumes and memory)."""
    return dict(_shapes_of(cfg.model_dump_json()))


def count(params: dict[str, Any]) -> int:
    return int(sum(np.prod(np.shape(v)) for v in params.values()))
