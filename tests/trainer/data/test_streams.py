"""spec.data.source kind parquet and jsonl (trainer/data/records.py, trainer/data/streams.py): each learner
reads only its own units (row groups by their text column, JSON Lines byte ranges cut at records,
whole compressed files), the shards are disjoint and cover the training split, batch k is a pure
function of (seed, shard, k) so a restarted learner goes on exactly where it stopped, and bad input
is one clear line. Files are written here with pyarrow and zstandard, read through fsspec."""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
import zstandard
from fsspec.implementations.memory import MemoryFileSystem

from diloco.contract import Exit
from diloco.spec import Data, SpecError, parse_job
from diloco.trainer import data
from diloco.trainer.data import records, streams
from diloco.trainer.data.records import DataError, Reader
from tests.helpers import TINY_MODEL, diloco_run

WINDOW = 17  # context 16 + 1


class Counted(io.BytesIO):
    """A file of CountingFS: every byte it hands out is counted, per path."""

    def __init__(self, raw: bytes, path: str) -> None:
        super().__init__(raw)
        self.path = path

    def read(self, n: int | None = -1) -> bytes:
        got = super().read(n)
        CountingFS.read[self.path] += len(got)
        return got

    def readline(self, n: int | None = -1) -> bytes:
        got = super().readline(n)
        CountingFS.read[self.path] += len(got)
        return got

    def readinto(self, b: Any) -> int:
        n = super().readinto(b)
        CountingFS.read[self.path] += n
        return n


class CountingFS(MemoryFileSystem):
    """fsspec's in-memory filesystem under `counted://`, counting what its files return."""

    protocol = "counted"
    read: ClassVar[Counter[str]] = Counter()

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return MemoryFileSystem._strip_protocol(path.removeprefix("counted://"))

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        f = super()._open(path, mode, **kwargs)
        return Counted(f.getvalue(), self._strip_protocol(path)) if mode == "rb" else f


fsspec.register_implementation("counted", CountingFS, clobber=True)


def documents(tag: str, n: int, rng: random.Random) -> list[str]:
    """n distinct documents of uneven length (a few words to a few hundred bytes), each naming itself."""
    words = ["alpha", "beta", "gamma", "delta", "épée", "naïve", "x"]
    return [f"<{tag}-{i}> " + " ".join(rng.choice(words) for _ in range(rng.randint(0, 60))) for i in range(n)]


def write_parquet(path: str, groups: list[list[str]], *, blob: int = 0, binary: bool = False) -> None:
    """One row group per list; `blob` bytes of another column per row (never to be read)."""
    text_type = pa.binary() if binary else pa.string()
    schema = pa.schema([("id", pa.int64()), ("text", text_type), ("blob", pa.binary())])
    with fsspec.open(path, "wb", auto_mkdir=True) as f, pq.ParquetWriter(f, schema, compression="none",
                                                                                write_statistics=["id", "text"], use_dictionary=False) as w:
        for g in groups:
            texts: list[Any] = [t.encode() if binary and isinstance(t, str) else t for t in g]
            w.write_table(pa.table({"id": list(range(len(g))), "text": pa.array(texts, text_type),
                                    "blob": [bytes(blob)] * len(g)}, schema=schema))


def jsonl(docs: list[str], **extra: Any) -> bytes:
    return b"".join(json.dumps({"id": i, "text": d, **extra}).encode() + b"\n" for i, d in enumerate(docs))


def write(path: str, raw: bytes) -> None:
    with fsspec.open(path, "wb", auto_mkdir=True) as f:
        f.write(raw)


def corpus(root: str, kind: str, rng: random.Random) -> list[str]:
    """Several files of uneven sizes: Parquet with 1-4 row groups each, or .jsonl.zst (two frames
    in one file), plain .jsonl and .jsonl.gz. Returns every document written."""
    every: list[str] = []
    for f in range(4):
        if kind == "parquet":
            groups = [documents(f"p{f}g{g}", rng.randint(1, 25), rng) for g in range(1 + f % 4)]
            write_parquet(f"{root}/part-{f}.parquet", groups)
            every += [d for g in groups for d in g]
        else:
            docs = documents(f"j{f}", rng.randint(5, 60), rng)
            every += docs
            raw = jsonl(docs)
            if f % 3 == 0:
                half = raw.index(b"\n", len(raw) // 2) + 1
                write(f"{root}/part-{f}.jsonl.zst", zstandard.ZstdCompressor().compress(raw[:half])
                      + zstandard.ZstdCompressor().compress(raw[half:]))
            elif f % 3 == 1:
                write(f"{root}/part-{f}.jsonl", raw)
            else:
                write(f"{root}/part-{f}.jsonl.gz", gzip.compress(raw))
    return every


def source(kind: str, root: str, **extra: Any) -> Data:
    pattern = f"{root}/*.parquet" if kind == "parquet" else f"{root}/*.jsonl*"
    return Data.model_validate({"source": {"kind": kind, "path": pattern, **extra}, "heldOutFraction": 0.1})


def texts(units: list[records.Unit], kind: str) -> list[str]:
    reader = Reader(kind, "text")
    got = [t for u in units for batch in reader.documents(u) for t in batch]
    reader.close()
    return got


@pytest.fixture
def small_units(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain JSON Lines cut into 300-byte ranges, so a file is many units; blocks of 64 ids."""
    monkeypatch.setattr(records, "UNIT_BYTES", 300)
    monkeypatch.setattr(streams, "BLOCK_TOKENS", 64)


@pytest.mark.parametrize("layout", ["contiguous", "interleaved"])
@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_shards_are_disjoint_and_cover_the_training_split(tmp_path: Path, kind: str, layout: str,
                                                          small_units: None) -> None:
    every = corpus(str(tmp_path), kind, random.Random(1))
    spec = source(kind, str(tmp_path), heldOutPath=str(tmp_path / "held" / "*"))
    if kind == "parquet":
        write_parquet(str(tmp_path / "held" / "v.parquet"), [documents("held", 40, random.Random(2))])
    else:
        write(str(tmp_path / "held" / "v.jsonl"), jsonl(documents("held", 40, random.Random(2))))
    spec = spec.model_copy(update={"sharding": layout})
    for count in (1, 2, 3):
        shards = [data.load(spec, 256, WINDOW, shard=(i, count)) for i in range(count)]
        got = [texts(c.train.units, kind) for c in shards]  # type: ignore[union-attr]
        assert all(got), "every learner has documents"
        flat = [t for g in got for t in g]
        assert len(flat) == len(set(flat)) == len(every) and set(flat) == set(every), count
        held = [c.held_out.array().astype(np.uint8).tobytes().decode() for c in shards]
        assert held[1:] == held[:-1] and "<held-0>" in held[0] and "<p" not in held[0] and "<j" not in held[0]
    # Without heldOutPath the held-out documents are trailing units, the same for all, trained by none.
    plain = source(kind, str(tmp_path)).model_copy(update={"sharding": layout})
    trained = [t for i in range(3) for t in texts(data.load(plain, 256, WINDOW, shard=(i, 3)).train.units, kind)]  # type: ignore[union-attr]
    units = records.list_units(kind, sorted(str(p) for p in tmp_path.glob("part-*")), "text", "path")
    _, held_units = records.split_units(units, 0.1)
    held_docs = texts(held_units, kind)
    assert held_docs and set(trained).isdisjoint(held_docs) and set(trained) | set(held_docs) == set(every)


def test_every_window_of_a_learner_is_its_own_documents(tmp_path: Path, small_units: None) -> None:
    """The batches of one epoch hold only the learner's own documents, each followed by the
    separator (a newline for bytes), and every window's ids are a run of its shard's stream."""
    corpus(str(tmp_path), "jsonl", random.Random(3))
    spec = source("jsonl", str(tmp_path))
    for i in range(2):
        c = data.load(spec, 256, WINDOW, shard=(i, 2))
        mine = set(texts(c.train.units, "jsonl"))  # type: ignore[union-attr]
        b = data.Batches(c.train, 4, WINDOW, seed=0, shard_index=i)
        assert isinstance(b, streams.StreamBatches)
        windows = np.concatenate([b.batch(k) for k in range(30)])
        stream = "".join(d + "\n" for d in mine)
        for w in windows:
            inner = bytes(w.astype(np.uint8)).decode("utf-8", errors="ignore").split("\n")[1:-1]
            assert all(t in mine for t in inner), inner
            assert all(part in stream for part in bytes(w.astype(np.uint8)).decode("utf-8", "ignore").split("\n"))


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_a_restarted_learner_goes_on_exactly_where_it_stopped(tmp_path: Path, kind: str, small_units: None,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch k after a restart (with the count index kept, and without it) equals an uninterrupted
    learner's batch k: inside an epoch, across block and epoch ends."""
    corpus(str(tmp_path), kind, random.Random(4))
    spec = source(kind, str(tmp_path))
    monkeypatch.setenv("DILOCO_STEP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)

    def learner() -> data.Batches:
        return data.Batches(data.load(spec, 256, WINDOW, shard=(1, 2)).train, 16, WINDOW, seed=7, shard_index=1)

    whole = learner()
    assert isinstance(whole, streams.StreamBatches)
    straight: list[np.ndarray] = []
    while whole.epoch_windows() is None:  # the first epoch's length is known once it is read
        straight.append(whole.batch(len(straight)))
    epoch_batches = whole.epoch_windows() // 16  # type: ignore[operator]
    last = 2 * epoch_batches + 5
    straight += [whole.batch(k) for k in range(len(straight), last + 2)]
    assert epoch_batches > 10, "blocks and epochs of several batches"
    assert not np.array_equal(straight[0], straight[epoch_batches + 1]), "each epoch has its own order"
    for k in (1, 7, epoch_batches - 1, epoch_batches, epoch_batches + 3, last):
        again = learner()  # a new process: the index in the cache folder, nothing else
        assert isinstance(again, streams.StreamBatches) and again.epoch_windows() == whole.epoch_windows()
        again.batch(0)  # the learner compiles its step on batch 0 before it resumes
        assert np.array_equal(again.batch(k), straight[k]), k
        assert np.array_equal(again.batch(k + 1), straight[k + 1]), k
    monkeypatch.delenv("DILOCO_STEP_CACHE_DIR")  # no index: the units before the cursor are counted
    cold = learner()
    assert isinstance(cold, streams.StreamBatches) and cold.stream.index_path is None
    assert cold.epoch_windows() is None  # no index: only the first block's units are counted yet
    assert np.array_equal(cold.batch(epoch_batches + 3), straight[epoch_batches + 3])
    assert np.array_equal(cold.batch(5), straight[5])


def test_a_learner_reads_only_its_row_groups_by_their_text_column(small_units: None) -> None:
    """Through fsspec's own reads: each learner's document reads touch only its row groups'
    text column chunks (the 64 KiB blob column beside them is never read) and the files' footers."""
    rng = random.Random(5)
    CountingFS.store.clear()
    for f in range(3):
        write_parquet(f"counted://pq/part-{f}.parquet",
                      [documents(f"p{f}g{g}", rng.randint(2, 20), rng) for g in range(2 + f)], blob=1 << 16)
    spec = Data.model_validate({"source": {"kind": "parquet", "path": "counted://pq/*.parquet",
                                           "heldOutPath": "counted://pq/part-0.parquet"}})
    sizes = {f"/pq/part-{f}.parquet": len(CountingFS.store[f"/pq/part-{f}.parquet"].getvalue()) for f in range(3)}
    for i in range(3):
        c = data.load(spec, 256, WINDOW, shard=(i, 3))
        units = c.train.units  # type: ignore[union-attr]
        CountingFS.read.clear()
        texts(units, "parquet")
        files = {u.url.removeprefix("counted://") for u in units}
        assert set(CountingFS.read) == files, "no other file is opened"
        for path in files:
            own = sum(u.weight for u in units if u.url.endswith(path))
            # pyarrow reads the footer with the file's last 64 KiB in one read (Arrow's default)
            assert own <= CountingFS.read[path] <= own + (64 << 10) + 64, (path, own, CountingFS.read[path])
            assert CountingFS.read[path] < sizes[path] / 4  # the blob column is most of the file


def test_a_learner_reads_only_its_byte_ranges_of_json_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through fsspec's own reads: a plain file's ranges (1000 bytes here), each read to the end of
    the record it ends in, and a compressed file whole, by the one learner it belongs to."""
    monkeypatch.setattr(records, "UNIT_BYTES", 1000)
    rng = random.Random(6)
    CountingFS.store.clear()
    docs, zdocs = documents("j", 200, rng), documents("z", 50, rng)
    write("counted://jl/a.jsonl", jsonl(docs))
    write("counted://jl/b.jsonl.zst", zstandard.ZstdCompressor().compress(jsonl(zdocs)))
    write("counted://jl/held/v.jsonl", jsonl(documents("v", 20, rng)))
    spec = Data.model_validate({"source": {"kind": "jsonl", "path": "counted://jl/*.jsonl*",
                                           "heldOutPath": "counted://jl/held/*.jsonl"}})
    longest = max(len(line) for line in jsonl(docs).splitlines(keepends=True))
    zsize = len(CountingFS.store["/jl/b.jsonl.zst"].getvalue())
    seen: list[str] = []
    for i in range(3):
        units = data.load(spec, 256, WINDOW, shard=(i, 3)).train.units  # type: ignore[union-attr]
        CountingFS.read.clear()
        seen += texts(units, "jsonl")
        own = sum(u.weight for u in units if u.url.endswith("a.jsonl"))
        ranges = sum(u.url.endswith("a.jsonl") for u in units)
        # its ranges, the rest of the record each range ends in, nothing else
        assert own <= CountingFS.read["/jl/a.jsonl"] <= own + ranges * longest, (own, CountingFS.read)
        whole = any(u.url.endswith(".zst") for u in units)
        assert CountingFS.read["/jl/b.jsonl.zst"] == (zsize if whole else 0)
        assert set(CountingFS.read) <= {"/jl/a.jsonl", "/jl/b.jsonl.zst"}
    assert sorted(seen) == sorted(docs + zdocs)


def test_hadoop_ranges_give_each_record_to_exactly_one_range() -> None:
    """Every cut of a file into ranges, records cut anywhere (a range starting on a newline, in a
    record, at a record's first byte)."""
    raw = jsonl(documents("r", 30, random.Random(7)))
    for size in (1, 2, 7, 50, 113, len(raw) - 1, len(raw)):
        got = [line for a in range(0, len(raw), size)
               for _, line in records._range_lines(io.BytesIO(raw), a, min(a + size, len(raw)))]
        assert b"".join(got) == raw, size


def test_bad_input_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def load(kind: str, pattern: str, **extra: Any) -> None:
        where = str(tmp_path / pattern)  # held out too: one file is one unit
        data.load(Data.model_validate({"source": {"kind": kind, "path": where, "heldOutPath": where, **extra}}),
                  256, WINDOW)

    def one_line(exc: pytest.ExceptionInfo[ValueError], *parts: str) -> None:
        text = str(exc.value)
        assert "\n" not in text and all(p in text for p in parts), text

    write_parquet(str(tmp_path / "p.parquet"), [documents("a", 5, random.Random(0))] * 2)
    with pytest.raises(ValueError) as exc:
        load("parquet", "p.parquet", textField="content")
    one_line(exc, "textField", "'content'", "p.parquet", "id, text, blob")

    write(str(tmp_path / "bad.parquet"), b"PAR1" + bytes(100) + b"PAR1")
    with pytest.raises(ValueError) as exc:
        load("parquet", "bad.parquet")
    one_line(exc, "spec.data.source.path", "bad.parquet", "not a Parquet file")

    write(str(tmp_path / "r.jsonl"), jsonl(["one", "two"]) + b'{"body": "three", "id": 3}\n' + jsonl(["four"]) * 20)
    with pytest.raises(ValueError) as exc:
        load("jsonl", "r.jsonl")
    one_line(exc, "textField", "'text'", "r.jsonl", f"byte {len(jsonl(['one', 'two']))} ", "fields: body, id")

    raw = zstandard.ZstdCompressor().compress(jsonl(documents("t", 400, random.Random(1))))
    write(str(tmp_path / "t.jsonl.zst"), raw[: len(raw) * 2 // 3])
    with pytest.raises(ValueError) as exc:
        load("jsonl", "t.jsonl.zst")
    one_line(exc, "t.jsonl.zst", "truncated or corrupt")
    write(str(tmp_path / "g.jsonl.gz"), gzip.compress(jsonl(documents("g", 400, random.Random(1))))[:-30])
    with pytest.raises(ValueError) as exc:
        load("jsonl", "g.jsonl.gz")
    one_line(exc, "g.jsonl.gz", "truncated or corrupt")

    write(str(tmp_path / "n.jsonl"), b"not json\n")
    with pytest.raises(ValueError) as exc:
        load("jsonl", "n.jsonl")
    one_line(exc, "n.jsonl", "byte 0", "not a JSON record")


def test_non_utf8_records_are_skipped_and_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    good = documents("u", 40, random.Random(2))
    write(str(tmp_path / "u.jsonl"), jsonl(good[:20]) + b'{"text": "caf\xe9"}\n' + b'{"text": "\\ud800"}\n'
          + jsonl(good[20:]))
    write_parquet(str(tmp_path / "u.parquet"), [[d.encode() for d in good[:20]] + [b"caf\xe9"]],  # type: ignore[list-item]
                  binary=True)
    for kind, name, bad in (("jsonl", "u.jsonl", 2), ("parquet", "u.parquet", 1)):
        units = records.list_units(kind, [str(tmp_path / name)], "text", "path")
        reader = Reader(kind, "text")
        with caplog.at_level("WARNING", "diloco.learner"):
            got = [t for u in units for b in reader.documents(u) for t in b]
        assert reader.skipped == bad and got == good[: len(got)] and len(got) == (40 if kind == "jsonl" else 20)
        assert f"skipped {bad} records of {tmp_path / name}" in caplog.text


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_bad_input_mid_run_is_the_learners_fatal_event(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch, small_units: None,
                                                       kind: str) -> None:
    """A unit found corrupt after start-up (the learner is training; the background thread read
    it): a Parquet row group whose page header does not parse (pyarrow's bare OSError, once a
    crash a restart met again), a .zst frame with bytes flipped. `batch` raises its DataError in
    the learner's thread; the learner's loop turns it into a fatal event and the termination
    message, one line naming the file, the row group or compressed bytes, and the fix (run then
    flushes and exits Exit.CONFIG)."""
    from diloco.contract import TERMINATION_LOG_ENV
    from diloco.trainer import learner

    rng = random.Random(3)
    if kind == "parquet":
        write_parquet(str(tmp_path / "a.parquet"), [documents("a", 20, rng)])
        bad = tmp_path / "b.parquet"
        write_parquet(str(bad), [documents(f"b{g}", 30, rng) for g in range(3)])
        page = pq.ParquetFile(bad).metadata.row_group(1).column(1).data_page_offset  # the text column's first page
        where, pattern = "row group 1 cannot be read", "[ab].parquet"
    else:
        write(str(tmp_path / "a.jsonl"), jsonl(documents("a", 20, rng)))
        bad = tmp_path / "b.jsonl.zst"
        frames = [zstandard.ZstdCompressor().compress(jsonl(documents(f"b{f}", 100, rng))) for f in range(2)]
        write(str(bad), b"".join(frames))
        page = len(frames[0]) + len(frames[1]) // 2  # inside the second frame
        monkeypatch.setattr(records, "READ_BYTES", 256)  # where it was found, to 256 bytes: the frame's end (its checksum)
        end = len(frames[0]) + len(frames[1])
        where, pattern = f"in the zstd frame at byte {len(frames[0]):,}, found in its compressed bytes {end // 256 * 256:,} to {end:,}", "[ab].jsonl*"
    raw = bytearray(bad.read_bytes())
    raw[page : page + 16] = bytes(b ^ 0x5A for b in raw[page : page + 16])
    bad.write_bytes(bytes(raw))
    held = str(tmp_path / ("v.parquet" if kind == "parquet" else "v.jsonl"))
    if kind == "parquet":
        write_parquet(held, [documents("v", 20, rng)])
    else:
        write(held, jsonl(documents("v", 20, rng)))
    spec = Data.model_validate({"source": {"kind": kind, "path": str(tmp_path / pattern), "heldOutPath": held}})
    # seed 1: the bad unit is not the first the epoch reads, so it is found mid-run, not at the start
    b = data.Batches(data.load(spec, 256, WINDOW).train, 2, WINDOW, seed=1, shard_index=0)
    with pytest.raises(DataError) as exc:
        for k in range(10_000):
            b.batch(k)
    line = str(exc.value)
    assert k > 0 and "\n" not in line, (k, line)
    assert line.startswith(f"spec.data.source.path: {bad} ") and where in line and line.endswith(
        "remove it from the glob" if kind == "jsonl" else "remove or rewrite it"), line

    log = tmp_path / "termination-log"
    monkeypatch.setenv(TERMINATION_LOG_ENV, str(log))
    b = data.Batches(data.load(spec, 256, WINDOW).train, 2, WINDOW, seed=1, shard_index=0)
    capsys.readouterr()
    got = [learner._next_batch(b, j) for j in range(k + 1)]
    assert all(g is not None for g in got[:-1]) and got[-1] is None
    event = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (event["event"], event["reason"]) == ("fatal", line) and log.read_text() == line
    assert records._decoding(OSError("Couldn't deserialize thrift")) and not records._decoding(ConnectionError())


def test_spec_validates_the_record_fields() -> None:
    ok = Data.model_validate({"source": {"kind": "parquet", "path": "gs://b/fineweb/*.parquet"}})
    assert ok.source.record_field == "text" and ok.source.text_field is None
    assert Data.model_validate({"source": {"kind": "jsonl", "path": "x/*.jsonl.zst", "textField": "body"}})
    with pytest.raises(ValueError, match=r"source\.path: kind 'jsonl' reads files"):
        Data.model_validate({"source": {"kind": "jsonl"}})
    with pytest.raises(ValueError, match=r"source\.textField: kind 'text' has no records"):
        Data.model_validate({"source": {"kind": "text", "path": "a/*.txt", "textField": "body"}})
    with pytest.raises(SpecError, match="textField"):
        parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "x"},
                   "spec": {"data": {"source": {"kind": "parquet", "path": "a", "textField": ""}}}})


def test_shard_assignment_is_balanced_and_needs_a_unit_per_shard() -> None:
    units = [records.Unit("f", i, 0, w) for i, w in enumerate([5, 100, 3, 3, 90, 1, 1, 1])]
    for count in range(1, 9):
        parts = [records.assign(units, i, count) for i in range(count)]
        assert [u for p in parts for u in p] == units and all(parts)
    even = [records.Unit("f", i, 0, 10) for i in range(10)]
    assert [len(records.assign(even, i, 3)) for i in range(3)] in ([3, 4, 3], [4, 3, 3], [3, 3, 4])
    with pytest.raises(DataError, match=r"spec\.data\.shards: 9 shards, but the training data has only 8 units"):
        records.assign(units, 0, 9)



@pytest.mark.e2e
def test_a_job_trains_on_parquet_row_groups(tmp_path: Path) -> None:
    """`diloco run`: two learners train the tiny model on the built-in plays as a Parquet file of
    one row group per play (the held-out split its trailing row groups), to spec.training.steps."""
    plays = [p.decode("utf-8", errors="replace") for p in data.corpus_plays()]
    write_parquet(str(tmp_path / "data" / "plays-0.parquet"), [[p] for p in plays[:20]])
    write_parquet(str(tmp_path / "data" / "plays-1.parquet"), [[p] for p in plays[20:]])
    job = {"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "parquet"},
           "spec": {"learnerGroups": [{"name": "local", "replicas": 2}], "syncer": {"fragments": 2},
                    "model": dict(TINY_MODEL),
                    "data": {"source": {"kind": "parquet", "path": str(tmp_path / "data" / "*.parquet")}},
                    "training": {"batchSize": 8, "learningRate": 0.006, "warmupSteps": 5, "steps": 40,
                                 "evalIntervalSteps": 20, "durationSeconds": 200}}}
    events = diloco_run(job, tmp_path)
    out = tmp_path / "out"
    exits = [e for e in events if e["event"] == "exit"]
    assert sorted(e["source"] for e in exits) == ["local-0", "local-1"]
    assert all(e["reason"] == "finished" for e in exits), exits
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.5, summary


def test_the_learner_exits_2_with_the_line_before_it_connects(tmp_path: Path) -> None:
    """`diloco learner` on a Parquet file without the text column: the one line on stderr and
    Exit.CONFIG, before it compiles or reaches for the syncer (none listens at the address)."""
    pq.write_table(pa.table({"body": ["a b c"] * 10, "id": list(range(10))}), tmp_path / "x.parquet")
    job = {"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "bad"},
           "spec": {"learnerGroups": [{"name": "local", "replicas": 1}], "model": dict(TINY_MODEL),
                    "data": {"source": {"kind": "parquet", "path": str(tmp_path / "x.parquet"),
                                        "heldOutPath": str(tmp_path / "x.parquet")}}}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    res = subprocess.run([sys.executable, "-P", "-m", "diloco.apps.cli", "learner", "--config", str(tmp_path / "job.yaml"),
                          "--group", "local", "--index", "0", "--syncer", "127.0.0.1:9"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "DILOCO_TOKEN": "0123456789abcdef0123"})
    assert res.returncode == Exit.CONFIG, res.stderr[-2000:]
    assert res.stderr.strip() == (f"spec.data.source.textField: {tmp_path / 'x.parquet'} has no column 'text' "
                                  "(its columns: body, id); set textField to the column that holds the text")


@pytest.mark.slow
def test_a_large_row_group_is_read_a_piece_at_a_time(tmp_path: Path) -> None:
    """The memory a row group's read takes (Python's and Arrow's) does not grow with the row group (the column
    chunk is read 8 MiB at a time and decoded 1,024 rows at a time): 20 and 80 MB row groups, each
    read in a process of its own so the peak is the read's."""
    script = ("import sys, tracemalloc, pyarrow as pa\nfrom diloco.trainer.data.records import Reader, list_units\n"
              "(unit,) = list_units('parquet', [sys.argv[1]], 'text', 'path')\ntracemalloc.start()\n"
              "n = sum(len(b) for b in Reader('parquet', 'text').documents(unit))\n"  # Python's bytes, Arrow's buffers
              "print(n, tracemalloc.get_traced_memory()[1] + pa.default_memory_pool().max_memory())\n")
    peaks = []
    for rows in (2000, 8000):
        path = tmp_path / f"big-{rows}.parquet"
        pq.write_table(pa.table({"text": [f"{i} " + "word " * 2000 for i in range(rows)]}), path,
                       row_group_size=rows, compression="none")
        res = subprocess.run([sys.executable, "-P", "-c", script, str(path)], capture_output=True, text=True,
                             timeout=120, check=True)
        n, peak = map(int, res.stdout.split())
        assert n == rows
        peaks.append(peak)
    assert peaks[1] < 1.2 * peaks[0], peaks  # read whole: 72 and 133 MB; so, 70 and 71 MB
