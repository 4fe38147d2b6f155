"""Θ₀ from a Hugging Face model directory (`spec.model.pretrained`): its safetensors weights,
one file or several named by model.safetensors.index.json, local (memory-mapped) or from
object storage through fsspec, renamed and transposed into our parameters (diloco/hf.py).

Every learner reads the same files, so every learner has the same Θ₀, and the syncer checks
that through the Θ₀ hash of the Join as it does for a seeded init.
"""

from __future__ import annotations

import json

import numpy as np
import safetensors
import safetensors.numpy

from diloco import hf
from diloco.shapes import parameter_shapes
from diloco.spec import TransformerModel

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def weight_files(location: str) -> list[str]:
    """The safetensors files of the model at `location`, in the index's order."""
    join = lambda name: f"{location.rstrip('/')}/{name}"  # noqa: E731
    if hf.exists(join(INDEX)):
        try:
            index = json.loads(hf.read(join(INDEX)))
            files = list(dict.fromkeys(index["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise hf.HFError(f"spec.model.pretrained: {join(INDEX)} is not a safetensors index ({exc})") from None
        return [join(f) for f in files]
    if hf.exists(join(SINGLE)):
        return [join(SINGLE)]
    raise hf.HFError(f"spec.model.pretrained: {location!r} has no {SINGLE} or {INDEX}; save the model with "
                     "save_pretrained(dir) (safetensors is its default since transformers 4.35), or convert "
                     "pytorch_model.bin with transformers before pointing a job at it")


def read_weights(location: str) -> dict[str, np.ndarray]:
    """Every tensor of the model's safetensors files (bf16 and fp16 become fp32 in `from_hf`)."""
    tensors: dict[str, np.ndarray] = {}
    for url in weight_files(location):
        try:
            part = safetensors.numpy.load_file(url) if "://" not in url else safetensors.numpy.load(hf.read(url))
        except (OSError, safetensors.SafetensorError) as exc:
            raise hf.HFError(f"spec.model.pretrained: {url} is not a readable safetensors file ({exc})") from None
        tensors.update(part)
    return tensors


def initial_params(cfg: TransformerModel) -> dict[str, np.ndarray]:
    """Θ₀ as our flat fp32 parameters; HFError when the weights do not fit `cfg` (resolved)."""
    assert cfg.pretrained is not None and hf.is_resolved(cfg), "resolve the job (diloco/hf.py) first"
    shapes = parameter_shapes(cfg)
    assert shapes is not None
    return hf.from_hf(cfg, read_weights(cfg.pretrained), shapes, cfg.pretrained)
