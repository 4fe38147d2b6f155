"""What the syncer -> learner codec costs in held-out loss: fp32, int8 and int4 broadcasts, paired by seed.

    python bench/broadcast_quality.py [--codecs fp32,int8,int4] [--seeds 0,1,2] [--steps 1200] [--lr 6e-3]
    python bench/broadcast_quality.py --codecs int8,int4@p68 --layers 8 --d-model 64   # the 242x setting

A codec may carry its own fragment count, `int4@p68`: that arm also sets spec.syncer.fragments
(the others keep the bench's P = 4), so the 242x setting (BENCHMARKS §16: P = 68, int4 both
ways) is paired with the default; P = 68 needs a model of at least 68 tensors (8 layers).

The broadcast (spec.syncer.broadcastCompression; syncer/publisher.py) carries each published
fragment as a delta from what every learner holds, with error feedback: the learners' copies
stay within the codec's error of Θ at every version, and nothing drifts. This bench runs the
quality bench's Decoupled arm (bench/quality.py: M = 4 learner processes and a syncer, the
quickstart model, the same token budget and held-out windows, K = 1, P = 4, int4 outer
gradients, RDA) once per codec and seed, with only the broadcast codec changed, the codecs of
one seed back to back so the machine's slow swings hit them alike. Last line: JSON with each
codec's mean final held-out loss, and `<codec>_over_<ref>`: the mean over seeds of the
per-seed ratio to the reference codec (--ref, int8 by default: the broadcast's default until 2026-12-06).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import quality


def run(args: argparse.Namespace, arm: str, seed: int) -> dict[str, Any]:
    codec, _, frag = arm.partition("@p")
    syncer: dict[str, Any] = {"broadcastCompression": codec, **({"fragments": int(frag)} if frag else {})}
    model = {k: v for k, v in (("layers", args.layers), ("dModel", args.d_model), ("heads", args.heads)) if v}
    m = quality.manifest(args, seed, args.lr, groups=[{"name": "local", "replicas": args.learners}],
                         syncer=syncer, model=model)
    if args.eval_batches:
        m["spec"]["training"]["evalBatches"] = args.eval_batches
    codec = arm  # rows and results are keyed by the arm's whole name
    t0 = time.monotonic()
    r = common.run_job(m, args.out_dir / f"{codec}-s{seed}", total_steps=args.learners * args.steps,
                       max_seconds=args.max_seconds)
    loss = float(r.summary["final_eval_loss"])
    down = sum(d for _, d in r.wire.values()) if r.wire else None
    steps, skipped = pace(args.out_dir / f"{codec}-s{seed}" / "events.jsonl")
    row = {"codec": codec, "seed": seed, "final_eval_loss": loss, "tokens": r.trained_tokens,
           "outer_steps": r.summary["outer_steps"], "wall_seconds": round(time.monotonic() - t0, 1),
           "bytes_received": down, "steps": steps, "skipped_slots": skipped}
    print(f"broadcast {codec} seed {seed}: final loss {loss:.4f} ({row['wall_seconds']:.0f} s; "
          f"{row['outer_steps']} outer steps; steps {steps}, slots skipped {skipped})", flush=True)
    return row


def pace(events: Path) -> tuple[list[int], list[int]]:
    """Per learner, its inner steps and the schedule's slots it skipped, from its last progress
    event: learners that ran at unequal speeds on the shared cores show here (the fastest sets
    the schedule; the others skip slots and merge in rounds of their own, docs/ALGORITHM.md)."""
    last: dict[str, dict[str, Any]] = {}
    for line in events.read_text().splitlines():
        e = json.loads(line)
        if e.get("event") == "progress":
            last[str(e["source"])] = e
    return [int(last[s]["step"]) for s in sorted(last)], [int(last[s]["skipped_slots"]) for s in sorted(last)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--codecs", type=lambda s: s.split(","), default=["fp32", "int8", "int4"])
    parser.add_argument("--ref", default="int8")
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=1200, help="inner steps per learner, as bench/quality.py")
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--lr", type=float, default=6e-3, help="Decoupled's best inner lr in bench/quality.py")
    parser.add_argument("--eval-interval", type=int, default=100)
    # Unset: the quality bench's model (2 layers, d_model 128: 20 tensors, so P <= 20).
    parser.add_argument("--layers", type=int, help="model layers (P = 68 needs 8: 68 tensors)")
    parser.add_argument("--d-model", type=int, help="model width (64 at 8 layers: about the 2-layer model's cost)")
    parser.add_argument("--heads", type=int, help="attention heads")
    parser.add_argument("--eval-batches", type=int,
                        help="held-out batches of 8 x 128 tokens (unset: the benches' 16; bench/replay.py)")
    parser.add_argument("--sharding", choices=["contiguous", "interleaved"], default="contiguous")
    parser.add_argument("--max-seconds", type=float, default=1800.0)
    parser.add_argument("--out-dir", type=Path, default=common.RUNS / "broadcast-quality")
    parser.add_argument("--smoke", action="store_true", help="seconds, not minutes: 2 learners, 24 steps")
    args = parser.parse_args()
    if args.smoke:
        common.use_smoke_model()
        args.steps, args.learners, args.eval_interval, args.max_seconds = 24, 2, 12, 120.0
        args.seeds = args.seeds[:1]
        args.out_dir = common.RUNS / "smoke" / "broadcast-quality"
    if args.ref not in args.codecs:
        parser.error(f"--ref {args.ref} is not among --codecs {','.join(args.codecs)}")
    t_start = time.monotonic()
    rows = [run(args, codec, seed) for seed in args.seeds for codec in args.codecs]
    loss = {(r["codec"], r["seed"]): r["final_eval_loss"] for r in rows}
    result: dict[str, Any] = {
        "bench": "broadcast_quality", "learners": args.learners, "steps_per_learner": args.steps, "lr": args.lr,
        "seeds": args.seeds, "tokens": rows[0]["tokens"],
        "mean": {c: round(statistics.mean(loss[c, s] for s in args.seeds), 5) for c in args.codecs},
        "per_seed": {c: [round(loss[c, s], 5) for s in args.seeds] for c in args.codecs},
    }
    for codec in args.codecs:
        if codec != args.ref:
            result[f"{codec}_over_{args.ref}"] = round(
                statistics.mean(loss[codec, s] / loss[args.ref, s] for s in args.seeds), 5)
    result["seconds"] = round(time.monotonic() - t_start, 1)
    result.update(common.machine())
    common.save_json(args.out_dir / "rows.json", rows)
    common.emit(result)


if __name__ == "__main__":
    main()
