"""Reading `spec.data.source`'s files: text tokenized (bytes or a Hugging Face tokenizer.json)
and nanoGPT-layout token files (memory-mapped when local).

Every path is a glob, local or an fsspec URL (gs://, s3://, memory://), expanded and sorted so
every learner sees the same list. Errors name the spec field and the fix: they are what a user
reads when a job does not start.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterator, Sequence
from typing import Final

import numpy as np
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from tokenizers import Tokenizer

from diloco import hf

# Documents are joined with the tokenizer's end-of-text token when it has one of these names
# (GPT-2, Llama/SentencePiece, Llama 3, Gemma), else with a newline, as the built-in corpus is.
END_OF_TEXT: Final = hf.END_OF_TEXT
BATCH_FILES: Final = 16  # files tokenized per call: work for the tokenizer's threads, and a progress tick
BATCH_BYTES: Final = 64 << 20  # or fewer files when they are large: memory holds one batch of text
FULL_CHECK_TOKENS: Final = 1 << 30  # up to 1G ids (2 GB of uint16, ~1 s from the page cache) are all checked
SAMPLE_BLOCKS: Final = 256  # above that, this many evenly spaced blocks of SAMPLE_BLOCK ids are checked
SAMPLE_BLOCK: Final = 1 << 20  # 256 x 1M ids: about a second from a cold disk, whatever the data's size

Progress = Callable[[int], None]  # called with the count of bytes just read and tokenized


def expand(pattern: str, field: str) -> list[str]:
    """The files `pattern` matches (directories left out), sorted, as URLs fsspec can open."""
    fs, stripped = url_to_fs(pattern)
    found = fs.glob(stripped, detail=True)
    paths = sorted(p for p, info in found.items() if info.get("type") == "file")
    if not paths:
        raise ValueError(f"{field}: no files match {pattern!r}; check the path (a glob such as "
                         "/data/train/*.txt or gs://bucket/train/*.bin)")
    return [p if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(p) for p in paths]


def read_bytes(url: str) -> bytes:
    fs, path = url_to_fs(url)
    with fs.open(path, "rb") as f:
        raw: bytes = f.read()
    return raw


def read_tokenizer(where: str, field: str) -> Tokenizer | None:
    """The tokenizer.json at `where` (a path or fsspec URL); None for "bytes"."""
    if where == "bytes":
        return None
    try:
        return Tokenizer.from_str(read_bytes(where).decode("utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{field}: no file at {where!r}; give the path of a Hugging Face tokenizer.json, "
                         "or \"bytes\" for byte-level ids") from None
    except Exception as exc:  # tokenizers raises plain Exception for malformed JSON
        raise ValueError(f"{field}: {where!r} is not a tokenizer.json the `tokenizers` library can read "
                         f"({exc}); save one with Tokenizer.save()") from None


def check_vocab(tok: Tokenizer, vocab_size: int, where: str) -> None:
    """Every id the tokenizer can make needs a row in the model's embedding (bytes need none:
    check_ids sees the ids the data actually holds)."""
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise ValueError(f"spec.model.vocabSize: {vocab_size} is smaller than the vocabulary of {where!r} "
                         f"({size} tokens); set spec.model.vocabSize to at least {size}")


def separator(tok: Tokenizer | None) -> np.ndarray:
    """The ids between two documents (see END_OF_TEXT)."""
    if tok is None:
        return np.array([ord("\n")], np.uint32)
    for name in END_OF_TEXT:
        if (i := tok.token_to_id(name)) is not None:
            return np.array([i], np.uint32)
    return np.array(tok.encode("\n", add_special_tokens=False).ids, np.uint32)


def not_utf8(raw: bytes, cut_start: bool = True) -> int | None:
    """Where `raw` stops being UTF-8 (None: it is), a character cut at either end of it aside
    (a text shard is a range of a file's bytes: `cut_start` when it may begin inside one)."""
    lead = 0
    if cut_start:
        while lead < min(3, len(raw)) and 0x80 <= raw[lead] < 0xC0:  # continuation bytes of a cut character
            lead += 1
    try:
        codecs.getincrementaldecoder("utf-8")().decode(raw[lead:], final=False)  # a cut tail waits for more
    except UnicodeDecodeError as exc:
        return lead + exc.start
    return None


def refuse_not_utf8(raw: bytes, url: str, start: int, field: str = "spec.data.source") -> None:
    """Byte-level text must be UTF-8: its ids are the bytes, and 255, which UTF-8 never holds, is
    the end-of-text token (hf.BYTE_END_OF_TEXT). ValueError naming the first byte that is not."""
    at = not_utf8(raw, cut_start=start > 0)
    if at is not None:
        raise ValueError(f"{field}: {url} is not UTF-8 text (byte {start + at:,} is 0x{raw[at]:02x}); byte-level "
                         f"ids are UTF-8 bytes and keep {hf.BYTE_END_OF_TEXT} (0xFF, never in UTF-8) for end-of-text: "
                         "convert the file to UTF-8 (iconv -f latin1 -t utf-8), or give a tokenizer")


def encode(raws: Sequence[bytes], tok: Tokenizer | None) -> list[np.ndarray]:
    """Each document's ids (uint32): its bytes, or its UTF-8 text tokenized whole (a cut inside
    a document could change its ids: pre-tokenizers join whitespace runs, some prepend a space)."""
    if tok is None:
        return [np.frombuffer(raw, np.uint8).astype(np.uint32) for raw in raws]
    texts = [raw.decode("utf-8", errors="replace") for raw in raws]
    return [np.array(e.ids, np.uint32) for e in tok.encode_batch(texts, add_special_tokens=False)]


class Span:
    """Items [start, stop) of one file on object storage, read only when asked and then by byte
    range: a learner reads its own shard and the held-out windows it evaluates, not the corpus.
    Slicing gives another Span, as slicing a memmap gives another view."""

    bytes_read = 0  # every Span's reads in this process (tests count them; progress output could)

    def __init__(self, url: str, dtype: str, start: int, stop: int) -> None:
        self.url, self.dtype, self.start, self.stop = url, dtype, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, key: slice) -> Span:
        start, stop, step = key.indices(len(self))
        assert step == 1, "Spans slice contiguously"
        return Span(self.url, self.dtype, self.start + start, self.start + max(start, stop))

    def read(self) -> np.ndarray:
        itemsize = np.dtype(self.dtype).itemsize
        fs, path = url_to_fs(self.url)
        raw = fs.cat_file(path, self.start * itemsize, self.stop * itemsize) if len(self) else b""
        Span.bytes_read += len(raw)
        return np.frombuffer(raw, dtype=self.dtype)


Segment = np.ndarray | Span


def ids(segment: Segment) -> np.ndarray:
    """A segment's ids in memory (a memmap's are paged in as used)."""
    return segment.read() if isinstance(segment, Span) else segment


def read_tokens(urls: Sequence[str], dtype: str, field: str) -> list[Segment]:
    """Each file as a flat sequence of `dtype` ids, nothing read yet: np.memmap when local, a
    Span on object storage (read by byte range when used). Empty files are left out."""
    out: list[Segment] = []
    for url, size in sized(urls, dtype, field):
        fs, path = url_to_fs(url)
        if isinstance(fs, LocalFileSystem):
            out.append(np.memmap(path, dtype=dtype, mode="r"))
        else:
            out.append(Span(url, dtype, 0, size))
    if not out:
        raise ValueError(f"{field}: every file matched is empty; point it at the .bin files "
                         "`diloco prepare-tokens` wrote")
    return out


def sized(urls: Sequence[str], dtype: str, field: str) -> Iterator[tuple[str, int]]:
    """Each non-empty file with its length in `dtype` items (its size: no data read)."""
    itemsize = np.dtype(dtype).itemsize
    for url in urls:
        fs, path = url_to_fs(url)
        size = int(fs.size(path))
        if size % itemsize:
            raise ValueError(f"{field}: {url!r} has {size} bytes, not a multiple of {itemsize} "
                             f"({dtype}); set spec.data.source.tokenDtype to the dtype the file was written with")
        if size:
            yield url, size // itemsize


def text_spans(urls: Sequence[str], field: str) -> list[Span]:
    """Each text file as a Span of its bytes, nothing read yet (local files too: a learner
    tokenizes only the bytes of its own shard)."""
    spans = [Span(url, "uint8", 0, size) for url, size in sized(urls, "uint8", field)]
    if not spans:
        raise ValueError(f"{field}: every file matched is empty; point it at your .txt files")
    return spans


def stream(spans: Sequence[Segment], tok: Tokenizer | None, progress: Progress | None = None) -> Iterator[np.ndarray]:
    """Byte spans (text files, or parts of them) as ids, in order, BATCH_FILES or BATCH_BYTES of
    text at a time (the tokenizer's threads get work; memory holds one batch). Each part is
    tokenized whole, and parts of different files are joined by `separator(tok)` as whole files
    are. A part cut inside a line is tokenized as the cut text: a few ids at a shard or
    held-out boundary differ from the whole file's."""
    sep, previous, batch = separator(tok), None, []
    for i, span in enumerate(spans):
        batch.append(span)
        if len(batch) < BATCH_FILES and sum(len(b) for b in batch) < BATCH_BYTES and i + 1 < len(spans):
            continue
        raws = [ids(b).tobytes() for b in batch]
        if tok is None:  # byte-level text must be UTF-8 (refuse_not_utf8)
            for part, raw in zip(batch, raws):
                if isinstance(part, Span):
                    refuse_not_utf8(raw, part.url, part.start)
        for part, encoded in zip(batch, encode(raws, tok)):
            url = part.url if isinstance(part, Span) else None
            yield encoded if previous is None or url == previous else np.concatenate([sep, encoded])
            previous = url
        if progress:
            progress(sum(map(len, raws)))
        batch = []


def tokenize(spans: Sequence[Segment], tok: Tokenizer | None) -> list[np.ndarray]:
    """`stream`'s ids, uint16 when they fit (half the memory)."""
    return [a.astype(np.uint16) if a.size and a.max() < 1 << 16 else a for a in stream(spans, tok)]


def check_ids(arrays: Sequence[np.ndarray], vocab_size: int, where: str) -> None:
    """Every id < spec.model.vocabSize (an id past the embedding table trains on garbage, silently
    on accelerators): all of them up to FULL_CHECK_TOKENS, above that SAMPLE_BLOCKS blocks."""
    total = sum(len(a) for a in arrays)
    if total <= FULL_CHECK_TOKENS:
        blocks, how = list(arrays), f"all {total} ids"  # a max over a memmap streams through it
    else:
        blocks = []
        for a in arrays:  # blocks in proportion to each file's length, evenly spaced in it
            n = max(1, min(SAMPLE_BLOCKS * len(a) // total, len(a) // SAMPLE_BLOCK))
            blocks += [a[s : s + SAMPLE_BLOCK] for s in np.linspace(0, max(len(a) - SAMPLE_BLOCK, 0), n, dtype=np.int64)]
        how = f"a sample of {sum(len(b) for b in blocks)} of {total} ids"
    top = max(int(b.max()) for b in blocks if len(b))
    if top >= vocab_size:
        raise ValueError(f"spec.model.vocabSize: {where} holds id {top} (checked {how}), but the model's "
                         f"vocabulary is {vocab_size}; set spec.model.vocabSize to at least {top + 1}, or check "
                         "spec.data.source.tokenDtype and tokenizer")
