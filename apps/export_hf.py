"""`diloco export --format hf`: a directory transformers, lm-eval-harness and vLLM load as it is.

config.json (LlamaConfig, or GPT2Config for the byte-level gpt), model.safetensors with Hugging
Face's tensor names (diloco/hf.py), generation_config.json, and the tokenizer the job trained
with: its tokenizer.json (and the pretrained model's tokenizer_config.json when it came from
one), or for bytes a byte-level tokenizer.json whose ids are the bytes themselves. Also read
back (`load_hf`), so `diloco sample` takes an HF directory as it takes our own exports.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

from diloco import hf
from diloco.shapes import parameter_shapes
from diloco.spec import DataSource, TransformerModel

WEIGHTS: Final = "model.safetensors"
GENERATION: Final = "generation_config.json"
TOKENIZER_CONFIG: Final = "tokenizer_config.json"
# Files a pretrained model's tokenizer comes with, copied beside its tokenizer.json when present.
TOKENIZER_FILES: Final = (TOKENIZER_CONFIG, "special_tokens_map.json")
FILES: Final = (hf.CONFIG, WEIGHTS, GENERATION, hf.TOKENIZER, *TOKENIZER_FILES)  # what an HF export writes
DTYPES: Final = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
# Special tokens by the names tokenizers give them (GPT-2, Llama/SentencePiece, Llama 3, Gemma).
EOS: Final = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
BOS: Final = ("<s>", "<|begin_of_text|>", "<bos>")


def write_hf(model: TransformerModel, source: DataSource, params: Mapping[str, np.ndarray], out: Path,
             dtype: str) -> list[str]:
    """Write the HF directory into `out` (existing, empty of our files); config.json last, so a
    torn export has none. Returns notes for the user (e.g. that no tokenizer went with it)."""
    tensors = {k: v.astype(DTYPES[dtype]) for k, v in hf.to_hf(model, params).items()}
    safetensors.numpy.save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})  # transformers wants "pt"
    notes, special = _tokenizer(model, source, out)
    generation = {"_from_model_config": True, **special}
    (out / GENERATION).write_text(json.dumps(generation, indent=2) + "\n")
    tmp = out / f".{hf.CONFIG}.tmp"
    tmp.write_text(json.dumps(hf.hf_config(model, dtype, special), indent=2) + "\n")
    os.replace(tmp, out / hf.CONFIG)
    return notes


def _tokenizer(model: TransformerModel, source: DataSource, out: Path) -> tuple[list[str], dict[str, int]]:
    """The job's tokenizer into `out`, and the bos/eos ids config.json names."""
    from tokenizers import Tokenizer

    if source.encoding == "bytes":
        if source.kind == "tokens" and model.vocab_size > 256:
            return [f"no tokenizer exported: the job trained on pre-tokenized ids (vocabulary {model.vocab_size}) and "
                    f"names none; copy the one that made its shards into {out} as {hf.TOKENIZER}"], {}
        tok = byte_tokenizer()
        tok.save(str(out / hf.TOKENIZER))
        _write_json(out / TOKENIZER_CONFIG, {"tokenizer_class": "PreTrainedTokenizerFast",
                                             "model_max_length": model.context, "clean_up_tokenization_spaces": False})
        return [], {}
    raw = hf.read(source.encoding)
    (out / hf.TOKENIZER).write_bytes(raw)
    tok = Tokenizer.from_str(raw.decode("utf-8"))
    eos = next((t for t in EOS if tok.token_to_id(t) is not None), None)
    bos = next((t for t in BOS if tok.token_to_id(t) is not None), None)
    folder = source.encoding.rpartition("/")[0]
    copied = [name for name in TOKENIZER_FILES if folder and hf.exists(f"{folder}/{name}")]
    for name in copied:  # the pretrained model's own: its chat template, special tokens, padding side
        (out / name).write_bytes(hf.read(f"{folder}/{name}"))
    if TOKENIZER_CONFIG not in copied:
        named = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v is not None}
        _write_json(out / TOKENIZER_CONFIG, {"tokenizer_class": "PreTrainedTokenizerFast",
                                             "model_max_length": model.context, **named})
    ids = {f"{k}_token_id": tok.token_to_id(v) for k, v in (("bos", bos), ("eos", eos)) if v is not None}
    return [], {k: v for k, v in ids.items() if v is not None}


def byte_tokenizer() -> Any:
    """A tokenizer.json whose ids are bytes (`tokenizer: bytes`): GPT-2's byte-to-character map
    with no merges, so transformers encodes and decodes exactly what our learners trained on."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # 256 printable characters, one per byte
    chars = {_byte_char(b): b for b in range(256)}
    assert set(chars) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=chars, merges=[], ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _byte_char(b: int) -> str:
    """GPT-2's printable stand-in for byte `b` (the map tokenizers' ByteLevel uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if b in printable:
        return chr(b)
    return chr(256 + sum(1 for x in range(b) if x not in printable))


def _write_json(path: Path, value: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def is_hf(directory: Path) -> bool:
    """A Hugging Face model directory (its config.json names a model_type)."""
    try:
        return "model_type" in json.loads((directory / hf.CONFIG).read_text())
    except (OSError, ValueError, TypeError):
        return False


def load_hf(directory: Path) -> tuple[TransformerModel, DataSource, dict[str, np.ndarray]]:
    """An HF directory of a family we train, as our model, tokenizer source and parameters."""
    from diloco.trainer.models.pretrained import read_weights

    where = str(directory)
    config = hf.read_config(where)
    fields = hf.architecture(config, f"{where}/{hf.CONFIG}")
    cfg = TransformerModel.model_validate({**fields, "context": hf.positions(config) or 2048})
    shapes = parameter_shapes(cfg)
    assert shapes is not None
    params = hf.from_hf(cfg, read_weights(where), shapes, where)
    tokenizer = directory / hf.TOKENIZER
    return cfg, DataSource(tokenizer=str(tokenizer) if tokenizer.is_file() else None), params
