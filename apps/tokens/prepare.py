"""`diloco prepare-tokens GLOB --out DIR`: text, Parquet or JSON Lines tokenized once into shards
of ids (`train-00000.bin`, ..., `val-00000.bin`: flat arrays, nanoGPT's layout) for
`spec.data.source.kind: tokens`, with a manifest.json written last.

Tokenizing is the slow part of reading text; done once here, every learner memory-maps the result
instead of tokenizing at start-up. The ids are the ones `kind: text`, `parquet` or `jsonl` trains
on (apps/tokens/plan.py), whatever the parallelism: pieces are tokenized by spawned worker
processes (a pool of --workers, each with its share of the tokenizer's threads), each into a spool
file, and copied into the shards in piece order by this process. Memory holds a few batches of
text per worker; the spool holds at most 2 pieces per worker. Each shard is recorded as it
completes (apps/tokens/output.py), so an interrupted run resumes at its first unfinished shard.
No JAX is imported.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import multiprocessing
import os
import sys
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Final

import numpy as np

from diloco.apps.tokens import plan
from diloco.apps.tokens.output import (
    MANIFEST,
    SPOOL,
    STATE,
    Shards,
    State,
    clear_spool,
    difference,
    read_json,
    remove_outputs,
    write_json,
)
from diloco.contract import Exit
from diloco.trainer.data import sources

REPORT_SECONDS: Final = 2.0  # a progress line at most this often: alive, without flooding a log
COPY_IDS: Final = 4 << 20  # ids copied from a spool file to the shards at a time
AHEAD: Final = 2  # pieces in flight per worker: one tokenizing, one waiting to be copied
VERSION: Final = 1
FLAGS: Final = (("spec.data.source.textField", "--text-field"), ("set textField to", "set --text-field to"),
                ("spec.data.source.path", "GLOB"))


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, as a container's cpuset limits it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Refused(ValueError):
    """OUT holds another run's shards: resuming would mix two corpora."""


class Progress:
    """Input done, text MB/s, tokens/s and an ETA on stderr, at most every `every` seconds. The
    counters are the workers' (text bytes, ids) so far; input done is the finished pieces' bytes
    plus the pieces in flight estimated from their text at the ratio seen so far."""

    def __init__(self, total: int, counters: Any, every: float = REPORT_SECONDS) -> None:
        self.total, self.counters, self.every = total, counters, every
        self.weight = self.text_done = 0  # finished pieces: their input bytes and text bytes
        self.started = self.last = time.monotonic()

    def finished(self, weight: int, text: int) -> None:
        self.weight += weight
        self.text_done += text

    def line(self, now: float) -> str:
        text, ids = int(self.counters[0]), int(self.counters[1])
        ratio = self.weight / self.text_done if self.text_done else 0.0
        done = min(self.total, self.weight + int((text - self.text_done) * ratio)) if self.total else 0
        took = max(now - self.started, 1e-9)
        eta = f"{(self.total - done) * took / done:.0f} s" if done else "unknown"
        return (f"prepare-tokens: {done / 1e6:.1f}/{self.total / 1e6:.1f} MB input, {text / 1e6 / took:.1f} MB/s of "
                f"text, {ids / took / 1e6:.2f} M tokens/s, {ids / 1e6:.1f} M tokens, {took:.0f} s, ETA {eta}")

    def poll(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last >= self.every:
            self.last = now
            print(self.line(now), file=sys.stderr, flush=True)


class Pool:
    """Pieces tokenized by spawned workers (never forked: a parent that imported native threads),
    or in this process when workers is 1: the reference path, the same ids."""

    def __init__(self, job: plan.Job, workers: int, counters: Any, progress: Progress) -> None:
        self.workers, self.counters, self.progress = workers, counters, progress
        self.local: plan.Tokenizing | None = None
        self.pool: cf.ProcessPoolExecutor | None = None
        if workers == 1:
            self.local = plan.Tokenizing(job)
        else:
            cores = usable_cores()
            self.pool = cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                               initializer=plan.init_worker,
                                               initargs=(job, counters, max(1, cores // workers)))

    def submit(self, piece: plan.Piece, spool: str) -> Any:
        if self.pool is not None:
            return self.pool.submit(plan.tokenize_piece, piece, spool)
        return (piece, spool)  # run when its result is wanted: in order, nothing ahead

    def result(self, task: Any) -> tuple[int, int, int]:
        if self.pool is None:
            def tick(text: int, ids: int) -> None:
                self.counters[0] += text
                self.counters[1] += ids
                self.progress.poll()
            piece, spool = task
            return plan.tokenize_piece(piece, spool, worker=self.local, tick=tick)
        while True:
            try:
                got: tuple[int, int, int] = task.result(timeout=0.25)
                return got
            except cf.TimeoutError:
                self.progress.poll()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        if self.local is not None and self.local.reader is not None:
            self.local.reader.close()


def prepare(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Writes (or finishes) the shards and the manifest in `out`; returns the manifest."""
    urls = sources.expand(args.glob, "GLOB")
    kind = plan.infer_kind(urls, args.kind)
    tok = sources.read_tokenizer(args.tokenizer, "--tokenizer")
    tok_text = "bytes" if tok is None else tok.to_str()
    vocab = 256 if tok is None else tok.get_vocab_size(with_added_tokens=True)
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    with cf.ThreadPoolExecutor(16) as threads:  # one round trip each on object storage
        inputs = list(threads.map(plan.fingerprint, urls))
    identity = {"version": VERSION, "kind": kind, "text_field": args.text_field if kind != "text" else None,
                "inputs": inputs, "tokenizer": plan.tokenizer_id(tok_text), "vocab": vocab, "dtype": dtype,
                "shard_size": args.shard_size, "held_out_fraction": args.held_out_fraction}
    out.mkdir(parents=True, exist_ok=True)
    if args.restart:
        remove_outputs(out)
    stored, manifest = read_json(out / STATE), read_json(out / MANIFEST)
    prior = (stored or manifest or {}).get("identity")
    if prior is not None and (why := difference(prior, identity)):
        raise Refused(f"--out: {out} holds {'an interrupted' if stored else 'a finished'} run over other input: {why}; "
                      "rerun with --restart to start over (its shards are deleted), or give another --out")
    if prior is None and any(out.glob("train-*.bin")):
        raise Refused(f"--out: {out} holds train-*.bin shards but no {STATE} or {MANIFEST} to resume from; rerun "
                      "with --restart to replace them, or give another --out")
    if manifest is not None and stored is None:
        print(f"prepare-tokens: {out} is already prepared from these inputs ({out / MANIFEST})", file=sys.stderr)
        return manifest
    pieces = plan.plan(kind, urls, [i["size"] for i in inputs], args.text_field, args.held_out_fraction)
    state = State(out, identity, stored)
    job = plan.Job(kind, args.text_field, tok_text, dtype, plan.TEXT_CHUNK_BYTES, plan.TEXT_WHOLE_BYTES)
    run(pieces, state, job, out, args.workers, args.shard_size)
    manifest = {"identity": identity, "tokenizer": args.tokenizer, "vocab": vocab, "dtype": dtype,
                "shard_size": args.shard_size, "skipped_records": state.skipped,
                "splits": {name: {"tokens": sum(s["tokens"] for s in split["shards"]), "shards": split["shards"]}
                           for name, split in state.splits.items()}}
    write_json(out / MANIFEST, manifest)  # last: its presence says the run is whole
    (out / STATE).unlink()
    return manifest


def run(pieces: dict[str, list[plan.Piece]], state: State, job: plan.Job, out: Path, workers: int,
        shard_size: int) -> None:
    """Tokenizes the pieces not yet in finished shards, in order, into the shards."""
    tasks: list[tuple[plan.Piece, int, int]] = []  # (piece, its index in its split, ids to skip)
    writers: dict[str, Shards] = {}
    for split in ("train", "val"):
        first, j, skip = state.resume_point(split, shard_size, out)
        if state.splits[split]["complete"]:
            continue
        for stale in out.glob(f"{split}-*.bin*"):  # shards past the finished ones: rewritten
            if stale.name not in {s["name"] for s in state.splits[split]["shards"]}:
                stale.unlink()

        def finished(shard: dict[str, Any], split: str = split) -> None:
            state.splits[split]["shards"].append(shard)
            state.save()

        writers[split] = Shards(out, split, shard_size, job.dtype, first, finished)
        tasks += [(pieces[split][i], i, skip if i == j else 0) for i in range(j, len(pieces[split]))]
    state.save()
    clear_spool(out)
    (out / SPOOL).mkdir()
    counters = multiprocessing.get_context("spawn").Array("q", 2)
    progress = Progress(sum(p.weight for p, _, _ in tasks), counters, REPORT_SECONDS)
    workers = max(1, min(workers, len(tasks)))
    left = collections.Counter(p.split for p, _, _ in tasks)
    pool = Pool(job, workers, counters, progress)
    try:
        queue: collections.deque[tuple[tuple[plan.Piece, int, int], str, Any]] = collections.deque()
        ahead = iter(tasks)
        for task in ahead:
            _submit(pool, queue, task, out)
            if len(queue) >= AHEAD * workers:
                break
        while queue:
            (piece, i, skip), spool, handle = queue.popleft()
            n, skipped, text = pool.result(handle)
            counts = state.splits[piece.split]["counts"]
            counts[i:i + 1] = [n]
            state.skipped += skipped
            _copy(spool, job.dtype, skip, writers[piece.split])
            progress.finished(piece.weight, text)
            left[piece.split] -= 1
            if not left[piece.split]:
                writers[piece.split].finish()
                state.splits[piece.split]["complete"] = True
                state.save()
            if (following := next(ahead, None)) is not None:
                _submit(pool, queue, following, out)
            progress.poll()
    except BrokenProcessPool:
        raise RuntimeError("prepare-tokens: a worker process died (killed, or out of memory); rerun to resume, "
                           "with fewer --workers if memory is short") from None
    finally:
        pool.close()
        for w in writers.values():
            w.abandon()
        clear_spool(out)
    progress.poll(force=True)
    for split in ("train", "val"):
        state.splits[split]["complete"] = True
    state.save()


def _submit(pool: Pool, queue: collections.deque[Any], task: tuple[plan.Piece, int, int], out: Path) -> None:
    piece, i, _ = task
    spool = str(out / SPOOL / f"{piece.split}-{i:07d}.ids")
    queue.append((task, spool, pool.submit(piece, spool)))


def _copy(spool: str, dtype: str, skip: int, writer: Shards) -> None:
    """A piece's ids from its spool file into the shards, COPY_IDS at a time (bounded memory)."""
    itemsize = np.dtype(dtype).itemsize
    with open(spool, "rb") as f:
        f.seek(skip * itemsize)
        while chunk := f.read(COPY_IDS * itemsize):
            writer.write(np.frombuffer(chunk, dtype))
    os.unlink(spool)


def main(args: argparse.Namespace) -> int:
    if not 0 < args.held_out_fraction < 0.5:
        print(f"--held-out-fraction {args.held_out_fraction}: give a fraction in (0, 0.5), as "
              "spec.data.heldOutFraction", file=sys.stderr)
        return Exit.CONFIG
    args.workers = usable_cores() if args.workers is None else args.workers
    if args.shard_size < 1 or args.workers < 1:
        print(f"--shard-size {args.shard_size}, --workers {args.workers}: give positive numbers", file=sys.stderr)
        return Exit.CONFIG
    out = Path(args.out)
    try:
        manifest = prepare(args, out)
    except ValueError as exc:  # bad input (records.DataError among them), a refused resume
        line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        for spec, flag in FLAGS:  # trainer/data/records.py names the spec's fields; here they are flags
            line = line.replace(spec, flag)
        print(line, file=sys.stderr)
        return Exit.CONFIG
    except (RuntimeError, OSError) as exc:
        print(f"prepare-tokens: {exc}", file=sys.stderr)
        return Exit.FAILED
    splits, dtype = manifest["splits"], manifest["dtype"]
    tokenizer = "" if args.tokenizer == "bytes" else f", tokenizer: {args.tokenizer}"
    skipped = f"; skipped {manifest['skipped_records']} records that are not UTF-8" if manifest["skipped_records"] else ""
    print(f"wrote {len(splits['train']['shards'])} train shards ({splits['train']['tokens']} tokens) and "
          f"{len(splits['val']['shards'])} val shards ({splits['val']['tokens']} tokens), {dtype}, in {out}{skipped}\n"
          f"spec.data.source: {{kind: tokens, path: '{out / 'train-*.bin'}', heldOutPath: '{out / 'val-*.bin'}', "
          f"tokenDtype: {dtype}{tokenizer}}}, spec.model.vocabSize: at least {manifest['vocab']}")
    return Exit.OK
