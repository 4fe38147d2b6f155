"""A learner's training ids and its batches: `Tokens` (ids in segments, read as one without
copying) and `Batches` (one shard's deterministic, resumable batches), which trainer/data/__init__.py
loads and re-exports and trainer/data/streams.py extends for records read as they train.

Apart from trainer/data/__init__.py so the streams can extend `Batches` without importing the loader that
imports them: a Stream names the Batches that read it (`Streamed.batches`).
Batches are plain numpy, not `grain`: its MapDataset (range, shuffle, map, batch) gives the same
random access but measured 5-8x slower (0.15-0.2 ms against 0.03 ms per 8 x 129 batch, 3.6-4.9 ms
against 0.5 ms per 64 x 2049, grain 0.2.18 on CPU: ~50 us per index shuffle call), and a seeded
per-epoch permutation is all we need of it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate
from typing import Protocol

import numpy as np

from diloco.trainer.data import sources


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


class Streamed(Protocol):
    """Ids read as the learner trains (trainer/data/streams.py `Stream`): it names the Batches
    subclass that reads it, so `Batches(stream, ...)` gives that one."""

    @property
    def batches(self) -> type[Batches]: ...


class Batches:
    """One shard's training batches, batch k a pure function of (seed, shard_index, k): a
    restarted learner asks for the batch after the last one merged and continues its shard
    instead of replaying or reshuffling it. Windows lie on a grid of stride length - 1 (every
    id is a target once per epoch), visited in an order drawn afresh each epoch. Over a Stream
    (Parquet, JSON Lines), a StreamBatches: the same contract, its shard read as it trains."""

    def __new__(cls, tokens: Tokens | np.ndarray | Streamed, *args: object, **kwargs: object) -> Batches:
        if cls is Batches and not isinstance(tokens, Tokens | np.ndarray):
            return super().__new__(tokens.batches)
        return super().__new__(cls)

    def __init__(self, tokens: Tokens | np.ndarray | Streamed, batch: int, length: int, *, seed: int,
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
