"""`diloco prepare-tokens GLOB --out DIR`: text files tokenized once into nanoGPT's layout
(`train.bin`, `val.bin`: flat arrays of ids), for `spec.data.source.kind: tokens`.

Tokenizing is the slow part of reading text; done once here, every learner memory-maps the
result instead of tokenizing at start-up. The ids are the ones `kind: text` would train on
(the same files, order, separators and split of their bytes), streamed to disk a batch of
files at a time (trainer/sources.py: BATCH_FILES, BATCH_BYTES), so memory never holds the
whole corpus.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from diloco.trainer import sources
from diloco.trainer.data import Tokens, split

REPORT_SECONDS = 2.0  # a progress line this often on long inputs: alive, without flooding a log


class Progress:
    """Prints files, bytes and ids done to stderr every REPORT_SECONDS."""

    def __init__(self, files: int) -> None:
        self.files, self.done, self.bytes, self.ids = files, 0, 0, 0
        self.started = self.last = time.monotonic()

    def read(self, size: int) -> None:
        self.bytes += size
        now = time.monotonic()
        if now - self.last >= REPORT_SECONDS:
            self.last = now
            print(f"prepare-tokens: {self.done}/{self.files} files done, {self.bytes / 1e6:.1f} MB, "
                  f"{self.ids / 1e6:.1f} M tokens, {now - self.started:.0f} s", file=sys.stderr, flush=True)


def prepare(pattern: str, out: Path, tokenizer: str, held_out_fraction: float) -> tuple[int, int, str, int]:
    """Writes out/train.bin and out/val.bin; returns their lengths in ids, the dtype and the
    vocabulary size (the least spec.model.vocabSize that fits)."""
    urls = sources.expand(pattern, "GLOB")
    tok = sources.read_tokenizer(tokenizer, "--tokenizer")
    vocab = 256 if tok is None else tok.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)
    try:
        spans = sources.text_spans(urls, "GLOB")
    except ValueError:
        raise ValueError(f"GLOB: the files {pattern!r} matches are empty; point it at the text to tokenize") from None
    # The split `load` makes of text (data.split of the files' bytes), so these are its ids.
    parts = split(Tokens(spans), held_out_fraction)
    out.mkdir(parents=True, exist_ok=True)
    progress, counts, ends = Progress(len(urls)), [], {s.url: s.stop for s in spans}
    for part, name in zip(parts, ("train.bin", "val.bin")):
        with open(out / name, "wb") as f:
            n = 0
            for span, ids in zip(part.segments, sources.stream(part.segments, tok, progress.read)):
                ids.astype(dtype).tofile(f)
                n += len(ids)
                progress.ids += len(ids)
                progress.done += isinstance(span, sources.Span) and span.stop == ends[span.url]  # a file's last part
        counts.append(n)
    return counts[0], counts[1], dtype.name, vocab


def main(args: argparse.Namespace) -> int:
    if not 0 < args.held_out_fraction < 0.5:
        print(f"--held-out-fraction {args.held_out_fraction}: give a fraction in (0, 0.5), as "
              "spec.data.heldOutFraction", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        n_train, n_val, dtype, vocab = prepare(args.glob, out, args.tokenizer, args.held_out_fraction)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    tokenizer = "" if args.tokenizer == "bytes" else f", tokenizer: {args.tokenizer}"
    print(f"wrote {out / 'train.bin'} ({n_train} tokens) and {out / 'val.bin'} ({n_val} tokens), {dtype}\n"
          f"spec.data.source: {{kind: tokens, path: {out / 'train.bin'}, heldOutPath: {out / 'val.bin'}, "
          f"tokenDtype: {dtype}{tokenizer}}}, spec.model.vocabSize: at least {vocab}")
    return 0
