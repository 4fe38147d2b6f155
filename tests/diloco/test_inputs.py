"""The front door reads the data as the learner will (diloco/inputs.py, trainer/data/probe.py):
`diloco validate --inputs` and `diloco run` refuse each kind of bad input with one line naming the
field, the file and the fix, and exit 2, before any process starts; bad input only the learner
meets (a corrupt row group mid-file) ends `diloco run` with the learner's line, never a traceback.
A base install (no pyarrow, zstandard or tokenizers) names the extra it needs."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
import zstandard

from diloco.apps import cli
from diloco.trainer.data import corpus_plays
from tests.helpers import learner_extra_blocked

MODEL = {"layers": 1, "dModel": 32, "heads": 2, "context": 32}
TEXT = corpus_plays()[0].decode()
DOCS = [TEXT[i : i + 2000] for i in range(0, len(TEXT), 2000)]  # ~50 records of a play


def manifest(folder: Path, **source: Any) -> Path:
    doc = {"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "inputs"},
           "spec": {"learnerGroups": [{"name": "a", "replicas": 1}], "model": MODEL, "training": {"evalBatches": 1},
                    "data": {"source": source}}}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def parquet(path: Path, column: str = "text", docs: list[str] = DOCS) -> Path:
    pq.write_table(pa.table({column: docs}), path, row_group_size=8, compression="zstd")
    return path


def jsonl(path: Path, field: str = "text") -> Path:
    path.write_text("\n".join(json.dumps({field: d, "id": i}) for i, d in enumerate(DOCS)) + "\n")
    return path


def zst(path: Path, cut: bool = False) -> Path:
    blob = zstandard.ZstdCompressor().compress("\n".join(json.dumps({"text": d}) for d in DOCS).encode())
    path.write_bytes(blob[: len(blob) * 2 // 3] if cut else blob)
    return path


# Each bad input: (files it writes, the manifest's source), and what its line must say.
def no_column(d: Path) -> dict[str, Any]:
    return {"kind": "parquet", "path": str(parquet(d / "a.parquet", column="body"))}


def not_parquet(d: Path) -> dict[str, Any]:
    (d / "a.parquet").write_bytes(b"PAR1 but not really " * 200)
    return {"kind": "parquet", "path": str(d / "a.parquet")}


def truncated_zst(d: Path) -> dict[str, Any]:
    return {"kind": "jsonl", "path": str(zst(d / "a.jsonl.zst", cut=True))}


def no_field(d: Path) -> dict[str, Any]:
    return {"kind": "jsonl", "path": str(jsonl(d / "a.jsonl", field="body"))}


def not_utf8(d: Path) -> dict[str, Any]:
    (d / "a.txt").write_bytes("Ma chère, à la fenêtre\n".encode("latin-1") + TEXT.encode())
    return {"kind": "text", "path": str(d / "a.txt")}


def wrong_vocabulary(d: Path) -> dict[str, Any]:
    np.arange(0, 60_000, 7, dtype=np.uint16).tofile(d / "train.bin")  # a 50k-id tokenizer's shard, vocabSize 256
    return {"kind": "tokens", "path": str(d / "train.bin")}


CASES: dict[str, tuple[Callable[[Path], dict[str, Any]], str]] = {
    "missing-text-column": (no_column, r"^spec\.data\.source\.textField: .*a\.parquet has no column 'text' \(its columns: body\); set textField"),
    "not-parquet": (not_parquet, r"^spec\.data\.source\.path: .*a\.parquet is not a Parquet file pyarrow can read .*remove it"),
    "truncated-zst": (truncated_zst, r"^spec\.data\.source\.path: .*a\.jsonl\.zst is truncated or corrupt \(the last zstd frame has no end"),
    "record-without-field": (no_field, r"^spec\.data\.source\.textField: the record at byte 0 of .*a\.jsonl has no field 'text' \(its fields: body, id\)"),
    "not-utf8": (not_utf8, r"^spec\.data\.source\.path: .*a\.txt is not UTF-8 text \(byte 5 is 0xe8\); byte-level ids .*keep 255"),
    "wrong-vocabulary": (wrong_vocabulary, r"^spec\.model\.vocabSize: .*train\.bin holds id 59997 in its first 8,572 ids, but the model's vocabulary is 256"),
}


def one_line(stderr: str, pattern: str, *, last: bool = False) -> None:
    """stderr is one line (`last`: ends with one, after the run's live view and summary), no traceback."""
    import re

    lines = stderr.strip().splitlines()
    assert (last or len(lines) == 1) and "Traceback" not in stderr, stderr
    assert re.search(pattern, lines[-1]), lines[-1]


@pytest.mark.parametrize("case", CASES)
def test_validate_inputs_refuses_bad_data_in_one_line(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write, pattern = CASES[case]
    job = manifest(tmp_path, **write(tmp_path))
    assert cli.main(["validate", str(job)]) == 0  # plain validate reads nothing: the manifest itself is valid
    capsys.readouterr()
    assert cli.main(["validate", "--inputs", str(job)]) == 2
    one_line(capsys.readouterr().err, pattern)


def good_sources(d: Path) -> dict[str, dict[str, Any]]:
    parquet(d / "b.parquet")
    (d / "j").mkdir()
    jsonl(d / "j" / "b.jsonl")
    zst(d / "j" / "c.jsonl.zst")
    (d / "b.txt").write_text("Ma chère, à la fenêtre\n" + TEXT)  # the same text as UTF-8
    (d / "t").mkdir()
    np.frombuffer(TEXT.encode(), np.uint8).astype(np.uint16).tofile(d / "t" / "train-00000.bin")
    (d / "t" / "manifest.json").write_text(json.dumps({"vocab": 256, "dtype": "uint16", "tokenizer": "bytes"}))
    return {"parquet": {"kind": "parquet", "path": str(d / "b.parquet")},
            "jsonl": {"kind": "jsonl", "path": str(d / "j" / "*")},
            "text": {"kind": "text", "path": str(d / "b.txt")},
            "tokens": {"kind": "tokens", "path": str(d / "t" / "train-*.bin")}}


def test_good_data_of_every_kind_is_valid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for kind, source in good_sources(tmp_path).items():
        assert cli.main(["validate", "--inputs", str(manifest(tmp_path, **source))]) == 0, (kind, capsys.readouterr().err)


def test_a_prepared_folder_is_checked_by_its_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """prepare-tokens' manifest.json says what its shards hold: a 50k vocabulary or uint32 ids
    are refused by name, once for the folder, before any shard is read."""
    source = good_sources(tmp_path)["tokens"]
    (tmp_path / "t" / "val-00000.bin").write_bytes((tmp_path / "t" / "train-00000.bin").read_bytes())
    source["heldOutPath"] = str(tmp_path / "t" / "val-*.bin")
    for written, pattern in (({"vocab": 50257, "dtype": "uint16", "tokenizer": "gpt2.json"},
                              r"^spec\.model\.vocabSize: .*t/manifest\.json says its shards were tokenized with a "
                              r"vocabulary of 50,257 ids \(gpt2\.json\), but the model's is 256"),
                             ({"vocab": 256, "dtype": "uint32"},
                              r"^spec\.data\.source\.tokenDtype: .*t/manifest\.json says its shards hold uint32 ids, "
                              r"not uint16; set tokenDtype: uint32")):
        (tmp_path / "t" / "manifest.json").write_text(json.dumps(written))
        assert cli.main(["validate", "--inputs", str(manifest(tmp_path, **source))]) == 2
        one_line(capsys.readouterr().err, pattern)


def test_too_few_units_for_a_held_out_split_is_refused_after_the_files(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """One .zst file is one unit: no held-out split can be cut from it (the learner's refusal)."""
    job = manifest(tmp_path, kind="jsonl", path=str(zst(tmp_path / "a.jsonl.zst")))
    assert cli.main(["validate", "--inputs", str(job)]) == 2
    one_line(capsys.readouterr().err, r"^spec\.data\.source\.heldOutPath: the data is one unit")


def base_install(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """The command line as the syncer image runs it: the learner extra's modules unimportable."""
    program = learner_extra_blocked() + "from diloco.apps.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    return subprocess.run([sys.executable, "-P", "-c", program, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.slow
def test_a_base_install_names_the_extra_it_needs_to_read_data(tmp_path: Path) -> None:
    job = manifest(tmp_path, kind="parquet", path=str(parquet(tmp_path / "a.parquet")))
    done = base_install(["validate", "--inputs", str(job)], tmp_path)
    assert done.returncode == 2, done.stderr
    one_line(done.stderr, r"^spec\.data\.source: reading the data as the learner will needs tokenizers, which this "
                          r"install lacks; install the learner extra: pip install 'decoupled-diloco\[learner\]'")
    assert base_install(["validate", str(job)], tmp_path).returncode == 0  # the manifest alone needs no reader
    builtin = manifest(tmp_path)  # the builtin corpus as bytes: nothing to read
    assert base_install(["validate", "--inputs", str(builtin)], tmp_path).returncode == 0


def diloco(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-m", "diloco.apps.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_run_refuses_bad_data_before_any_process(case: str, tmp_path: Path) -> None:
    write, pattern = CASES[case]
    job = manifest(tmp_path, **write(tmp_path))
    validate = diloco(["validate", "--inputs", str(job)], tmp_path)
    assert validate.returncode == 2
    one_line(validate.stderr, pattern)
    run = diloco(["run", str(job), "--max-seconds", "20", "--no-live"], tmp_path)
    assert run.returncode == 2
    one_line(run.stderr, pattern)
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written


def corrupt_row_group(path: Path, group: int) -> None:
    """Scrambles one row group's pages in place: its footer still reads, its data does not."""
    chunk = pq.ParquetFile(path).metadata.row_group(group).column(0)
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    raw = bytearray(path.read_bytes())
    for i in range(start + 8, start + chunk.total_compressed_size - 8):
        raw[i] = (raw[i] * 7 + 13) % 256
    path.write_bytes(bytes(raw))


@pytest.mark.slow
def test_a_corrupt_row_group_mid_file_ends_the_run_with_the_learners_line(tmp_path: Path) -> None:
    """The front door reads the first row group; the learner meets the corrupt fourth, exits 2 with
    its line, and `diloco run` ends its output with that line (after its live view and summary, on
stderr too) and exits 2: no traceback."""
    path = parquet(tmp_path / "a.parquet")
    corrupt_row_group(path, 3)
    job = manifest(tmp_path, kind="parquet", path=str(path))
    assert diloco(["validate", "--inputs", str(job)], tmp_path).returncode == 0
    run = diloco(["run", str(job), "--max-seconds", "60", "--no-live"], tmp_path)
    assert run.returncode == 2
    one_line(run.stderr, r"^diloco run: a-0 exited with code 2: spec\.data\.source\.path: .*a\.parquet row group 3 "
                         r"cannot be read \(.*\); the file is corrupt: remove or rewrite it \(log: .*a-0\.log\)$", last=True)
    summary = json.loads((tmp_path / "runs" / "inputs" / "summary.json").read_text())
    assert "row group 3 cannot be read" in summary["failure"]
