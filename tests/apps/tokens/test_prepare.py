"""`diloco prepare-tokens` at scale: shards of the configured size holding the ids `kind: text`,
`parquet` and `jsonl` train on, the same whatever the number of worker processes; an interrupted
run resumed without redoing finished shards; a changed input refused; progress; bad input."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import zstandard

from diloco.apps.tokens import output as tokens_output
from diloco.apps.tokens import plan as tokens_plan
from diloco.apps.tokens import prepare
from diloco.trainer import data
from diloco.trainer.data import records, sources, streams
from tests.trainer.data.test_data import LINES, make_tokenizer, spec_data
from tests.trainer.data.test_streams import corpus, documents, jsonl, write, write_parquet

PROGRESS = re.compile(r"prepare-tokens: [\d.]+/[\d.]+ MB input, [\d.]+ MB/s of text, [\d.]+ M tokens/s, .* ETA "
                      r"(\d+ s|unknown)$")


def arguments(glob: str, out: Path, **kw: Any) -> argparse.Namespace:
    defaults = {"tokenizer": "bytes", "held_out_fraction": 0.1, "kind": "auto", "text_field": "text",
                "shard_size": 1000, "workers": 1, "restart": False}
    return argparse.Namespace(glob=glob, out=str(out), **{**defaults, **kw})


def shards(out: Path, split: str) -> list[np.ndarray]:
    return [np.fromfile(p, np.uint16) for p in sorted(out.glob(f"{split}-*.bin"))]


def joined(out: Path, split: str) -> np.ndarray:
    return np.concatenate(shards(out, split))


def same_output(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.glob("*.bin"))
    assert names == sorted(p.name for p in b.glob("*.bin")) and names
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_text_shards_hold_kind_texts_ids_whatever_the_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small files whole and a large one cut at line starts (pieces of 2,000 bytes, chunks of 300):
    the ids an unsharded kind: text read gives, in shards of exactly --shard-size but the last."""
    monkeypatch.setattr(tokens_plan, "TEXT_PIECE_BYTES", 2000)
    monkeypatch.setattr(tokens_plan, "TEXT_CHUNK_BYTES", 300)
    monkeypatch.setattr(tokens_plan, "TEXT_WHOLE_BYTES", 500)
    make_tokenizer(tmp_path / "tok.json")
    (tmp_path / "t").mkdir()
    rng = random.Random(0)
    for i in range(5):
        (tmp_path / "t" / f"{i}.txt").write_text("\n".join(rng.choice(LINES) for _ in range(8 + 60 * (i == 3))) + "\n")
    glob = str(tmp_path / "t" / "*.txt")
    outs = []
    for workers in (1, 2):
        outs.append(tmp_path / f"w{workers}")
        rc = prepare.main(arguments(glob, outs[-1], tokenizer=str(tmp_path / "tok.json"), shard_size=300,
                                    workers=workers, held_out_fraction=0.2))
        assert rc == 0
    same_output(*outs)
    train = shards(outs[0], "train")
    assert len(train) > 3 and {len(s) for s in train[:-1]} == {300} and 0 < len(train[-1]) <= 300
    text = data.load(spec_data(kind="text", path=glob, tokenizer=str(tmp_path / "tok.json"), held_out_fraction=0.2),
                     300, 9)
    assert np.array_equal(joined(outs[0], "train"), text.train.array())
    assert np.array_equal(joined(outs[0], "val"), text.held_out.array())
    manifest = json.loads((outs[0] / "manifest.json").read_text())
    assert [s["tokens"] for s in manifest["splits"]["train"]["shards"]] == [len(s) for s in train]
    assert manifest["identity"]["inputs"][3]["size"] == (tmp_path / "t" / "3.txt").stat().st_size
    assert not (outs[0] / tokens_output.STATE).exists()


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
@pytest.mark.slow
def test_record_shards_hold_what_the_stream_trains_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      kind: str) -> None:
    """Parquet row groups, JSON Lines ranges and .gz/.zst files: the training units' ids in order
    (each document followed by the separator, as streams.encode gives), the trailing units as val;
    one process and three give the same bytes."""
    monkeypatch.setattr(records, "UNIT_BYTES", 300)
    tok = make_tokenizer(tmp_path / "tok.json")
    corpus(str(tmp_path / "c"), kind, random.Random(3))
    glob = str(tmp_path / "c" / ("*.parquet" if kind == "parquet" else "*.jsonl*"))
    outs = []
    for workers in (1, 3):
        outs.append(tmp_path / f"w{workers}")
        assert prepare.main(arguments(glob, outs[-1], tokenizer=str(tmp_path / "tok.json"), shard_size=500,
                                      workers=workers)) == 0
    same_output(*outs)
    units = records.list_units(kind, sources.expand(glob, "x"), "text", "x")
    train, held = records.split_units(units, 0.1)
    reader = records.Reader(kind, "text")

    def ids(us: list[records.Unit]) -> np.ndarray:
        stream = streams.Stream(us, kind, "text", tok, 300)
        return np.concatenate([a for i in range(len(us)) for a in stream.tokens(i, reader)])

    assert np.array_equal(joined(outs[0], "train"), ids(train))
    assert np.array_equal(joined(outs[0], "val"), ids(held))


@pytest.mark.slow
def test_progress_on_stderr_and_no_jax(tmp_path: Path) -> None:
    """Two spawned workers; progress lines with a rate and an ETA; JAX never imported."""
    (tmp_path / "t").mkdir()
    for i in range(6):
        (tmp_path / "t" / f"{i}.txt").write_text("\n".join(LINES) * 20)
    script = ("import sys; from diloco.apps.tokens import prepare; prepare.REPORT_SECONDS = 0.0; from diloco.apps.cli import main; "
              f"rc = main(['prepare-tokens', {str(tmp_path / 't' / '*.txt')!r}, '--out', {str(tmp_path / 'o')!r}, "
              "'--workers', '2', '--shard-size', '2000']); assert 'jax' not in sys.modules, 'JAX imported'; sys.exit(rc)")
    done = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("prepare-tokens:")]
    assert lines and all(PROGRESS.match(ln) for ln in lines), done.stderr
    assert "path: '" in done.stdout and "train-*.bin" in done.stdout


def interrupted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, after: int) -> tuple[str, Path]:
    """A bytes run over 30 files stopped (KeyboardInterrupt) just after its `after`-th shard is recorded."""
    (tmp_path / "t").mkdir(exist_ok=True)
    for i in range(30):
        (tmp_path / "t" / f"{i:02d}.txt").write_text(" ".join(documents(str(i), 3, random.Random(i))))
    glob, out = str(tmp_path / "t" / "*.txt"), tmp_path / "o"
    close = tokens_output.Shards._close

    def stop(self: tokens_output.Shards) -> None:
        close(self)
        if self.split == "train" and self.index == after:
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(tokens_output.Shards, "_close", stop)
        with pytest.raises(KeyboardInterrupt):
            prepare.main(arguments(glob, out, shard_size=500))
    return glob, out


def test_an_interrupted_run_resumes_at_its_first_unfinished_shard(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    glob, out = interrupted(tmp_path, monkeypatch, 3)
    state = json.loads((out / tokens_output.STATE).read_text())
    assert [s["name"] for s in state["splits"]["train"]["shards"]] == [f"train-0000{k}.bin" for k in range(3)]
    stamps = {k: (out / f"train-0000{k}.bin").stat().st_mtime_ns for k in range(3)}
    read: list[tokens_plan.Piece] = []
    tokenize = tokens_plan.tokenize_piece

    def counted(piece: tokens_plan.Piece, *a: Any, **kw: Any) -> tuple[int, int, int]:
        read.append(piece)
        return tokenize(piece, *a, **kw)

    monkeypatch.setattr(tokens_plan, "tokenize_piece", counted)
    assert prepare.main(arguments(glob, out, shard_size=500)) == 0
    assert {k: (out / f"train-0000{k}.bin").stat().st_mtime_ns for k in range(3)} == stamps
    # Bytes: a file's ids are its bytes, after a separator from the second file on.
    sizes = [p.stat().st_size + (i > 0) for i, p in enumerate(sorted((tmp_path / "t").glob("*.txt")))]
    first = int(np.searchsorted(np.cumsum(sizes), 3 * 500, side="right"))
    train = [p.part for p in read if p.split == "train"]
    assert train[0] == first > 0 and train == list(range(first, train[-1] + 1))
    fresh = tmp_path / "fresh"
    assert prepare.main(arguments(glob, fresh, shard_size=500)) == 0
    same_output(out, fresh)
    assert json.loads((out / "manifest.json").read_text())["splits"] == json.loads((fresh / "manifest.json").read_text())["splits"]


def test_a_changed_input_or_tokenizer_refuses_to_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    glob, out = interrupted(tmp_path, monkeypatch, 2)
    before = (out / tokens_output.STATE).read_bytes()
    changed = tmp_path / "t" / "05.txt"
    size, stamp = changed.stat().st_size, changed.stat().st_mtime_ns
    changed.write_text(changed.read_text() + " more")
    capsys.readouterr()
    assert prepare.main(arguments(glob, out, shard_size=500)) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"05.txt was {size} bytes, now {size + 5}" in err and "--restart" in err, err
    assert (out / tokens_output.STATE).read_bytes() == before and (out / "train-00001.bin").exists()
    make_tokenizer(tmp_path / "tok.json")
    changed.write_text(changed.read_text()[:-5])
    os.utime(changed, ns=(stamp, stamp))  # the input as it was: only the tokenizer differs
    assert prepare.main(arguments(glob, out, shard_size=500, tokenizer=str(tmp_path / "tok.json"))) == 2
    assert "tokenizer was 'bytes'" in capsys.readouterr().err
    assert prepare.main(arguments(glob, out, shard_size=500, tokenizer=str(tmp_path / "tok.json"), restart=True)) == 0
    fresh = tmp_path / "fresh"
    assert prepare.main(arguments(glob, fresh, shard_size=500, tokenizer=str(tmp_path / "tok.json"))) == 0
    same_output(out, fresh)


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def fails(glob: str, *parts: str, **kw: Any) -> None:
        capsys.readouterr()
        out = tmp_path / f"o{random.random()}"
        assert prepare.main(arguments(str(tmp_path / glob), out, **kw)) == 2
        lines = [ln for ln in capsys.readouterr().err.splitlines() if not PROGRESS.match(ln)]  # progress, then the line
        assert len(lines) == 1 and all(p in lines[0] for p in parts), lines
        assert not (out / "manifest.json").exists() and not (out / tokens_output.SPOOL).exists()

    write_parquet(str(tmp_path / "p.parquet"), [documents("a", 5, random.Random(0))] * 2)
    fails("p.parquet", "--text-field", "'content'", "p.parquet", "id, text, blob", text_field="content")
    write(str(tmp_path / "bad.parquet"), b"PAR1" + bytes(100) + b"PAR1")
    fails("bad.parquet", "GLOB", "bad.parquet", "not a Parquet file")
    good = jsonl(documents("z", 400, random.Random(1)))
    write(str(tmp_path / "z" / "a.jsonl.zst"), zstandard.ZstdCompressor().compress(good))
    write(str(tmp_path / "z" / "b.jsonl.zst"), zstandard.ZstdCompressor().compress(good)[:-40])
    write(str(tmp_path / "z" / "c.jsonl.zst"), zstandard.ZstdCompressor().compress(good))
    fails("z/*.jsonl.zst", "b.jsonl.zst", "truncated or corrupt", workers=2)  # found in a worker process
    fails("none/*.txt", "GLOB: no files match")
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text("x")
    (tmp_path / "mixed" / "b.jsonl").write_bytes(jsonl(["y"]))
    fails("mixed/*", "several kinds", "--kind")
    capsys.readouterr()
    assert prepare.main(arguments(str(tmp_path / "none"), tmp_path / "o", held_out_fraction=0.7)) == 2
    assert "--held-out-fraction 0.7" in capsys.readouterr().err


def test_non_utf8_records_are_skipped_and_counted(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records, "UNIT_BYTES", 300)
    docs = documents("u", 40, random.Random(2))
    write(str(tmp_path / "u.jsonl"), jsonl(docs[:20]) + b'{"text": "caf\xe9"}\n' + jsonl(docs[20:]))
    assert prepare.main(arguments(str(tmp_path / "u.jsonl"), tmp_path / "o", held_out_fraction=0.3)) == 0
    assert "skipped 1 records that are not UTF-8" in capsys.readouterr().out
    assert json.loads((tmp_path / "o" / "manifest.json").read_text())["skipped_records"] == 1


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_same_shards(tmp_path: Path) -> None:
    """SIGKILL mid-run (two spawned workers, 1,500 small files): the rerun keeps the recorded shards
    and ends with the bytes a run never interrupted writes."""
    (tmp_path / "t").mkdir()
    for i in range(1500):
        (tmp_path / "t" / f"{i:04d}.txt").write_text(f"file {i} " + "words and more words " * (i % 17))
    glob, out, fresh = str(tmp_path / "t" / "*.txt"), tmp_path / "o", tmp_path / "fresh"
    cmd = [sys.executable, "-P", "-m", "diloco.apps.cli", "prepare-tokens", glob, "--shard-size", "2000", "--workers", "2"]
    proc = subprocess.Popen([*cmd, "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, recorded = time.monotonic() + 100, []
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            recorded = json.loads((out / tokens_output.STATE).read_text())["splits"]["train"]["shards"]
        except (OSError, ValueError):
            pass
        if len(recorded) >= 3:
            workers = psutil.Process(proc.pid).children(recursive=True)
            proc.kill()
            break
        time.sleep(0.02)
    proc.wait()
    assert len(recorded) >= 3 and not (out / "manifest.json").exists(), "the run ended before it was killed"
    assert len(workers) >= 2  # the two spawned workers (and multiprocessing's resource tracker)
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, f"workers outlived their killed parent: {alive}"
    stamps = {s["name"]: (out / s["name"]).stat().st_mtime_ns for s in recorded}
    assert subprocess.run([*cmd, "--out", str(out)], capture_output=True, timeout=120).returncode == 0
    assert subprocess.run([*cmd, "--out", str(fresh)], capture_output=True, timeout=120).returncode == 0
    same_output(out, fresh)
    assert {name: (out / name).stat().st_mtime_ns for name in stamps} == stamps
