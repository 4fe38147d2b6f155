"""What `diloco prepare-tokens` reads and how one piece of it becomes ids: the inputs (text files,
Parquet, JSON Lines), cut into pieces a worker tokenizes whole, in an order that fixes the output.

A piece of Parquet or JSON Lines is a records unit (trainer/data/records.py: a row group, a byte range
of a plain file, a whole compressed file), read with records.Reader and encoded as `kind: parquet`
and `kind: jsonl` encode it (streams.encode: each document followed by the separator). A piece of
text is a byte range of one file: files are tokenized whole up to TEXT_WHOLE_BYTES, as `kind: text`
does; a larger file is cut every TEXT_CHUNK_BYTES at the first line start that follows (a newline
then a byte that is not whitespace), where a byte-level BPE (GPT-2's pre-tokenizer) and bytes give
the whole file's ids, and memory stays bounded. Pieces of different files are joined by the
separator, as `kind: text` joins files. No JAX here: workers are spawned processes.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
from fsspec.core import url_to_fs

from diloco.trainer.data import records, sources, streams

TEXT_WHOLE_BYTES: Final = 4 << 20  # a text file up to this is tokenized in one piece, exactly as kind: text
TEXT_CHUNK_BYTES: Final = 1 << 20  # a larger one is cut about this often, at line starts
TEXT_PIECE_BYTES: Final = 64 << 20  # a piece of a large text file (one task), as records.UNIT_BYTES
ALIGN_READ: Final = 64 << 10  # bytes read at a time looking for a line start
ORPHAN_POLL: Final = 0.5  # seconds between a worker's checks that its parent lives
WHITESPACE: Final = b" \t\n\r\x0b\x0c"
Tick = Callable[[int, int], None]  # (text bytes, ids) just tokenized


@dataclass(frozen=True)
class Piece:
    """One task: records unit `part` of `url` (bytes [start, stop)), or text bytes [start, stop)
    whose ends move to the next line start when `align_start` / `align_stop` (never past `limit`).
    `lead_sep`: a text piece that begins a file (not a split's first) starts with the separator."""

    split: str
    url: str
    part: int
    start: int
    stop: int
    align_start: bool = False
    align_stop: bool = False
    limit: int = 0
    lead_sep: bool = False

    @property
    def weight(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Job:
    """What every worker needs to tokenize any piece (pickled once per worker process)."""

    kind: str
    text_field: str
    tokenizer: str  # a tokenizer.json's text, or "bytes"
    dtype: str
    chunk_bytes: int = TEXT_CHUNK_BYTES
    whole_bytes: int = TEXT_WHOLE_BYTES


def infer_kind(urls: Sequence[str], kind: str) -> str:
    """`--kind`, or the kind every file's name says (.parquet; .jsonl/.ndjson/.json, maybe .gz or
    .zst; anything else is text)."""
    if kind != "auto":
        return kind

    def of(url: str) -> str:
        name = url.lower().removesuffix(".gz").removesuffix(".zst").removesuffix(".zstd")
        return "parquet" if name.endswith(".parquet") else "jsonl" if name.endswith((".jsonl", ".ndjson", ".json")) \
            else "text"

    kinds = {of(u) for u in urls}
    if len(kinds) > 1:
        raise ValueError(f"GLOB: the files are of several kinds ({', '.join(sorted(kinds))}); match one kind, or "
                         "give --kind")
    return kinds.pop()


def fingerprint(url: str) -> dict[str, Any]:
    """A file's size and, where the filesystem gives one, its modification stamp: a changed input."""
    fs, path = url_to_fs(url)
    info = fs.info(path)
    stamp = next((str(info[k]) for k in ("mtime", "LastModified", "last_modified", "updated", "ETag", "etag",
                                         "md5Hash", "created") if info.get(k) is not None), "")
    return {"url": url, "size": int(info["size"]), "stamp": stamp}


def tokenizer_id(tokenizer: str) -> str:
    return "bytes" if tokenizer == "bytes" else hashlib.sha256(tokenizer.encode()).hexdigest()


def plan(kind: str, urls: Sequence[str], sizes: Sequence[int], text_field: str,
         held_out_fraction: float) -> dict[str, list[Piece]]:
    """The pieces of each split, in output order: records units with the trailing ones held out
    (records.split_units, as kind parquet/jsonl), or text bytes with the last fraction held out
    (data.split of the bytes, as kind text)."""
    if kind != "text":
        units = records.list_units(kind, urls, text_field, "GLOB")
        train, val = records.split_units(units, held_out_fraction)
        return {"train": [Piece("train", u.url, u.part, u.start, u.stop) for u in train],
                "val": [Piece("val", u.url, u.part, u.start, u.stop) for u in val]}
    total = sum(sizes)
    if not total:
        raise ValueError("GLOB: the files matched are empty; point it at the text to tokenize")
    cut, at = int(total * (1 - held_out_fraction)), 0
    out: dict[str, list[Piece]] = {"train": [], "val": []}
    for url, size in zip(urls, sizes):
        # A file's exact boundaries: its ends and the held-out cut when it falls inside it.
        edges = sorted({0, size, *([cut - at] if at < cut < at + size else [])})
        for lo, hi in itertools.pairwise(edges):
            split = "train" if at + lo < cut else "val"
            cuts = list(range(lo, hi, TEXT_PIECE_BYTES))[1:]
            bounds = [lo, *cuts, hi]
            for i, (a, b) in enumerate(itertools.pairwise(bounds)):
                first_of_file = a == 0
                out[split].append(Piece(split, url, len(out[split]), a, b, align_start=i > 0, align_stop=i < len(cuts),
                                        limit=hi, lead_sep=first_of_file and bool(out[split])))
        at += size
    return out


def line_start(f: Any, at: int, limit: int) -> int:
    """The first position p >= at whose byte follows a newline and is not whitespace (else limit)."""
    if at <= 0:
        return 0
    f.seek(at - 1)
    pos = at - 1
    prev = b""
    while pos < limit:
        buf = f.read(min(ALIGN_READ, limit - pos + 1))
        if not buf:
            return limit
        data = prev + buf
        base = pos - len(prev)
        i = data.find(b"\n", max(0, at - 1 - base))
        while i != -1 and i + 1 < len(data):
            if data[i + 1] not in WHITESPACE and base + i + 1 >= at:
                return min(base + i + 1, limit)
            i = data.find(b"\n", i + 1)
        prev, pos = data[-1:], pos + len(buf)
    return limit


class Tokenizing:
    """A worker's tokenizer and reader, made once per process."""

    def __init__(self, job: Job) -> None:
        from tokenizers import Tokenizer

        self.job = job
        self.tok = None if job.tokenizer == "bytes" else Tokenizer.from_str(job.tokenizer)
        self.sep = sources.separator(self.tok)
        self.reader = records.Reader(job.kind, job.text_field) if job.kind != "text" else None

    def pieces(self, piece: Piece) -> Iterator[tuple[int, np.ndarray]]:
        """The piece's ids a batch at a time, with the text bytes each batch came from."""
        if self.reader is not None:
            unit = records.Unit(piece.url, piece.part, piece.start, piece.stop)
            for texts in self.reader.documents(unit):
                yield sum(len(t) for t in texts), streams.encode(texts, self.tok, self.sep)
            return
        yield from self._text(piece)

    def _text(self, piece: Piece) -> Iterator[tuple[int, np.ndarray]]:
        fs, path = url_to_fs(piece.url)
        with fs.open(path, "rb") as f:
            start = line_start(f, piece.start, piece.limit) if piece.align_start else piece.start
            stop = line_start(f, piece.stop, piece.limit) if piece.align_stop else piece.stop
            # A whole file (or one side of the held-out cut) small enough: in one piece, as kind: text.
            whole = not (piece.align_start or piece.align_stop) and stop - start <= self.job.whole_bytes
            lead, at, batch = piece.lead_sep, start, []
            while at < stop:
                end = stop if whole or at + self.job.chunk_bytes >= stop else line_start(f, at + self.job.chunk_bytes, stop)
                f.seek(at)
                batch.append(f.read(end - at))
                at = end
                if sum(map(len, batch)) >= records.BATCH_BYTES or at >= stop:
                    ids = np.concatenate(sources.encode(batch, self.tok)) if batch else np.zeros(0, np.uint32)
                    yield sum(map(len, batch)), np.concatenate([self.sep, ids]) if lead else ids
                    lead, batch = False, []
            if lead:  # an empty piece that begins a file still separates it
                yield 0, self.sep.copy()


_WORKER: Tokenizing | None = None
_TICK: Tick | None = None


def init_worker(job: Job, counters: Any, threads: int) -> None:
    """A spawned worker: its tokenizer's threads (so workers x threads fills the cores) and the
    shared counters progress reads."""
    global _WORKER, _TICK
    threading.Thread(target=_orphaned, args=(os.getppid(),), name="orphan-watch", daemon=True).start()
    if threads:
        os.environ["RAYON_NUM_THREADS"] = os.environ["RAYON_RS_NUM_CPUS"] = str(threads)
    _WORKER = Tokenizing(job)

    def tick(text: int, ids: int) -> None:
        with counters.get_lock():
            counters[0] += text
            counters[1] += ids

    _TICK = tick


def _orphaned(parent: int) -> None:
    """A worker whose parent died (SIGKILL, OOM) exits instead of tokenizing for no one."""
    while os.getppid() == parent:
        time.sleep(ORPHAN_POLL)
    os._exit(1)


def tokenize_piece(piece: Piece, spool: str, worker: Tokenizing | None = None,
                   tick: Tick | None = None) -> tuple[int, int, int]:
    """Writes the piece's ids to `spool` (the job's dtype): a worker's task. Returns how many ids,
    how many records were skipped as not UTF-8 (records.Reader counts them) and the text's bytes."""
    worker, tick = worker or _WORKER, tick or _TICK
    assert worker is not None, "init_worker first"
    n, done, skipped = 0, 0, worker.reader.skipped if worker.reader else 0
    with open(spool, "wb") as f:
        for text, ids in worker.pieces(piece):
            ids.astype(worker.job.dtype).tofile(f)
            n += len(ids)
            done += text
            if tick is not None:
                tick(text, len(ids))
    return n, (worker.reader.skipped if worker.reader else 0) - skipped, done
