"""The model a plan is for: a manifest's spec.model, or a Llama-style shape of about the given size.

The fragment plan holds whole tensors, so the largest fragment a shard merges per slot comes from
the model's real tensors (diloco/core/fragments.py over diloco/shapes.py), not from params / P.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache

from diloco.core.fragments import plan_fragments, specs_from_shapes
from diloco.shapes import parameter_shapes
from diloco.spec import SpecError, TransformerModel, load_job

HEAD_DIM = 128  # Llama's head size at every scale
VOCAB = 32_000  # Llama 2's vocabulary, as the llama presets (diloco/spec/learner.py)
CONTEXT = 4096  # a pre-training context of this decade


def llama_of_size(params: float) -> TransformerModel | None:
    """The Llama shape closest to `params`: width about 100x the depth (Llama 2 7B: 4096 x 32;
    13B: 5120 x 40), width a multiple of the head size; None where none comes within 50%."""
    best: tuple[float, TransformerModel] | None = None
    for layers in range(4, 257, 2):
        # 12 L d^2 in the blocks (attention 4 d^2, SwiGLU 8 d^2) plus 2 V d of embedding and head
        root = (-2 * VOCAB + math.sqrt(4 * VOCAB**2 + 48 * layers * params)) / (24 * layers)
        width = max(HEAD_DIM, round(root / HEAD_DIM) * HEAD_DIM)
        if not 60 <= width / layers <= 260:
            continue
        try:
            cfg = TransformerModel(family="llama", layers=layers, d_model=width, heads=width // HEAD_DIM,
                                   context=CONTEXT, vocab_size=VOCAB, dtype="bfloat16")
        except ValueError:  # wider than the spec allows: no Llama of this size
            continue
        count = sum(math.prod(s) for s in (parameter_shapes(cfg) or {}).values())
        err = abs(count - params) / params
        if best is None or err < best[0]:
            best = (err, cfg)
    return None if best is None or best[0] > 0.5 else best[1]


def model_from_manifest(path: str) -> TransformerModel:
    """spec.model of a manifest (a pretrained model's read from its config.json); SpecError names
    the problem (unreadable, invalid, unshaped)."""
    from diloco.hf import resolve  # a pretrained model's architecture is in its config.json

    cfg = resolve(load_job(path)).spec.model
    if parameter_shapes(cfg) is None:
        raise SpecError([f"{path}: spec.model has no shapes the plan can read (a module, or a pretrained "
                         "model without its architecture fields); give --params instead"])
    return cfg


def parameters(cfg: TransformerModel) -> int:
    return sum(math.prod(s) for s in (parameter_shapes(cfg) or {}).values())


def tensor_count(cfg: TransformerModel) -> int:
    return len(parameter_shapes(cfg) or {})


def fragment_sizer(cfg: TransformerModel) -> Callable[[int], float]:
    """n -> parameters in the largest fragment of the balanced plan of n fragments."""
    specs = specs_from_shapes(parameter_shapes(cfg) or {}, itemsize=1)

    @cache
    def largest(n: int) -> float:
        plan = plan_fragments(specs, min(n, len(specs)), "balanced")
        return float(max(plan.fragment_bytes(specs)))

    return largest
