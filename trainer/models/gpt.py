"""The byte-level GPT of the quickstart: pre-LayerNorm, learned positions, GELU, untied head.

Its parameter names (`embed`, `pos_embed`, `layers_i/...`, `ln_f`, `head`) are what the
first release's checkpoints and benchmarks hold; keep them.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from diloco.spec import TransformerModel


class Block(nn.Module):
    d_model: int
    heads: int
    hidden: int
    epsilon: float
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        h = nn.LayerNorm(self.epsilon, use_bias=False, dtype=self.dtype, name="ln1")(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=self.heads, qkv_features=self.d_model, use_bias=False, dtype=self.dtype, name="attn"
        )(h, h, mask=mask)
        x = x + h
        h = nn.LayerNorm(self.epsilon, use_bias=False, dtype=self.dtype, name="ln2")(x)
        h = nn.Dense(self.hidden, use_bias=False, dtype=self.dtype, name="up")(h)
        h = nn.Dense(self.d_model, use_bias=False, dtype=self.dtype, name="down")(nn.gelu(h))
        return x + h


class GPT(nn.Module):
    cfg: TransformerModel

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.cfg
        dtype = jnp.dtype(c.dtype)
        t = tokens.shape[-1]
        embed = nn.Embed(c.vocab_size, c.d_model, dtype=dtype, name="embed")
        x = embed(tokens) + nn.Embed(c.context, c.d_model, dtype=dtype, name="pos_embed")(jnp.arange(t))
        mask = nn.make_causal_mask(tokens)
        block = nn.remat(Block) if c.remat else Block
        for i in range(c.layers):
            x = block(c.d_model, c.heads, c.hidden, c.epsilon, dtype, name=f"layers_{i}")(x, mask)
        x = nn.LayerNorm(c.epsilon, use_bias=False, dtype=dtype, name="ln_f")(x)
        if c.tie_embeddings:
            return embed.attend(x)
        return nn.Dense(c.vocab_size, use_bias=False, dtype=dtype, name="head")(x)
