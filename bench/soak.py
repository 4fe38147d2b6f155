"""A soak: the chaos example for a long time, next to a fault-free run of the same length.

    python bench/soak.py                 # 30 minutes each, side by side (one core each)
    python bench/soak.py --minutes 5     # a shorter soak

Both jobs are examples/chaos.yaml (3 learners) with the duration set to --minutes; one has chaos
on (a learner SIGKILLed about every 20 s and restarted 3 s later, as the example says) plus
SIGSTOP hangs (a random learner frozen for --hang-seconds about every --hang-every seconds,
then resumed), the other has chaos off. They run at the same time, each pinned to its own
core, so machine load hits both alike. Reports tokens per second kept under chaos, held-out loss
at equal tokens, kills, hangs, re-admissions, and merges lost (the syncer's merges missing
from its final checkpoint; must be 0).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import itertools

import common

ROOT = Path(__file__).resolve().parents[1]


def manifest(minutes: float, chaos: bool) -> dict[str, Any]:
    import yaml

    m = yaml.safe_load((ROOT / "examples" / "chaos.yaml").read_text())
    m["metadata"]["name"] = "soak-chaos" if chaos else "soak-clean"
    m["spec"]["training"]["durationSeconds"] = minutes * 60
    m["spec"]["chaos"]["enabled"] = chaos
    return m


def job(args: argparse.Namespace) -> None:
    """Internal: one job with the product's runner, plus SIGSTOP hangs when chaos is on."""
    from diloco.apps.local.runner import LocalRun
    from diloco.checkpoint import CheckpointStore
    from diloco.spec import parse_job

    m = manifest(args.minutes, args.chaos)
    out = Path(args.out)
    common.fresh_run_dir(out)  # never resume an earlier soak's checkpoints
    rng = random.Random(7)
    hangs: list[tuple[float, str]] = []
    max_outer = [0]

    class SoakRun(LocalRun):
        def poll_status(self) -> None:
            super().poll_status()
            max_outer[0] = max(max_outer[0], self.tracker.outer_steps)

    run = SoakRun(parse_job(m), out, None)
    stop = threading.Event()

    def hang() -> None:
        while not stop.wait(rng.expovariate(1 / args.hang_every)):
            alive = [c for c in run.sup.children.values() if c.kind == "learner" and c.alive]
            if not alive:
                continue
            c = rng.choice(alive)
            try:
                os.killpg(c.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
                hangs.append((time.time(), c.name))
                stop.wait(args.hang_seconds)
                os.killpg(c.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
            except ProcessLookupError:
                pass  # chaos killed it meanwhile

    if args.chaos:
        threading.Thread(target=hang, daemon=True).start()
    summary = run.run(common._QuietView())
    stop.set()
    loaded, _ = CheckpointStore(out / "checkpoints").load_latest()
    in_checkpoint = int(loaded.meta.get("outer_steps", 0)) if loaded else 0
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines() if line.strip()]
    print(json.dumps({"summary": summary, "hangs": len(hangs), "outer_steps_seen": max_outer[0],
                      "outer_steps_in_checkpoint": in_checkpoint,
                      "curve": common.eval_curve(events, common.tokens_per_step(m))}), flush=True)


def loss_at(curve: list[tuple[float, float]], tokens: float) -> float:
    pts = sorted(curve)
    for (t0, l0), (t1, l1) in itertools.pairwise(pts):
        if t0 <= tokens <= t1:
            return l0 + (l1 - l0) * (tokens - t0) / (t1 - t0) if t1 > t0 else l1
    return pts[-1][1] if pts else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--hang-every", type=float, default=45.0, help="mean seconds between SIGSTOP hangs")
    parser.add_argument("--hang-seconds", type=float, default=5.0)
    parser.add_argument("--out-dir", type=Path, default=common.RUNS / "soak")
    parser.add_argument("--smoke", action="store_true", help="half a minute each")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--chaos", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        job(args)
        return
    if args.smoke:
        args.minutes, args.hang_every = 0.5, 10.0
    t0, env = time.monotonic(), common.machine()  # the load before the soak's own jobs start
    procs = {}
    for cpu, chaos in ((0, True), (1, False)):
        name = "chaos" if chaos else "clean"
        cmd = ["taskset", "-c", str(cpu % len(os.sched_getaffinity(0))), sys.executable, "-P", __file__, "--job",
               "--minutes", str(args.minutes), "--hang-every", str(args.hang_every),
               "--hang-seconds", str(args.hang_seconds), "--out", str(args.out_dir / name)]
        procs[name] = subprocess.Popen(cmd + (["--chaos"] if chaos else []), stdout=subprocess.PIPE, text=True)
    res = {}
    for name, p in procs.items():
        out, _ = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"soak job {name} failed with exit code {p.returncode}")
        res[name] = json.loads(out.strip().splitlines()[-1])
    chaos, clean = res["chaos"], res["clean"]
    cs, ks = chaos["summary"], clean["summary"]
    tokens = min(cs["tokens_trained"], ks["tokens_trained"])
    result = {
        "bench": "soak", "minutes": args.minutes,
        "tokens_per_second_kept": round(cs["tokens_per_second"] / ks["tokens_per_second"], 4),
        "tokens_per_second": {"chaos": round(cs["tokens_per_second"], 1), "clean": round(ks["tokens_per_second"], 1)},
        "loss_at_equal_tokens": {"tokens": tokens, "chaos": round(loss_at(chaos["curve"], tokens), 4),
                                 "clean": round(loss_at(clean["curve"], tokens), 4)},
        "final_eval_loss": {"chaos": round(cs["final_eval_loss"], 4), "clean": round(ks["final_eval_loss"], 4)},
        "kills": cs["learner_kills"], "hangs": chaos["hangs"], "readmissions": cs["readmissions"],
        # The final checkpoint also holds the rounds the learners' last flush closed after the last
        # status poll, so it may hold more merges than were seen, never fewer.
        "merges_lost": {k: max(0, r["outer_steps_seen"] - r["outer_steps_in_checkpoint"]) for k, r in res.items()},
        "tokens_unmerged": {k: r["summary"]["tokens_trained"] - r["summary"]["tokens_merged"] for k, r in res.items()},
        "seconds": round(time.monotonic() - t0, 1), **env,
    }
    print(f"tokens/s kept under chaos: {result['tokens_per_second_kept']:.3f} "
          f"({result['kills']} kills, {result['hangs']} hangs, {result['readmissions']} re-admissions); "
          f"merges lost: {result['merges_lost']}")
    common.emit(result)


if __name__ == "__main__":
    main()
