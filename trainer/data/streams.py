"""A learner's shard of Parquet or JSON Lines records as training batches, streamed: its units
(trainer/data/records.py) read in a seeded order each epoch, documents tokenized on a background
thread a block ahead of the step, and batch k a pure function of (seed, shard, k), as for token
files (trainer/data/batches.py `Batches`), so a restarted learner resumes exactly where it stopped.

The epoch's stream is its units' documents in order, each followed by the separator text files
are joined with (`sources.separator`); windows of `length` ids lie on a grid of stride length - 1
(every id a target once an epoch); BLOCK_TOKENS of them at a time (a block) are visited in a
seeded order, so a batch mixes documents. Where window j lies needs the ids each unit holds,
known only once it is tokenized: every unit's count is kept in an index (`Stream.counts`), saved
beside the learner's compiled programs ($DILOCO_STEP_CACHE_DIR, or a local JAX cache). A restart
with the index re-reads only the unit it stopped in; without it, it counts the units of the
epoch before that point once (tokenizing them, keeping nothing).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final, NamedTuple

import numpy as np

from diloco.contract import STEP_CACHE_ENV
from diloco.trainer.caches import cache_file
from diloco.trainer.data import sources
from diloco.trainer.data.batches import Batches
from diloco.trainer.data.records import DataError, Reader, Unit, log

if TYPE_CHECKING:
    from tokenizers import Tokenizer

BLOCK_TOKENS: Final = 1 << 20  # ids shuffled together: ~4 MB of text, about a second to tokenize on a core
PREFETCH_BLOCKS: Final = 2  # blocks tokenized ahead of the step (the bounded queue)
HELD_OUT_TOKENS: Final = 1 << 20  # the held-out ids kept for the evaluation windows: the first of its documents
INDEX_SAVE_SECONDS: Final = 30.0  # the count index is rewritten at most this often as units are read
CACHE_DIRS: Final = (STEP_CACHE_ENV, "JAX_COMPILATION_CACHE_DIR")  # where the index is kept: the first local folder set


class Stream:
    """A shard's units, not read yet, and how to read and tokenize them. `counts[i]`: the ids of
    units[i] (its documents, each with a separator), -1 until known."""

    def __init__(self, units: Sequence[Unit], kind: str, text_field: str, tok: Tokenizer | None, vocab_size: int,
                 *, index_dir: str | None = None) -> None:
        self.units, self.kind, self.text_field, self.tok, self.vocab_size = list(units), kind, text_field, tok, vocab_size
        self.sep = sources.separator(tok)
        self.weights = np.array([u.weight for u in self.units], np.float64)
        self.counts = np.full(len(self.units), -1, np.int64)
        self.index_path = self._index_path(index_dir) if index_dir else None
        self._saved = time.monotonic()
        if self.index_path is not None:
            stored = cache_file.read(self.index_path, "token-count index")
            if stored is not None and stored.get("counts", np.zeros(0)).shape == self.counts.shape:
                self.counts = stored["counts"].astype(np.int64)

    @property
    def batches(self) -> type[StreamBatches]:
        """What `Batches(stream, ...)` gives (batches.Streamed): a shard read as it trains."""
        return StreamBatches

    def _index_path(self, where: str) -> Path:
        tok = "bytes" if self.tok is None else hashlib.sha256(self.tok.to_str().encode()).hexdigest()
        what = {"units": [(u.url, u.part, u.start, u.stop) for u in self.units], "kind": self.kind,
                "field": self.text_field, "tokenizer": tok, "version": 1}
        return Path(where) / f"stream-index-{hashlib.sha256(json.dumps(what).encode()).hexdigest()[:32]}.npz"

    def tokens(self, i: int, reader: Reader) -> Iterator[np.ndarray]:
        """Unit i's ids, a batch of documents at a time (each document followed by the separator)."""
        unit, n = self.units[i], 0
        for texts in reader.documents(unit):
            ids = encode(texts, self.tok, self.sep)
            if len(ids) and int(ids.max()) >= self.vocab_size:
                raise DataError(f"spec.model.vocabSize: {unit.url} gives id {int(ids.max())}, but the model's "
                                f"vocabulary is {self.vocab_size}; set spec.model.vocabSize to at least {int(ids.max()) + 1}")
            n += len(ids)
            yield ids
        self.learned(i, n)

    def learned(self, i: int, n: int) -> None:
        """Unit i holds n ids (it was just read whole): kept, and now and then saved."""
        if self.counts[i] not in (-1, n):  # the file changed under the same name: positions shift
            log.warning("%s (part %d) now holds %d ids, the index said %d: it changed since it was first read",
                        self.units[i].url, self.units[i].part, n, self.counts[i])
        complete = self.counts[i] < 0 and int((self.counts < 0).sum()) == 1  # the last unknown count
        self.counts[i] = n
        if complete or time.monotonic() - self._saved >= INDEX_SAVE_SECONDS:
            self.save()

    def count(self, i: int, reader: Reader) -> int:
        if self.counts[i] < 0:
            for _ in self.tokens(i, reader):
                pass
        return int(self.counts[i])

    def save(self) -> None:
        self._saved = time.monotonic()
        if self.index_path is not None:
            cache_file.write(self.index_path, {"counts": self.counts.copy()}, "token-count index")


def index_dir() -> str | None:
    """The local folder the count index is kept in (see CACHE_DIRS), or None."""
    for name in CACHE_DIRS:
        where = os.environ.get(name)
        if where and "://" not in where:
            return where
    return None


def encode(texts: Sequence[str], tok: Tokenizer | None, sep: np.ndarray) -> np.ndarray:
    """The documents' ids, each followed by `sep`, as one uint32 array (the tokenizer's batch
    encoding: its threads share the work)."""
    if tok is None:
        docs = [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]
    else:
        docs = [np.asarray(e.ids, np.uint32) for e in tok.encode_batch(list(texts), add_special_tokens=False)]
    return np.concatenate([part for d in docs for part in (d, sep)]).astype(np.uint32) if docs else np.zeros(0, np.uint32)


def held_out(stream: Stream, limit: int = HELD_OUT_TOKENS) -> np.ndarray:
    """The first `limit` ids of the held-out units, in order: the same documents for every learner."""
    reader, parts, n = Reader(stream.kind, stream.text_field), [], 0
    for i in range(len(stream.units)):
        for ids in stream.tokens(i, reader):
            parts.append(ids)
            n += len(ids)
            if n >= limit:
                break
        if n >= limit:
            break
    reader.close()
    out = np.concatenate(parts)[:limit] if parts else np.zeros(0, np.uint32)
    return out.astype(np.uint16) if out.size and out.max() < 1 << 16 else out


class Block(NamedTuple):
    start: int  # the block's first position among all batches' windows
    windows: np.ndarray  # (n, length) int32, in the order they are visited

    @property
    def end(self) -> int:
        return self.start + len(self.windows)


class StreamBatches(Batches):
    """`Batches` over a Stream: batch k is windows [kB, (k+1)B) of the shard's epochs, each epoch
    its units in a seeded order and each block of windows visited in a seeded order."""

    def __init__(self, tokens: Stream, batch: int, length: int, *, seed: int, shard_index: int) -> None:
        self.stream = tokens
        self.batch_size, self.length, self.seed, self.shard_index = batch, length, seed, shard_index
        self.stride = length - 1
        self.block = max(1, BLOCK_TOKENS // self.stride)  # windows per block
        self._reader = Reader(tokens.kind, tokens.text_field)  # the caller's thread's (counting)
        self._queue: queue.Queue[Block | BaseException] = queue.Queue(PREFETCH_BLOCKS)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cur: Block | None = None
        self._cur = self._seek(0)  # the first block now: bad input is found before the learner compiles

    def windows_in(self, ids: int) -> int:
        return (ids - self.length) // self.stride + 1 if ids >= self.length else 0

    def epoch_windows(self) -> int | None:
        """Windows in an epoch, once every unit's count is known."""
        return None if (self.stream.counts < 0).any() else self.windows_in(int(self.stream.counts.sum()))

    def unit_order(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed % (1 << 64), self.shard_index, epoch, 1])
        return rng.permutation(len(self.stream.units))

    def batch(self, k: int) -> np.ndarray:
        """Batch k (from 0) as int32 (batch, length). Bad input found mid-run (a corrupt row
        group, a cut .zst frame, a record without the text field) raises its DataError here, in
        the caller's thread, whichever thread read it: the learner ends on it with a fatal event
        and Exit.CONFIG (trainer/learner.py), as restarting would meet it again."""
        rows, j, end = [], k * self.batch_size, (k + 1) * self.batch_size
        while j < end:
            cur = self._cur
            if cur is None or not cur.start <= j < cur.end:
                if cur is not None and j == cur.end:
                    nxt = self._take()
                    cur = nxt if nxt.start == j else None
                if cur is None or not cur.start <= j < cur.end:  # a seek: a restart, or batch(0) before it
                    cur = self._seek(j)
                self._cur = cur
            take = min(end - j, cur.end - j)
            rows.append(cur.windows[j - cur.start : j - cur.start + take])
            j += take
        return np.concatenate(rows)

    def epoch(self, k: int) -> float:
        """Passes over the shard batches 0..k-1 make (estimated from the units read so far while
        the first epoch's length is unknown)."""
        known = self.stream.counts >= 0
        if not known.any():
            return 0.0
        weights = self.stream.weights
        ids = self.stream.counts[known].sum() * max(weights.sum(), 1.0) / max(weights[known].sum(), 1.0)
        return k * self.batch_size / max(self.windows_in(int(ids)), 1)

    def _block_of(self, j: int) -> tuple[int, int]:
        """(epoch, block) of window position j, counting units of the first epoch as needed."""
        windows = self.epoch_windows()
        if j == 0:
            return 0, 0
        if windows is None:
            seen = 0
            for i in self.unit_order(0):
                seen += self.stream.count(int(i), self._reader)
                if self.windows_in(seen) > j:
                    self.stream.save()
                    return 0, j // self.block
            self.stream.save()
            windows = self.windows_in(seen)
        if windows == 0:
            raise self._too_short()
        return j // windows, j % windows // self.block

    def _too_short(self) -> DataError:
        return DataError(f"spec.data: shard {self.shard_index} has {int(self.stream.counts.sum())} tokens, fewer "
                         f"than one window (spec.model.context + 1 = {self.length}); add training data, lower "
                         "spec.model.context or use fewer shards (spec.data.shards, the learners)")

    def _seek(self, j: int) -> Block:
        """The block holding window position j, from a producer started there."""
        self._halt()
        epoch, block = self._block_of(j)
        self._queue = queue.Queue(PREFETCH_BLOCKS)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(epoch, block, self._queue, self._stop),
                                        name="stream-tokenizer", daemon=True)
        self._thread.start()
        return self._take()

    def _halt(self) -> None:
        """Stop the producer (it uses the count index and the tokenizer: one thread at a time)."""
        if self._thread is not None:
            self._stop.set()
            while self._thread.is_alive():
                try:
                    self._queue.get(timeout=0.05)
                except queue.Empty:
                    pass
            self._thread.join()
            self._thread = None

    def _take(self) -> Block:
        got = self._queue.get()
        if isinstance(got, BaseException):
            self._thread = None  # it has ended
            raise got
        return got

    def _produce(self, epoch: int, block: int, out: queue.Queue[Block | BaseException], stop: threading.Event) -> None:
        reader = Reader(self.stream.kind, self.stream.text_field)
        try:
            while not stop.is_set():
                self._epoch(epoch, block, out, stop, reader)
                epoch, block = epoch + 1, 0
        except BaseException as exc:  # handed to the consumer, which raises it
            _put(out, exc, stop)
        finally:
            reader.close()
            self.stream.save()

    def _epoch(self, epoch: int, block: int, out: queue.Queue[Block | BaseException], stop: threading.Event,
               reader: Reader) -> None:
        """Blocks `block`, block + 1, ... of `epoch`, to its end."""
        order, offset, seen, p = self.unit_order(epoch), block * self.block * self.stride, 0, 0
        while p < len(order) and seen + self.stream.count(int(order[p]), reader) <= offset:
            seen += int(self.stream.counts[order[p]])
            p += 1
        skip, pending, size, need = offset - seen, [], 0, self.block * self.stride + 1
        for i in order[p:]:
            for ids in self.stream.tokens(int(i), reader):
                if stop.is_set():
                    return
                cut = min(skip, len(ids))
                skip -= cut
                if cut < len(ids):
                    pending.append(ids[cut:])
                    size += len(ids) - cut
                while size >= need:
                    buf = np.concatenate(pending)
                    _put(out, self._cut(epoch, block, buf, self.block), stop)
                    pending, size, block = [buf[self.block * self.stride :]], len(buf) - self.block * self.stride, block + 1
        last = self.windows_in(size)
        if self.epoch_windows() == 0:
            raise self._too_short()
        if last:
            _put(out, self._cut(epoch, block, np.concatenate(pending), last), stop)

    def _cut(self, epoch: int, block: int, buf: np.ndarray, n: int) -> Block:
        """Block `block` of `epoch`: its n windows of buf, in their seeded order."""
        view = np.lib.stride_tricks.sliding_window_view(buf, self.length)[:: self.stride][:n]
        rng = np.random.default_rng([self.seed % (1 << 64), self.shard_index, epoch, block])
        start = (epoch * (self.epoch_windows() or 0)) + block * self.block
        return Block(start, view[rng.permutation(n)].astype(np.int32))


def _put(out: queue.Queue[Block | BaseException], item: Block | BaseException, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            out.put(item, timeout=0.1)
            return
        except queue.Full:
            pass
