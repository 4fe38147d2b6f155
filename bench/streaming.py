"""The Parquet stream's tokens per second on one core, against what the 91M model's step consumes.

    python bench/streaming.py [--mb 64] [--seconds 30] [--preset llama-125m] [--context 256] [--batch 2]

A learner reading `kind: parquet` tokenizes its row groups on a background thread ahead of the
step (trainer/data/streams.py); the step must never wait for it. In one run, on core 0 each:
1. the stream: `--mb` of Parquet (the 38 plays cut into ~3 KB documents, repeated, in
   files of row groups of ~8 MB) read through `data.load` as a learner reads its shard, with a
   byte-level BPE of `--vocab` ids trained on the plays (bench/real_size.py's), its batches of
   the 91M job's shape pulled as fast as they come for `--seconds`: tokens delivered per second;
2. the model: trainer/recipe.py's step of the real-size job (bench/real_size.py: `--preset`
   with that vocabulary, `--context`, `--batch`, fp32) in a fresh process, 3 steps after the
   compile: the tokens a step consumes per second.
Last line: JSON with both rates and `ratio` (stream / step; target >= 10).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import real_size

STREAM = r"""
import json, os, sys, time
os.sched_setaffinity(0, {0})
from diloco.spec import parse_job
from diloco.trainer import data
job = parse_job(json.loads(sys.argv[1])); cfg, tr = job.spec.model, job.spec.training
seconds = float(sys.argv[2])
t0 = time.monotonic()
corpus = data.load(job.spec.data, cfg.vocab_size, cfg.context + 1, shard=(0, 1))
batches = data.Batches(corpus.train, tr.batch_size, cfg.context + 1, seed=0, shard_index=0)
batches.batch(0)
start_s = time.monotonic() - t0
t0, k = time.monotonic(), 1
while time.monotonic() - t0 < seconds:
    batches.batch(k); k += 1
took = time.monotonic() - t0
print(json.dumps({"start_seconds": start_s, "batches": k - 1, "tokens_per_second": (k - 1) * tr.batch_size * cfg.context / took}))
"""


def write_parquet(folder: Path, mb: int) -> int:
    """Parquet files of documents (scenes of the plays, repeated) totalling about `mb` of text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from diloco.trainer.data import corpus_plays

    docs, doc = [], ""
    for play in corpus_plays():  # paragraphs grouped into ~3 KB documents, about a web page's length
        for para in play.decode().split("\n\n"):
            doc += para + "\n\n"
            if len(doc) >= 3000:
                docs.append(doc)
                doc = ""
    folder.mkdir(parents=True, exist_ok=True)
    written, part, file_bytes = 0, 0, 32 << 20
    while written < mb << 20:
        batch, size = [], 0
        while size < file_bytes and written + size < mb << 20:
            for d in docs:
                batch.append(f"[copy {part}/{len(batch)}] {d}")
                size += len(d)
        pq.write_table(pa.table({"text": batch}), folder / f"part-{part:03d}.parquet", row_group_size=max(1, len(batch) // 4))
        written += size
        part += 1
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--preset", default="llama-125m")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--out", type=Path, default=common.RUNS / "streaming")
    a = parser.parse_args()
    tokens = real_size.prepare_data(a.out / "data", a.vocab)  # the BPE (and the token shards the step reads)
    tokenizer = str(tokens.parent / "tokenizer.json")
    with tempfile.TemporaryDirectory() as tmp:
        text_bytes = write_parquet(Path(tmp), a.mb)
        m: dict[str, Any] = {
            "apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "streaming"},
            "spec": {"learnerGroups": [{"name": "local", "replicas": 1}],
                     "model": {"preset": a.preset, "vocabSize": a.vocab, "context": a.context},
                     "data": {"source": {"kind": "parquet", "path": f"{tmp}/*.parquet", "tokenizer": tokenizer}},
                     "training": {"batchSize": a.batch}}}
        done = subprocess.run([sys.executable, "-P", "-c", STREAM, json.dumps(m), str(a.seconds)], capture_output=True,
                              text=True, timeout=1800)
        if done.returncode:
            raise SystemExit(f"the stream failed:\n{done.stderr[-3000:]}")
        stream = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"stream: {stream['tokens_per_second']:,.0f} tokens/s on one core ({text_bytes / 1e6:.0f} MB of Parquet text; "
          f"first batch after {stream['start_seconds']:.1f} s)", flush=True)
    ns = argparse.Namespace(preset=a.preset, vocab=a.vocab, context=a.context, batch=a.batch, fragments=24, minutes=1,
                            eval_every=100)
    step = real_size.plain_loop(real_size.manifest(ns, tokens, "float32"), steps=3)
    consumed = a.batch * a.context / step["step_seconds"]
    print(f"step: {step['parameters']:,} parameters, {step['step_seconds']:.2f} s a step: {consumed:,.0f} tokens/s",
          flush=True)
    result = {"bench": "streaming", "stream_tokens_per_second": round(stream["tokens_per_second"]),
              "stream_start_seconds": round(stream["start_seconds"], 2), "parquet_text_mb": round(text_bytes / 1e6),
              "step_tokens_per_second": round(consumed, 1), "step_seconds": round(step["step_seconds"], 3),
              "parameters": step["parameters"], "ratio": round(stream["tokens_per_second"] / consumed, 1),
              "target": 10.0, **common.machine()}
    common.emit(result)


if __name__ == "__main__":
    main()
