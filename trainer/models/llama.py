"""A Llama-style decoder: RMSNorm, rotary positions, SwiGLU, grouped-query attention.

The shape of Llama 2/3 and TinyLlama; `spec.model.preset` names sizes from tiny to ~1B.
Attention goes through `jax.nn.dot_product_attention`, which picks cuDNN's fused kernel
on GPUs and XLA's elsewhere.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from diloco.spec import TransformerModel


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate (B, T, heads, head_dim) by position, pairs (i, i + head_dim/2) as in Hugging Face's
    Llama (whose conversion permuted Meta's interleaved pairs into halves: no permutation here)."""
    half = x.shape[-1] // 2
    freqs = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[:, None].astype(jnp.float32) * freqs[None, :]  # (T, half)
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nn.Module):
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        t = x.shape[1]
        dense = lambda n, name: nn.DenseGeneral((n, self.head_dim), use_bias=False, dtype=self.dtype, name=name)  # noqa: E731
        positions = jnp.arange(t)
        q = rope(dense(self.heads, "q")(x), positions, self.rope_theta)
        k = rope(dense(self.kv_heads, "k")(x), positions, self.rope_theta)
        v = dense(self.kv_heads, "v")(x)
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # GQA: fewer k/v heads are shared
        return nn.DenseGeneral(x.shape[-1], axis=(-2, -1), use_bias=False, dtype=self.dtype, name="o")(out)


class Block(nn.Module):
    cfg: TransformerModel

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        h = nn.RMSNorm(c.epsilon, dtype=dtype, name="attn_norm")(x)
        x = x + Attention(c.heads, c.kv_heads or c.heads, c.d_model // c.heads, c.rope_theta, dtype, name="attn")(h)
        h = nn.RMSNorm(c.epsilon, dtype=dtype, name="mlp_norm")(x)
        gate = nn.Dense(c.hidden, use_bias=False, dtype=dtype, name="gate")(h)
        up = nn.Dense(c.hidden, use_bias=False, dtype=dtype, name="up")(h)
        return x + nn.Dense(c.d_model, use_bias=False, dtype=dtype, name="down")(nn.silu(gate) * up)


class Llama(nn.Module):
    cfg: TransformerModel

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        # Named `embed`: the syncer merges tables whose names start so by plain averaging.
        embed = nn.Embed(c.vocab_size, c.d_model, dtype=dtype,
                         embedding_init=nn.initializers.normal(0.02), name="embed")
        x = embed(tokens)
        block = nn.remat(Block) if c.remat else Block
        for i in range(c.layers):
            x = block(c, name=f"layers_{i}")(x)
        x = nn.RMSNorm(c.epsilon, dtype=dtype, name="norm")(x)
        if c.tie_embeddings:
            return embed.attend(x)
        return nn.Dense(c.vocab_size, use_bias=False, dtype=dtype, name="head")(x)
