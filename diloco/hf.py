"""Hugging Face's layout for the built-in families: config.json and tensor names, both ways.

transformers, lm-eval-harness and vLLM read a model as a directory: config.json (the
architecture), *.safetensors (tensors named and shaped as torch modules hold them) and the
tokenizer's files. `architecture` maps a config.json onto spec.model's fields and `hf_config`
maps them back; `to_hf` and `from_hf` rename and transpose the tensors; `resolve` fills a job's
model from `spec.model.pretrained`. The llama family is LlamaForCausalLM exactly (RoPE on
halves of each head, RMSNorm, SwiGLU, grouped-query attention, no biases); the byte-level gpt
is GPT2LMHeadModel with zero biases (GPT-2 has them everywhere, ours has none).

JSON and numpy only: `diloco validate` runs it in the syncer image (no JAX, no torch).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

import numpy as np
from pydantic.alias_generators import to_camel

from diloco.spec import DecoupledDiLoCoJob, SpecError, TransformerModel

CONFIG: Final = "config.json"
TOKENIZER: Final = "tokenizer.json"
# config.json's name for each spec.model field it decides, per family.
LLAMA: Final = {"layers": "num_hidden_layers", "d_model": "hidden_size", "heads": "num_attention_heads",
                "kv_heads": "num_key_value_heads", "mlp_hidden": "intermediate_size", "vocab_size": "vocab_size",
                "tie_embeddings": "tie_word_embeddings", "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps"}
GPT2: Final = {"layers": "n_layer", "d_model": "n_embd", "heads": "n_head", "mlp_hidden": "n_inner",
               "vocab_size": "vocab_size", "tie_embeddings": "tie_word_embeddings", "norm_eps": "layer_norm_epsilon"}
# What GPT-2 computes with the tanh approximation of GELU, which is Flax's nn.gelu.
GPT2_GELU: Final = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
# Tensors older checkpoints carry that are recomputed, not learned: skipped when read.
BUFFERS: Final = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")
# The fields a model's parameter shapes depend on (diloco/shapes.py).
SHAPED: Final = frozenset({"family", "layers", "d_model", "heads", "mlp_hidden", "vocab_size", "tie_embeddings"})
# Special tokens by the names tokenizers give them (GPT-2, Llama/SentencePiece, Llama 3, Gemma): a
# job's documents are joined with the first end-of-text token its tokenizer has (trainer/data/sources.py),
# and an export names it as the model's eos (apps/export_hf.py).
END_OF_TEXT: Final = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
BEGIN_OF_TEXT: Final = ("<s>", "<|begin_of_text|>", "<bos>")
# Byte-level ids (`tokenizer: bytes`) are a text's UTF-8 bytes. Their end-of-text token is id 255,
# the byte 0xFF, which UTF-8 never holds: no document's byte is ever read as it, and the vocabulary
# needs no 257th row (the model's is fixed at 256). The byte-level pipeline joins documents with a
# newline, not with it, so a byte-level model never learns to emit it; `diloco sample` and an hf
# export's generation config stop at it, and byte-level text that holds 0xFF (not UTF-8) is refused
# (docs/CHECKPOINTS.md, "Special tokens").
BYTE_END_OF_TEXT: Final = 255
BYTE_END_OF_TEXT_NAME: Final = "<|endoftext|>"  # its name in an hf export's tokenizer, as GPT-2 names its own

Tensors = dict[str, np.ndarray]


class HFError(ValueError):
    """A Hugging Face model we cannot take or make; the message names the fix."""


def _fields(family: str) -> Mapping[str, str]:
    return LLAMA if family == "llama" else GPT2


def architecture(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """spec.model's fields (snake_case) from a config.json, or HFError naming what we cannot train."""
    kind = config.get("model_type")
    if kind == "llama":
        return _llama(config, where)
    if kind == "gpt2":
        return _gpt2(config, where)
    raise HFError(f"{where}: model_type {kind!r} is not a family decoupled-diloco trains; it takes llama "
                  "(LlamaForCausalLM: Llama 2, TinyLlama, SmolLM, ...) and gpt2 (our byte-level gpt's export)")


def _int(config: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HFError(f"{where}: {key} is {value!r}, not a positive integer; is this a model's config.json?")
    return value


def _number(config: Mapping[str, Any], key: str, where: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise HFError(f"{where}: {key} is {value!r}, not a positive number")
    return float(value)


def _refuse(where: str, what: str, why: str) -> HFError:
    return HFError(f"{where}: {what}: {why}, which the built-in llama does not compute; continued pre-training "
                   "would start from a different function than the one the checkpoint learned")


def _rope_theta(config: Mapping[str, Any], where: str) -> float:
    """rope_theta as transformers 4 (top level, beside rope_scaling) and 5 (rope_parameters) write it."""
    rope = config.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise HFError(f"{where}: rope_parameters is {rope!r}, not a mapping")
    scaling = config.get("rope_scaling") or {}
    kind = rope.get("rope_type") or (scaling.get("rope_type") or scaling.get("type") if isinstance(scaling, dict) else None)
    if kind not in (None, "default"):
        raise _refuse(where, f"rope type {kind!r}", "RoPE frequencies rescaled for long context")
    return _number(rope if "rope_theta" in rope else config, "rope_theta", where, 10_000.0)


def _llama(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    d, heads = _int(config, "hidden_size", where), _int(config, "num_attention_heads", where)
    if config.get("hidden_act", "silu") != "silu":
        raise _refuse(where, f"hidden_act {config['hidden_act']!r}", "another MLP activation than SwiGLU's silu")
    for bias in ("attention_bias", "mlp_bias"):
        if config.get(bias):
            raise _refuse(where, f"{bias} true", "biases in the projections")
    if config.get("rope_interleaved"):  # nanotron's flag: RoPE on adjacent pairs, not on halves
        raise _refuse(where, "rope_interleaved true", "RoPE on adjacent pairs")
    if config.get("head_dim") not in (None, d // heads) or d % heads:
        raise _refuse(where, f"head_dim {config.get('head_dim')}", f"a head size other than hidden_size / heads ({d} / {heads})")
    return {"family": "llama", "layers": _int(config, "num_hidden_layers", where), "d_model": d, "heads": heads,
            "kv_heads": _int(config, "num_key_value_heads", where, heads),
            "mlp_hidden": _int(config, "intermediate_size", where), "vocab_size": _int(config, "vocab_size", where),
            "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
            "rope_theta": _rope_theta(config, where), "norm_eps": _number(config, "rms_norm_eps", where, 1e-6)}


def _gpt2(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    d = _int(config, "n_embd", where)
    if config.get("activation_function", "gelu_new") not in GPT2_GELU:
        raise _refuse(where, f"activation_function {config['activation_function']!r}", "GELU other than tanh's")
    if not config.get("scale_attn_weights", True) or config.get("scale_attn_by_inverse_layer_idx"):
        raise _refuse(where, "attention scaling", "scores not divided by exactly sqrt(head size)")
    return {"family": "gpt", "layers": _int(config, "n_layer", where), "d_model": d, "heads": _int(config, "n_head", where),
            "mlp_hidden": _int(config, "n_inner", where, 4 * d) if config.get("n_inner") is not None else 4 * d,
            "vocab_size": _int(config, "vocab_size", where),
            "tie_embeddings": bool(config.get("tie_word_embeddings", True)),
            "norm_eps": _number(config, "layer_norm_epsilon", where, 1e-5)}


def positions(config: Mapping[str, Any]) -> int | None:
    """The longest context the model was made for (learned positions: all it has)."""
    value = config.get("n_positions" if config.get("model_type") == "gpt2" else "max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


def hf_config(cfg: TransformerModel, dtype: str, special: Mapping[str, int]) -> dict[str, Any]:
    """The config.json transformers builds `cfg`'s model from (`special`: bos/eos/pad token ids)."""
    fields = _fields(cfg.family)
    values = {k: getattr(cfg, k) for k in fields} | {"norm_eps": cfg.epsilon, "mlp_hidden": cfg.hidden,
                                                      "kv_heads": cfg.kv_heads or cfg.heads}
    names = {fields[k]: v for k, v in values.items() if k in fields}
    # bos/eos: the tokenizer's, else none (transformers' class defaults name ids our vocabulary may not have)
    tokens = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **special}
    common = {**names, "torch_dtype": dtype, "dtype": dtype, "use_cache": True, "initializer_range": 0.02, **tokens}
    if cfg.family == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
                "head_dim": cfg.d_model // cfg.heads,
                "max_position_embeddings": cfg.context, "hidden_act": "silu", "attention_bias": False,
                "mlp_bias": False, "attention_dropout": 0.0, "rope_scaling": None,
                # transformers 4 reads rope_theta at the top level, 5 from rope_parameters
                "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **common, "n_positions": cfg.context,
            "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}


# Tensors, both ways. Flax's Dense kernels are (in, out), torch's Linear weights (out, in);
# attention kernels keep heads apart: q (d, heads, head_dim), o (heads, head_dim, d).
Pair = tuple[str, str, Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray, tuple[int, ...]], np.ndarray]]


def _same(x: np.ndarray) -> np.ndarray:
    return x


def _as(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return x.reshape(shape)


def _q(x: np.ndarray) -> np.ndarray:  # (d, heads, head_dim) -> (heads x head_dim, d)
    return x.reshape(x.shape[0], -1).T


def _q_back(w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return w.T.reshape(shape)


def _o(x: np.ndarray) -> np.ndarray:  # (heads, head_dim, d) -> (d, heads x head_dim)
    return x.reshape(-1, x.shape[-1]).T


def _t(x: np.ndarray) -> np.ndarray:
    return x.T


def _t_back(w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return w.T.reshape(shape)


def _llama_pairs(cfg: TransformerModel) -> Iterator[Pair]:
    yield "embed/embedding", "model.embed_tokens.weight", _same, _as
    for i in range(cfg.layers):
        ours, theirs = f"layers_{i}", f"model.layers.{i}"
        yield f"{ours}/attn_norm/scale", f"{theirs}.input_layernorm.weight", _same, _as
        for p in ("q", "k", "v"):
            yield f"{ours}/attn/{p}/kernel", f"{theirs}.self_attn.{p}_proj.weight", _q, _q_back
        yield f"{ours}/attn/o/kernel", f"{theirs}.self_attn.o_proj.weight", _o, _t_back
        yield f"{ours}/mlp_norm/scale", f"{theirs}.post_attention_layernorm.weight", _same, _as
        for p in ("gate", "up", "down"):
            yield f"{ours}/{p}/kernel", f"{theirs}.mlp.{p}_proj.weight", _t, _t_back
    yield "norm/scale", "model.norm.weight", _same, _as
    if not cfg.tie_embeddings:
        yield "head/kernel", "lm_head.weight", _t, _t_back


def _gpt2_pairs(cfg: TransformerModel) -> Iterator[Pair]:
    """GPT-2's Conv1D weights are (in, out) like Flax's; its q, k and v are one (d, 3d) matrix,
    written by `to_hf` and split by `from_hf` (the pairs carry the flat (d, d) parts)."""
    yield "embed/embedding", "transformer.wte.weight", _same, _as
    yield "pos_embed/embedding", "transformer.wpe.weight", _same, _as
    for i in range(cfg.layers):
        ours, theirs = f"layers_{i}", f"transformer.h.{i}"
        yield f"{ours}/ln1/scale", f"{theirs}.ln_1.weight", _same, _as
        for p in ("query", "key", "value"):
            yield f"{ours}/attn/{p}/kernel", f"{theirs}.attn.c_attn.weight:{p}", _flat_in, _as
        yield f"{ours}/attn/out/kernel", f"{theirs}.attn.c_proj.weight", _flat_out, _as
        yield f"{ours}/ln2/scale", f"{theirs}.ln_2.weight", _same, _as
        yield f"{ours}/up/kernel", f"{theirs}.mlp.c_fc.weight", _same, _as
        yield f"{ours}/down/kernel", f"{theirs}.mlp.c_proj.weight", _same, _as
    yield "ln_f/scale", "transformer.ln_f.weight", _same, _as
    if not cfg.tie_embeddings:
        yield "head/kernel", "lm_head.weight", _t, _t_back


def _flat_in(x: np.ndarray) -> np.ndarray:  # (d, heads, head_dim) -> (d, d)
    return x.reshape(x.shape[0], -1)


def _flat_out(x: np.ndarray) -> np.ndarray:  # (heads, head_dim, d) -> (d, d)
    return x.reshape(-1, x.shape[-1])


def _pairs(cfg: TransformerModel) -> Iterator[Pair]:
    return _llama_pairs(cfg) if cfg.family == "llama" else _gpt2_pairs(cfg)


def _biases(cfg: TransformerModel) -> dict[str, int]:
    """GPT-2's bias vectors and their lengths: zeros both ways (ours has none)."""
    d, out = cfg.d_model, {"transformer.ln_f.bias": cfg.d_model}
    for i in range(cfg.layers):
        h = f"transformer.h.{i}"
        out |= {f"{h}.ln_1.bias": d, f"{h}.attn.c_attn.bias": 3 * d, f"{h}.attn.c_proj.bias": d,
                f"{h}.ln_2.bias": d, f"{h}.mlp.c_fc.bias": cfg.hidden, f"{h}.mlp.c_proj.bias": d}
    return out


def to_hf(cfg: TransformerModel, params: Mapping[str, np.ndarray]) -> Tensors:
    """Our flat fp32 parameters as Hugging Face's tensors (contiguous, ready to save)."""
    out: Tensors = {}
    qkv: dict[str, list[np.ndarray]] = {}
    for ours, theirs, there, _ in _pairs(cfg):
        x = there(np.asarray(params[ours]))
        if ":" in theirs:
            qkv.setdefault(theirs.partition(":")[0], []).append(x)
        else:
            out[theirs] = x
    out |= {name: np.concatenate(parts, axis=1) for name, parts in qkv.items()}
    if cfg.family == "gpt":
        out |= {name: np.zeros(n, np.float32) for name, n in _biases(cfg).items()}
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def from_hf(cfg: TransformerModel, tensors: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]],
            where: str) -> Tensors:
    """Hugging Face's tensors as our flat fp32 parameters of `shapes` (diloco/shapes.py), with
    an HFError naming what is missing, extra or of the wrong shape."""
    given = {_canonical(cfg, k): v for k, v in tensors.items() if not k.endswith(BUFFERS)}
    if cfg.tie_embeddings:
        given.pop("lm_head.weight", None)  # some checkpoints store the tied head as well
    out: Tensors = {}
    used: set[str] = set()
    for ours, theirs, _, back in _pairs(cfg):
        name, _, part = theirs.partition(":")
        if name not in given:
            raise HFError(f"{where}: no tensor {name!r}; the weights do not match their config.json")
        x = np.asarray(given[name], np.float32)
        if part:  # one third of GPT-2's (d, 3d) c_attn
            x = np.split(x, 3, axis=1)[("query", "key", "value").index(part)] if x.shape[1:] == (3 * cfg.d_model,) else x
        if ours == "pos_embed/embedding":
            x = x[: shapes[ours][0]]  # learned positions: the job's context may be shorter
        used.add(name)
        try:
            out[ours] = np.ascontiguousarray(back(x, shapes[ours]).reshape(shapes[ours]), np.float32)
        except ValueError:
            raise HFError(f"{where}: tensor {name!r} has shape {tuple(given[name].shape)}, which does not fit "
                          f"{ours} {shapes[ours]}; the weights do not match their config.json") from None
    if cfg.family == "gpt":
        for name in _biases(cfg):
            if name in given and np.any(np.asarray(given[name])):
                raise HFError(f"{where}: {name} is not zero: a GPT-2 with biases is not the built-in gpt (which has "
                              "none); only models the gpt family exported start a gpt job")
            used.add(name)
    extra = sorted(given.keys() - used)
    if extra:
        raise HFError(f"{where}: tensors {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''} have no place in "
                      f"the {cfg.family} family; the weights do not match their config.json")
    return out


def _canonical(cfg: TransformerModel, name: str) -> str:
    """Old GPT-2 checkpoints name the body without `transformer.`."""
    if cfg.family == "gpt" and not name.startswith(("transformer.", "lm_head.")):
        return f"transformer.{name}"
    return name


def is_resolved(cfg: TransformerModel) -> bool:
    """Whether `cfg` gives every field its parameter shapes depend on: always, except a
    `pretrained` model before `resolve` (the operator's view: it cannot read the directory)."""
    return cfg.pretrained is None or cfg.model_fields_set >= SHAPED


def _join(location: str, name: str) -> str:
    return f"{location.rstrip('/')}/{name}"


def read_config(location: str) -> dict[str, Any]:
    """config.json of the model directory `location` (a path or an fsspec URL)."""
    where = _join(location, CONFIG)
    try:
        config = json.loads(read(where))
    except FileNotFoundError:
        raise HFError(f"spec.model.pretrained: no {CONFIG} in {location!r}; point it at a Hugging Face model "
                      "directory (what save_pretrained writes)") from None
    except (OSError, ValueError, ImportError) as exc:
        raise HFError(f"spec.model.pretrained: cannot read {where} ({exc})") from None
    if not isinstance(config, dict):
        raise HFError(f"spec.model.pretrained: {where} is not a JSON object")
    return config


def read(url: str) -> bytes:
    """A file's bytes, local or from object storage (gs:// needs gcsfs, s3:// s3fs)."""
    if "://" not in url:
        with open(url, "rb") as fh:
            return fh.read()
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url)
    with fs.open(path, "rb") as fh:
        data: bytes = fh.read()
    return data


def exists(url: str) -> bool:
    if "://" not in url:
        import os

        return os.path.isfile(url)
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url)
    return bool(fs.isfile(path))


def resolve(job: DecoupledDiLoCoJob) -> DecoupledDiLoCoJob:
    """The job with spec.model's architecture read from `pretrained`'s config.json and the data's
    tokenizer defaulted to its tokenizer.json; SpecError names any field the manifest sets otherwise.
    A job without `pretrained` comes back as it is."""
    m = job.spec.model
    if m.pretrained is None:
        return job
    try:
        config = read_config(m.pretrained)
        found = architecture(config, _join(m.pretrained, CONFIG))
    except HFError as exc:
        raise SpecError([str(exc)]) from None
    names = _fields(found["family"])
    given = m.model_dump(exclude_unset=True)
    clashes = [f"spec.model.{to_camel(k)}: the manifest says {given[k]!r} but {_join(m.pretrained, CONFIG)} says "
               f"{names.get(k, 'model_type')} = {v!r}; leave the field out or make them agree"
               for k, v in found.items() if k in given and given[k] != v]
    longest = positions(config)
    if longest is not None and m.context > longest:
        clashes.append(f"spec.model.context: {m.context} is longer than the {longest} positions "
                       f"{_join(m.pretrained, CONFIG)} was made for; lower it to at most {longest}")
    if clashes:
        raise SpecError(clashes)
    model = TransformerModel.model_validate({**given, **found})
    source = job.spec.data.source
    if source.tokenizer is None and exists(_join(m.pretrained, TOKENIZER)):
        source = source.model_copy(update={"tokenizer": _join(m.pretrained, TOKENIZER)})
    data = job.spec.data.model_copy(update={"source": source})
    return job.model_copy(update={"spec": job.spec.model_copy(update={"model": model, "data": data})})
