"""The built-in models' parameter shapes, computed from the spec alone: no JAX, no flax.

The operator sizes the syncer's checkpoint volume from them, and it runs from the syncer image,
which has no JAX (pyproject's base install). The names and shapes are exactly what Flax gives
`trainer/models/gpt.py` and `trainer/models/llama.py` (tests/diloco/test_shapes.py checks them against
`jax.eval_shape` for every preset and odd sizes); a change to either model changes this too.
A user's own module (`spec.model.module`) has shapes only its code knows, and a pretrained model
(`spec.model.pretrained`) only its config.json until it is read (diloco/hf.py): None here.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from diloco.hf import is_resolved
from diloco.spec import TransformerModel

Shape = tuple[int, ...]


def parameter_shapes(cfg: TransformerModel) -> dict[str, Shape] | None:
    """Flat `a/b/c` parameter names to shapes, as trainer/model.py's init makes them; None for a
    bring-your-own module."""
    if cfg.module is not None or not is_resolved(cfg):
        return None
    layers = _llama_layer if cfg.family == "llama" else _gpt_layer
    out: dict[str, Shape] = {"embed/embedding": (cfg.vocab_size, cfg.d_model)}
    if cfg.family == "gpt":
        out["pos_embed/embedding"] = (cfg.context, cfg.d_model)
    for i in range(cfg.layers):
        out.update((f"layers_{i}/{name}", shape) for name, shape in layers(cfg))
    out["norm/scale" if cfg.family == "llama" else "ln_f/scale"] = (cfg.d_model,)
    if not cfg.tie_embeddings:
        out["head/kernel"] = (cfg.d_model, cfg.vocab_size)
    return {name: out[name] for name in sorted(out, key=lambda n: n.split("/"))}  # Flax's order: sorted per level


def parameter_count(cfg: TransformerModel) -> int | None:
    shapes = parameter_shapes(cfg)
    return None if shapes is None else sum(math.prod(s) for s in shapes.values())


def _gpt_layer(cfg: TransformerModel) -> Iterator[tuple[str, Shape]]:
    """Pre-LayerNorm without biases; flax's MultiHeadDotProductAttention keeps heads apart."""
    d, heads = cfg.d_model, cfg.heads
    yield "ln1/scale", (d,)
    for projection in ("query", "key", "value"):
        yield f"attn/{projection}/kernel", (d, heads, d // heads)
    yield "attn/out/kernel", (heads, d // heads, d)
    yield "ln2/scale", (d,)
    yield "up/kernel", (d, cfg.hidden)
    yield "down/kernel", (cfg.hidden, d)


def _llama_layer(cfg: TransformerModel) -> Iterator[tuple[str, Shape]]:
    """RMSNorm, grouped-query attention (kvHeads key/value heads), SwiGLU."""
    d, heads = cfg.d_model, cfg.heads
    kv, head_dim = cfg.kv_heads or heads, d // heads
    yield "attn_norm/scale", (d,)
    yield "attn/q/kernel", (d, heads, head_dim)
    yield "attn/k/kernel", (d, kv, head_dim)
    yield "attn/v/kernel", (d, kv, head_dim)
    yield "attn/o/kernel", (heads, head_dim, d)
    yield "mlp_norm/scale", (d,)
    yield "gate/kernel", (d, cfg.hidden)
    yield "up/kernel", (d, cfg.hidden)
    yield "down/kernel", (cfg.hidden, d)
