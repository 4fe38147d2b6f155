"""What the front door and the learner agree on (trainer/data/probe.py, records.probe,
sources.refuse_not_utf8): byte-level text must be UTF-8 wherever a shard is cut, the learner
refuses what the front door's bounded read cannot see with the same line, and a small compressed
file is read to its end while a large one is read only at its head."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import zstandard

from diloco.trainer import data
from diloco.trainer.data import records, sources
from tests.trainer.data.test_data import WINDOW, make_tokenizer, spec_data


def test_utf8_is_checked_but_a_character_cut_at_either_end_is_not_a_fault() -> None:
    text = "Ma chère, à la fenêtre: ÿ\n".encode()
    assert sources.not_utf8(text) is None
    assert sources.not_utf8(text[6:-2]) is None  # a shard cut inside a character at both ends (è, ÿ)
    assert sources.not_utf8(text[:5] + b"\xff" + text[5:]) == 5  # 0xFF: never UTF-8, the byte-level end-of-text
    assert sources.not_utf8("chère".encode("latin-1")) == 2
    assert sources.not_utf8("é".encode()[1:] + b"x", cut_start=False) == 0  # a file's first byte is no cut


def test_the_learner_refuses_byte_level_text_past_what_the_front_door_reads(tmp_path: Path) -> None:
    """A Latin-1 byte 100 KB in (the front door reads 64 KB of each text file): the learner's own
    load refuses it with the byte's offset; with a tokenizer the same text is read (as U+FFFD)."""
    (tmp_path / "a.txt").write_bytes(b"x\n" * 50_000 + "chère\n".encode("latin-1") + b"y\n" * 10_000)
    with pytest.raises(ValueError, match=r"a\.txt is not UTF-8 text \(byte 100,002 is 0xe8\); byte-level ids are "
                                         r"UTF-8 bytes and keep 255"):
        data.load(spec_data(kind="text", path=str(tmp_path / "a.txt")), 256, WINDOW)
    make_tokenizer(tmp_path / "tok.json")
    corpus = data.load(spec_data(kind="text", path=str(tmp_path / "a.txt"), tokenizer=str(tmp_path / "tok.json")), 300, WINDOW)
    assert len(corpus.train) > WINDOW


def test_shards_cut_inside_a_character_are_read(tmp_path: Path) -> None:
    """Text shards are byte ranges: every learner's shard of UTF-8 text with multi-byte characters
    loads, whatever byte its range starts or stops at."""
    (tmp_path / "a.txt").write_text("éà€ü" * 5000)
    for index in range(7):
        assert len(data.load(spec_data(kind="text", path=str(tmp_path / "a.txt")), 256, WINDOW, shard=(index, 7)).train)


def records_zst(path: Path, n: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)  # incompressible text: the file is as large as its records
    lines = [json.dumps({"text": rng.bytes(3000).hex()}) for _ in range(n)]
    blob = zstandard.ZstdCompressor().compress("\n".join(lines).encode())
    path.write_bytes(blob)
    return blob


def test_a_compressed_file_is_read_to_its_end_only_when_small(tmp_path: Path) -> None:
    small = tmp_path / "small.jsonl.zst"
    blob = records_zst(small, 20)
    small.write_bytes(blob[:-100])
    with pytest.raises(records.DataError, match=r"small\.jsonl\.zst is truncated or corrupt"):
        records.probe("jsonl", str(small), "text", "spec.data.source.path")
    large = tmp_path / "large.jsonl.zst"
    blob = records_zst(large, 400)
    assert len(blob) > records.READ_BYTES
    large.write_bytes(blob[:-100])
    records.probe("jsonl", str(large), "text", "spec.data.source.path")  # its head is whole: the learner finds the cut
    reader = records.Reader("jsonl", "text")
    with pytest.raises(records.DataError, match=r"large\.jsonl\.zst is truncated or corrupt"):
        for _ in reader.documents(records.list_units("jsonl", [str(large)], "text", "spec.data.source.path")[0]):
            pass


def test_records_that_are_not_utf8_are_skipped_by_the_probe_as_by_the_learner(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"text": "ch\xe8re"}\n' + json.dumps({"text": "fine"}).encode() + b"\n{\"body\": 1}\n")
    records.probe("jsonl", str(path), "text", "spec.data.source.path")  # the first record that reads is whole
    path.write_bytes(b'{"text": "ch\xe8re"}\n{"body": 1}\n')
    with pytest.raises(records.DataError, match=r"record at byte 18 of .*a\.jsonl has no field 'text'"):
        records.probe("jsonl", str(path), "text", "spec.data.source.path")
