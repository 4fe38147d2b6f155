"""The front door: what `diloco validate --inputs` and `diloco run` read of a job's data before
anything starts, with the learner's own readers (trainer/data/records.py, trainer/data/sources.py)
and so with its messages, one line each naming the field, the file and the fix.

Of the first group's copy of the data (spec.data_for; the others hold the same files and sizes,
compared by diloco/copy_listings.py), every file the globs match, 16 at a time:
- parquet: the footer, the text column (there, and text), its first 64 rows decoded;
- jsonl: the first record and its text field; of a .gz or .zst file the first 1 MiB of
  compressed input, the whole file when it is no longer (so a small file cut short is found);
- text: the first 64 KiB, which for byte-level ids must be UTF-8 (sources.refuse_not_utf8);
- tokens: the size (a multiple of tokenDtype), the first 64K ids (each below vocabSize), and the
  manifest.json `diloco prepare-tokens` wrote beside them (its dtype and vocabulary);
and what the learner refuses from the listing alone: the tokenizer (read, its vocabulary within
vocabSize), Parquet and JSON Lines units too few for the shards or for a held-out split.

A bounded read, not the learner's whole one: a corrupt row group mid-file or a cut in a large
compressed file is found by the learner when it reaches it, which ends with the same line as its
fatal event and `diloco run` reports it (apps/local/runner.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Final

import numpy as np
from fsspec.core import url_to_fs

from diloco import inputs
from diloco.trainer.data import STREAMED, records, sources

if TYPE_CHECKING:
    from diloco.spec import Data, DecoupledDiLoCoJob

PROBE_BYTES: Final = 64 << 10  # text: the first bytes of each file
PROBE_IDS: Final = 64 << 10  # tokens: the first ids of each file
MANIFEST: Final = "manifest.json"  # what prepare-tokens writes beside its shards (apps/tokens/output.py)


def problems(job: DecoupledDiLoCoJob) -> list[str]:
    """One `field: problem; fix` line per problem found in the job's data (empty: none)."""
    spec = job.spec
    src, out = spec.data.source, []
    try:
        tok = sources.read_tokenizer(src.encoding, "spec.data.source.tokenizer")
        if tok is not None:
            sources.check_vocab(tok, spec.model.vocab_size, src.encoding)
    except ValueError as exc:
        out.append(str(exc))
    # The first group's copy: every copy holds the same files and sizes (diloco/copy_listings.py,
    # compared before this by diloco/inputs.py), and a far region's copy is not read from here.
    data = spec.data_for(spec.learner_groups[0].name)
    if data.source.kind != "builtin":
        out += _copy(data, spec.model.vocab_size, spec.shard_count)
    return out


def _copy(data: Data, vocab_size: int, shards: int) -> list[str]:
    """One copy's files: listed as the learner lists them, then each read a little, then (Parquet
    and JSON Lines) its units counted against a held-out split and the shards."""
    src = data.source
    urls: dict[str, list[str]] = {}
    units: dict[str, list[records.Unit]] = {}
    try:
        for field, pattern in (("spec.data.source.path", src.path), ("spec.data.source.heldOutPath", src.held_out_path)):
            if pattern is None:
                continue
            urls[field] = sources.expand(pattern, field)
            if src.kind in STREAMED:  # Parquet footers: not Parquet, no text column; no records at all
                units[field] = records.list_units(src.kind, urls[field], src.record_field, field)
            elif src.kind == "text":  # every file empty
                sources.text_spans(urls[field], field)
            else:
                sources.read_tokens(urls[field], src.token_dtype, field)
    except (ValueError, OSError, ImportError) as exc:
        return [_line(exc, "spec.data.source.path")]
    checks = [(field, url) for field, found in urls.items() for url in found]
    lines: list[str | None] = []
    if src.kind == "tokens":  # a folder whose manifest is refused: its shards are not read one by one
        refused = {d: _manifest(d, src.token_dtype, vocab_size) for d in sorted({_folder(u) for _, u in checks})}
        lines += refused.values()
        checks = [(field, url) for field, url in checks if refused[_folder(url)] is None]
    check = _checker(data, vocab_size)
    with ThreadPoolExecutor(records.LIST_THREADS) as pool:
        lines += pool.map(lambda fu: check(*fu), checks)
    found = [line for line in lines if line is not None]
    if units and not found:
        try:
            train = units["spec.data.source.path"]
            if "spec.data.source.heldOutPath" not in units:
                train = records.split_units(train, data.held_out_fraction)[0]
            records.assign(train, 0, shards, data.sharding)
        except ValueError as exc:
            found.append(_line(exc, "spec.data.source.path"))
    return found


def _folder(url: str) -> str:
    return url.rpartition("/")[0]


def _checker(data: Data, vocab_size: int) -> Callable[[str, str], str | None]:
    src = data.source

    def check(field: str, url: str) -> str | None:
        try:
            if src.kind in STREAMED:
                records.probe(src.kind, url, src.record_field, field)
            elif src.kind == "text":
                if src.encoding == "bytes":
                    sources.refuse_not_utf8(_head(url, PROBE_BYTES), url, 0, field)
            else:
                _tokens(url, field, src.token_dtype, vocab_size)
        except (ValueError, OSError, ImportError) as exc:
            return _line(exc, field, url)
        return None

    return check


def _head(url: str, size: int) -> bytes:
    fs, path = url_to_fs(url)
    raw: bytes = fs.cat_file(path, 0, size)
    return raw


def _tokens(url: str, field: str, dtype: str, vocab_size: int) -> None:
    """A token file's size, and its first PROBE_IDS ids against the vocabulary (the learner checks
    them all, sources.check_ids)."""
    for _, n in sources.sized([url], dtype, field):
        ids = np.frombuffer(_head(url, min(n, PROBE_IDS) * np.dtype(dtype).itemsize), dtype=dtype)
        top = int(ids.max())
        if top >= vocab_size:
            raise ValueError(f"spec.model.vocabSize: {url} holds id {top} in its first {len(ids):,} ids, but the "
                             f"model's vocabulary is {vocab_size}; set spec.model.vocabSize to at least {top + 1}, "
                             "or check spec.data.source.tokenDtype and tokenizer")


def _manifest(folder: str, dtype: str, vocab_size: int) -> str | None:
    """The manifest.json `diloco prepare-tokens` wrote beside its shards, if there is one: the
    shards' dtype and the vocabulary they were tokenized with, against the spec's."""
    where = f"{folder}/{MANIFEST}" if folder else MANIFEST
    fs, path = url_to_fs(where)
    try:
        if not fs.isfile(path):
            return None
        manifest = json.loads(fs.cat_file(path))
    except (OSError, ValueError):
        return None  # not prepare-tokens' (or unreadable): the shards' own ids are checked
    if not isinstance(manifest, dict):
        return None
    if manifest.get("dtype") not in (None, dtype):
        return (f"spec.data.source.tokenDtype: {where} says its shards hold {manifest['dtype']} ids, not {dtype}; "
                f"set tokenDtype: {manifest['dtype']}")
    vocab = manifest.get("vocab")
    if isinstance(vocab, int) and vocab > vocab_size:
        return (f"spec.model.vocabSize: {where} says its shards were tokenized with a vocabulary of {vocab:,} ids "
                f"({manifest.get('tokenizer')}), but the model's is {vocab_size:,}; set spec.model.vocabSize to at "
                "least that, or point spec.data.source.path at shards of the job's tokenizer")
    return None


def _line(exc: BaseException, field: str, url: str | None = None) -> str:
    """The learner's own message (field: problem; fix); for a reader this install lacks, the extra
    that has it; for an error reading a file, one naming it."""
    if isinstance(exc, ValueError):
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, ImportError):
        return inputs.missing_reader(field, exc.name or str(exc))
    what = f"cannot read {url}" if url else "cannot list the files"
    return f"{field}: {what} ({type(exc).__name__}: {exc}); check the path and your access to it"
