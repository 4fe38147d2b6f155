"""`diloco sample`: text from a trained model, so a user sees what the job learned.

Generation stops at the tokenizer's end-of-text token, the one an hf export's generation config
names (apps/export_hf.py): for bytes id 255 (diloco/hf.py, BYTE_END_OF_TEXT), else the token the
job's documents were joined with (trainer/data/sources.py `separator`). One jitted call per generated token on a fixed (1, context) window: the sequence so far, its
last `context` tokens, sits at the window's start and the rest is padding, which a causal model
never attends to from the position read, so the logits are exact without a KV cache (at our
sizes a cache would save little and cost a second code path per model family).
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from diloco import hf
from diloco.apps.export import ExportError, TrainedModel, job_for, load_export, read_checkpoint
from diloco.spec import DataSource, TransformerModel

log = logging.getLogger("diloco.apps.sample")
SUMMARY_BYTES = 200  # the run summary's sample: a few lines of verse, well under a second on CPU


class Tokenizer(Protocol):
    eos: int | None  # the end-of-text id generation stops at (None: none)

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """Ids are bytes (the builtin corpus and `tokenizer: bytes`); a cut multi-byte character
    decodes as U+FFFD rather than failing, and the end-of-text id 255 and ids past it (a larger
    vocabulary trained on bytes never saw them) are dropped."""

    eos: int | None = hf.BYTE_END_OF_TEXT

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < hf.BYTE_END_OF_TEXT).decode("utf-8", errors="replace")


class FileTokenizer:
    """A Hugging Face tokenizer.json (the `tokenizers` library), as `spec.data.source` trained with."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise ExportError("the `tokenizers` package is not installed: pip install tokenizers") from None
        try:
            self.tok = HFTokenizer.from_file(path)
        except Exception as exc:  # the library raises a bare Exception for unreadable files
            raise ExportError(f"cannot load tokenizer {path}: {exc}; pass --tokenizer tokenizer.json") from None
        self.eos = next((i for i in map(self.tok.token_to_id, hf.END_OF_TEXT) if i is not None), None)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(list(ids)))


def tokenizer_for(cfg: TransformerModel, source: DataSource, override: str | None = None) -> Tokenizer:
    if override is not None:
        return FileTokenizer(override)
    if source.encoding != "bytes":
        return FileTokenizer(source.encoding)
    if source.kind == "tokens" and cfg.vocab_size > 256:
        raise ExportError(f"the job trained on pre-tokenized ids (vocabulary {cfg.vocab_size}) and names no tokenizer: "
                          "pass --tokenizer tokenizer.json, the one that made its shards")
    return ByteTokenizer()


def default_prompt(source: DataSource) -> str:
    """A speaker's name for the plays of the builtin corpus; a line break for anything else."""
    return "ROMEO:" if source.kind == "builtin" else "\n"


@functools.lru_cache(maxsize=8)
def next_token_fn(cfg: TransformerModel) -> Callable[..., int]:
    """The compiled step: (params, window, position, noise, temperature or 1) -> the next id. Sampling
    is the Gumbel-max trick with noise drawn on the host: exact, seeded by numpy, and no device
    PRNG to compile (on CPU that compile alone took longer than the whole summary sample).
    Cached per config: every sample of one model reuses the compiled step."""
    import jax
    import jax.numpy as jnp

    from diloco.trainer.model import apply

    @jax.jit
    def step(params: dict[str, jax.Array], window: jax.Array, pos: jax.Array, noise: jax.Array,
             scale: jax.Array) -> jax.Array:
        return jnp.argmax(apply(cfg, params, window)[0, pos].astype(jnp.float32) / scale + noise)

    return lambda *args: int(step(*args))


def generate(cfg: TransformerModel, params: Mapping[str, np.ndarray], prompt: Sequence[int], tokens: int,
             temperature: float = 0.0, seed: int = 0, stop: int | None = None) -> list[int]:
    """Up to `tokens` new ids after `prompt`: greedy at temperature 0, else drawn with `seed`;
    fewer when the model emits `stop` (the end-of-text id), which ends them and is left out."""
    import jax.numpy as jnp

    if not prompt:
        raise ExportError("the prompt encodes to no tokens: give a non-empty --prompt")
    if max(prompt) >= cfg.vocab_size or min(prompt) < 0:
        raise ExportError(f"the prompt has token ids outside the model's vocabulary of {cfg.vocab_size}: the "
                          "tokenizer is not the one it trained with; pass --tokenizer tokenizer.json")
    if tokens < 0 or temperature < 0:
        raise ExportError("--tokens and --temperature must not be negative")
    step = next_token_fn(cfg)
    device_params = {k: jnp.asarray(v) for k, v in params.items()}
    rng, scale = np.random.default_rng(seed), np.float32(temperature or 1.0)
    greedy = np.zeros(cfg.vocab_size, np.float32)
    ids, window = list(prompt), np.zeros((1, cfg.context), np.int32)
    for _ in range(tokens):
        recent = ids[-cfg.context :]
        window[0, : len(recent)] = recent
        window[0, len(recent) :] = 0
        noise = rng.gumbel(size=cfg.vocab_size).astype(np.float32) if temperature > 0 else greedy
        ids.append(step(device_params, window, np.int32(len(recent) - 1), noise, scale))
        if ids[-1] == stop:
            return ids[len(prompt) : -1]
    return ids[len(prompt) :]


def sample_text(trained: TrainedModel, tok: Tokenizer, prompt: str | None = None, tokens: int = SUMMARY_BYTES,
                temperature: float = 0.0, seed: int = 0) -> str:
    """The prompt and its continuation, decoded together (a tokenizer may merge across the seam),
    ended at the tokenizer's end-of-text token if the model emits it."""
    ids = tok.encode(default_prompt(trained.source) if prompt is None else prompt)
    return tok.decode(ids + generate(trained.model, trained.params, ids, tokens, temperature, seed, stop=tok.eos))


def summary_sample(cfg: TransformerModel, source: DataSource, params: Mapping[str, np.ndarray]) -> str | None:
    """The run summary's short greedy sample; None (and a log line saying why) if it cannot be made:
    a sample is a courtesy and never fails the run."""
    try:
        tok = tokenizer_for(cfg, source)
        tokens = SUMMARY_BYTES if isinstance(tok, ByteTokenizer) else SUMMARY_BYTES // 4  # ~4 bytes a BPE token
        return sample_text(TrainedModel(cfg, source, dict(params), {}), tok, tokens=tokens)
    except Exception as exc:
        log.warning("no sample in the summary: %s: %s", type(exc).__name__, exc)
        return None


def main(args: argparse.Namespace) -> int:
    try:
        if (args.export_dir is None) == (args.checkpoint is None):
            raise ExportError("give an export directory, or --checkpoint CHECKPOINT_DIR (with --config JOB.yaml)")
        if args.export_dir is not None and args.config is not None:
            raise ExportError("--config goes with --checkpoint: an export carries its own config")
        if args.export_dir is not None:
            trained = load_export(Path(args.export_dir))
        else:
            root = Path(args.checkpoint)
            trained = read_checkpoint(job_for(root, args.config), root)
        tok = tokenizer_for(trained.model, trained.source, args.tokenizer)
        print(sample_text(trained, tok, args.prompt, args.tokens, args.temperature, args.seed))
    except ExportError as exc:
        print(f"diloco sample: {exc}", file=sys.stderr)
        return 2
    return 0
