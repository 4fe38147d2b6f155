"""Records of Parquet and JSON Lines files (`spec.data.source.kind: parquet | jsonl`): the units a
source is cut into, which learner reads which, and each unit's documents, a bounded batch at a time.

A unit is what a learner seeks to and what it reads whole: one Parquet row group, read by its
text column only (pyarrow); one byte range of a plain JSON Lines file (UNIT_BYTES), cut at record
boundaries as Hadoop and Spark split text (a range owns the records that begin after a newline
inside it, so each record belongs to exactly one range); or one whole compressed file (`.gz`,
`.zst`: a compressed stream cannot be entered in the middle), streamed through its decompressor.
No file is ever loaded whole. Errors name the file, the field and the fix in one line (DataError).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final

from fsspec.core import url_to_fs

log = logging.getLogger("diloco.learner")

UNIT_BYTES: Final = 64 << 20  # plain JSON Lines ranges: ~16M ids, a few seconds of tokenizing to seek into
READ_BYTES: Final = 1 << 20  # compressed bytes read per call
BATCH_BYTES: Final = 4 << 20  # text handed to the tokenizer at a time: its threads get work, memory stays small
PARQUET_ROWS: Final = 1024  # rows decoded at a time from a row group's text column
# A column chunk is read this much at a time, not whole (nor pre-buffered): memory stays bounded
# whatever a file's row groups weigh (a 200 MB row group added 276 MB resident read whole, 116 MB so).
COLUMN_READ_BYTES: Final = 8 << 20
LIST_THREADS: Final = 16  # Parquet footers and file sizes fetched at once: one round trip each on object storage
PROBE_ROWS: Final = 64  # a Parquet file's first rows of its text column, decoded by `probe`


class DataError(ValueError):
    """Bad input found while reading records: one line naming the file and the fix."""


@dataclass(frozen=True)
class Unit:
    """A part of one file a learner reads whole: Parquet row group `part` (start 0, stop the
    compressed bytes of its text column), or JSON Lines bytes [start, stop) (part: the range's
    number in its file)."""

    url: str
    part: int
    start: int
    stop: int

    @property
    def weight(self) -> int:
        return self.stop - self.start


def compression(url: str) -> str | None:
    """"zst", "gz" or None (plain), from the file's name."""
    name = url.lower()
    return "zst" if name.endswith((".zst", ".zstd")) else "gz" if name.endswith(".gz") else None


def list_units(kind: str, urls: Sequence[str], text_field: str, field: str) -> list[Unit]:
    """Every unit of the files, in file order: Parquet footers (their schema checked for
    `text_field`) or file sizes, fetched LIST_THREADS at a time."""
    with ThreadPoolExecutor(LIST_THREADS) as pool:
        if kind == "parquet":
            per_file = list(pool.map(lambda u: _row_groups(u, text_field, field), urls))
        else:
            per_file = list(pool.map(_ranges, urls))
    units = [u for us in per_file for u in us]
    if not units:
        raise DataError(f"{field}: every file matched is empty; point it at {kind} files with records")
    return units


def _row_groups(url: str, text_field: str, field: str) -> list[Unit]:
    with _opened(url) as f:
        meta = _parquet(f, url, field).metadata
    col = _column(meta, url, text_field)
    return [Unit(url, g, 0, meta.row_group(g).column(col).total_compressed_size) for g in range(meta.num_row_groups)
            if meta.row_group(g).num_rows]


def _column(meta: Any, url: str, text_field: str) -> int:
    """The text column's index in a Parquet footer, or a DataError naming the columns there are."""
    paths = [meta.schema.column(i).path for i in range(meta.num_columns)]
    if text_field not in paths:
        raise DataError(f"spec.data.source.textField: {url} has no column {text_field!r} (its columns: "
                        f"{', '.join(paths) or 'none'}); set textField to the column that holds the text")
    return paths.index(text_field)


def probe(kind: str, url: str, text_field: str, field: str) -> None:
    """What `diloco validate --inputs` and `diloco run` read of one file before anything starts, with
    the learner's own readers, so the same DataError: a Parquet file's footer, its text column and
    that column's first PROBE_ROWS rows; a JSON Lines file's first record and its text field, and
    for .gz and .zst the first READ_BYTES of compressed input (the whole file when it is no longer,
    so one cut inside it is found). Bad input further on is the learner's to find (docs/DATA.md)."""
    if kind == "parquet":
        _probe_parquet(url, text_field, field)
    else:
        _probe_jsonl(url, text_field)


def _probe_parquet(url: str, text_field: str, field: str) -> None:
    with _opened(url) as f:
        pf = _parquet(f, url, field)
        _column(pf.metadata, url, text_field)
        groups = [g for g in range(pf.metadata.num_row_groups) if pf.metadata.row_group(g).num_rows]
        if not groups:
            return  # an empty file: list_units refuses a glob of nothing else
        with _corrupt(url, groups[0]):
            batch = next(pf.iter_batches(batch_size=PROBE_ROWS, row_groups=groups[:1], columns=[text_field],
                                         use_threads=False), None)
            if batch is not None:
                _text_column(batch.column(0), text_field, url)


def _probe_jsonl(url: str, text_field: str) -> None:
    reader = Reader("jsonl", text_field)
    fs, path = url_to_fs(url)
    size = int(fs.size(path))
    with fs.open(path, "rb") as f:
        plain = compression(url) is None
        lines = _range_lines(f, 0, size) if plain else _split_lines(_decompressed(f, url))
        whole = not plain and size <= READ_BYTES  # a small compressed file is read on to its end
        found = False
        for offset, line in lines:
            if not found and line.strip():  # records that are not UTF-8 are skipped, as the learner skips them
                found = reader._record(line, url, f"byte {offset}" if plain else f"byte {offset} (decompressed)") is not None
            if not whole and (found or offset > BATCH_BYTES):
                return


def _opened(url: str) -> Any:
    """The file through fsspec, unbuffered: pyarrow asks for the footer and the column chunks it
    needs, and every byte it reads is counted where fsspec counts."""
    fs, path = url_to_fs(url)
    return fs.open(path, "rb", cache_type="none")


def _parquet(f: Any, url: str, field: str) -> Any:
    """pyarrow's ParquetFile over an open file; a corrupt file is a DataError naming it."""
    import pyarrow as pa  # type: ignore[import-untyped]
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    try:
        return pq.ParquetFile(f, buffer_size=COLUMN_READ_BYTES, pre_buffer=False)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{field}: {url} is not a Parquet file pyarrow can read ({_short(exc)}); remove it "
                        "from the glob or rewrite it") from None


def _ranges(url: str) -> list[Unit]:
    fs, path = url_to_fs(url)
    size = int(fs.size(path))
    if compression(url):
        return [Unit(url, 0, 0, size)] if size else []
    return [Unit(url, i, a, min(a + UNIT_BYTES, size)) for i, a in enumerate(range(0, size, UNIT_BYTES))]


def assign(units: Sequence[Unit], index: int, count: int, layout: str = "contiguous") -> list[Unit]:
    """Learner `index` of `count`'s units, disjoint and together all of them: `contiguous`, a run
    of consecutive units of about 1/count of the bytes (different files per learner); or
    `interleaved`, every count-th unit (each learner a row group or range of every file)."""
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} outside 0..{count - 1}")
    if len(units) < count:
        raise DataError(f"spec.data.shards: {count} shards, but the training data has only {len(units)} units "
                        "(Parquet row groups, JSON Lines ranges of 64 MiB, compressed files); use fewer shards "
                        "or learners, or files with more, smaller row groups")
    if layout == "interleaved":
        return list(units[index::count])
    cuts = _cuts(units, count)
    return list(units[cuts[index] : cuts[index + 1]])


def _cuts(units: Sequence[Unit], count: int) -> list[int]:
    """Where each contiguous shard begins (and the end): the first unit at or past s/count of the
    bytes, at least one unit per shard."""
    total, before, i, cuts = sum(u.weight for u in units), 0, 0, [0]
    for s in range(1, count):
        while i < len(units) and before * count < s * total:
            before += units[i].weight
            i += 1
        cuts.append(min(max(i, cuts[-1] + 1), len(units) - (count - s)))
    return [*cuts, len(units)]


def split_units(units: Sequence[Unit], fraction: float) -> tuple[list[Unit], list[Unit]]:
    """(training, held-out): the trailing units that make `fraction` of the bytes are held out,
    at least one, the same for every learner (what the other kinds hold out, by units)."""
    if len(units) < 2:
        raise DataError("spec.data.source.heldOutPath: the data is one unit (one row group or range), "
                        "too little to hold any out; give held-out files in heldOutPath")
    total, held, i = sum(u.weight for u in units), 0, len(units)
    while i > 1 and (i == len(units) or held < fraction * total):
        i -= 1
        held += units[i].weight
    return list(units[:i]), list(units[i:])


class Reader:
    """Each unit's documents as UTF-8 text, in file order, about BATCH_BYTES at a time. Records
    that are not UTF-8 (or not encodable as it) are skipped, counted and warned about: one bad
    record in a crawl must not stop a job (docs/DATA.md)."""

    def __init__(self, kind: str, text_field: str) -> None:
        self.kind, self.text_field = kind, text_field
        self.skipped = 0  # records skipped in this process, for every unit read
        self._open: tuple[str, Any, Any] | None = None  # the last Parquet file: its footer is read once

    def close(self) -> None:
        if self._open is not None:
            self._open[1].close()
            self._open = None

    def documents(self, unit: Unit) -> Iterator[list[str]]:
        before = self.skipped
        batches = self._parquet(unit) if self.kind == "parquet" else self._jsonl(unit)
        yield from _batched(batches)
        if self.skipped > before:
            log.warning("skipped %d records of %s (part %d) that are not UTF-8 text; %d in all so far",
                        self.skipped - before, unit.url, unit.part, self.skipped)

    def _parquet(self, unit: Unit) -> Iterator[str]:
        if self._open is None or self._open[0] != unit.url:
            self.close()
            f = _opened(unit.url)
            self._open = (unit.url, f, _parquet(f, unit.url, "spec.data.source.path"))
        pf = self._open[2]
        with _corrupt(unit.url, unit.part):
            for batch in pf.iter_batches(batch_size=PARQUET_ROWS, row_groups=[unit.part], columns=[self.text_field],
                                         use_threads=False):
                for raw in _text_column(batch.column(0), self.text_field, unit.url).to_pylist():
                    if raw is not None:
                        yield from self._text(raw)

    def _text(self, raw: bytes) -> Iterator[str]:
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError:
            self.skipped += 1

    def _jsonl(self, unit: Unit) -> Iterator[str]:
        fs, path = url_to_fs(unit.url)
        with fs.open(path, "rb") as f:
            plain = compression(unit.url) is None
            lines = _range_lines(f, unit.start, unit.stop) if plain else _split_lines(_decompressed(f, unit.url))
            for offset, line in lines:
                text = self._record(line, unit.url, f"byte {offset}" if plain else f"byte {offset} (decompressed)")
                if text is not None:
                    yield text

    def _record(self, line: bytes, url: str, offset: str) -> str | None:
        if not line.strip():
            return None
        try:
            record = json.loads(line)
        except UnicodeDecodeError:
            self.skipped += 1
            return None
        except ValueError as exc:
            raise DataError(f"spec.data.source.path: {url} at {offset} is not a JSON record ({exc}); "
                            "kind jsonl reads one JSON object per line") from None
        if not isinstance(record, dict) or self.text_field not in record or not isinstance(record[self.text_field], str):
            fields = ", ".join(sorted(record)) if isinstance(record, dict) else f"a JSON {type(record).__name__}"
            what = "no" if not isinstance(record, dict) or self.text_field not in record else "a non-string"
            raise DataError(f"spec.data.source.textField: the record at {offset} of {url} has {what} field "
                            f"{self.text_field!r} (its fields: {fields}); set textField to the field that holds the text")
        text: str = record[self.text_field]
        if b"\\ud" in line or b"\\uD" in line:  # an escaped lone surrogate decodes, but is not UTF-8
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                self.skipped += 1
                return None
        return text


def _text_column(column: Any, text_field: str, url: str) -> Any:
    """A batch's text column as binary (decoded by the caller), or a DataError if it is not text."""
    import pyarrow as pa

    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return column.cast(pa.large_binary())
    if not (pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
        raise DataError(f"spec.data.source.textField: column {text_field!r} of {url} holds "
                        f"{column.type}, not text; set textField to a string column")
    return column


@contextlib.contextmanager
def _corrupt(url: str, group: int) -> Iterator[None]:
    """A row group that cannot be decoded is a DataError naming it; an error reading it (the
    network, a vanished file) is raised as it is: a restart may succeed."""
    import pyarrow as pa

    try:
        yield
    except (pa.ArrowException, OSError) as exc:
        if not _decoding(exc):
            raise
        raise DataError(f"spec.data.source.path: {url} row group {group} cannot be read "
                        f"({_short(exc)}); the file is corrupt: remove or rewrite it") from None


def _batched(texts: Iterator[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _range_lines(f: Any, start: int, stop: int) -> Iterator[tuple[int, bytes]]:
    """The records that begin in (start, stop] after a newline (or at 0): Hadoop's LineRecordReader
    rule, so consecutive ranges split a file's records between them exactly."""
    f.seek(start)
    at = start
    if start > 0:
        at += len(f.readline())  # the first newline at or after start ends the previous range's record
    while at <= stop:
        line = f.readline()
        if not line:
            break
        yield at, line
        at += len(line)


def _split_lines(chunks: Iterator[bytes]) -> Iterator[tuple[int, bytes]]:
    """Lines of a decompressed stream, each with its offset in the decompressed bytes."""
    rest, at = b"", 0
    for chunk in chunks:
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        for line in lines:
            yield at, line
            at += len(line) + 1
    if rest:
        yield at, rest


def _decompressed(f: Any, url: str) -> Iterator[bytes]:
    """A .gz or .zst file's bytes, READ_BYTES of input at a time; a truncated or corrupt stream is
    a DataError naming the compressed bytes it was found in (zstandard's stream reader would end
    quietly at a cut: each frame's end is checked)."""
    import zstandard

    at = [0, 0]  # the compressed bytes read by the call that failed: [file position before it, after it]
    frame = 0  # where the zstd frame being decompressed begins: every frame before it was read whole
    try:
        if compression(url) == "gz":
            with gzip.GzipFile(fileobj=f) as gz:
                while True:
                    at = [at[1], at[1]]
                    chunk = gz.read(READ_BYTES)
                    at[1] = f.tell()
                    if not chunk:
                        return
                    yield chunk
        dctx = zstandard.ZstdDecompressor()
        obj, fed = dctx.decompressobj(), False
        while data := f.read(READ_BYTES):
            at = [at[1], at[1] + len(data)]
            pos = at[0]  # data[0]'s place in the file
            while data:
                yield obj.decompress(data)
                fed = True
                if obj.eof:  # a frame ended: the next one (if any) starts in unused_data
                    pos += len(data) - len(obj.unused_data)
                    frame, data, obj, fed = pos, obj.unused_data, dctx.decompressobj(), False
                else:
                    data = b""
        if fed:
            raise EOFError(f"the last zstd frame has no end: the file stops at byte {at[1]:,}")
    except (EOFError, OSError, zlib.error, zstandard.ZstdError) as exc:
        if isinstance(exc, OSError) and not isinstance(exc, gzip.BadGzipFile) and not _decoding(exc):
            raise  # reading failed, not decoding (the network, a vanished file): a restart may succeed
        with contextlib.suppress(OSError, ValueError):
            at[1] = max(at[1], f.tell())  # gzip read ahead of the bytes it failed on
        where = f"in the zstd frame at byte {frame:,}, " if compression(url) == "zst" else ""
        raise DataError(f"spec.data.source.path: {url} is truncated or corrupt ({_short(exc)}; {where}found in its "
                        f"compressed bytes {at[0]:,} to {at[1]:,}); download it again or remove it from the glob") from None


def _decoding(exc: BaseException) -> bool:
    """Whether an error is the data's (pyarrow's IOError status is a bare OSError without errno:
    a page header that does not parse, a stream that ends early), not the reading's: fsspec's and
    the OS's I/O errors carry an errno or are OSError's subclasses (ConnectionError, FileNotFoundError)."""
    return not isinstance(exc, OSError) or (type(exc) is OSError and exc.errno is None)


def _short(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
