"""How many learners one syncer shard sustains, and two, measured end to end with real processes.

    python bench/syncer_scale.py [--models 1e8,1e9] [--fragments 24] [--step-seconds 1.0]
                                 [--learners 1,2,4,6,8,12,16] [--shards 1,2] [--slots 96] [--warmup-cycles 2]
                                 [--rejoin-every SECONDS] [--join-bytes-per-second B|none]
                                 [--loadgen-processes 4] [--smoke]

For each model size and shard count N: N real syncer processes (`diloco syncer --shard i`, the
job's defaults but for the model, P and N, no checkpoints), and for M = 1, 2, 4, ... a load
generator (`diloco.apps.testkit.loadgen`: M synthetic learners over real gRPC, no JAX, spread over
`--loadgen-processes` processes started on one clock, by default one per core it has), each
shard pinned to a core of its own and the load generator to the rest while there are N + 1 cores
(else none pinned), pushing precomputed int4 outer gradients on the shared schedule at one step
per `--step-seconds`, in each slot one fragment to each shard (core/schedule.py). M is sustained when every
push is accepted and sent on time and every slot's merge reaches every learner before the next
slot begins (the first two cycles of P slots excluded: the first opens the rounds, the
second absorbs the backlog of a large model's first publishes, which grow the syncer's heap).
With `--rejoin-every S`, another process reads a whole Join every S seconds meanwhile (the
syncer's side of re-admissions under load; each Join's seconds are in the row's `joins`).
The search stops at the first M not sustained; with N > 1 it starts at the largest M one shard sustained (measured again) and
goes down if that fails. On a 2-core machine two shards and the load generator share both cores.

Last line: JSON with `max_learners` keyed "<params>@<P>@<step seconds>" (one shard; the largest M
sustained, 0 if not even one), `max_learners_by_shards` (the same per shard count), and
`shard_speedup` per key: the capacity with the largest N tried over the capacity with one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from diloco.apps.testkit.loadgen import seed

REPO = Path(__file__).resolve().parent.parent
MODELS = {"5e5": (2, 128), "1e7": (6, 384), "1e8": (14, 768), "1e9": (24, 1856)}  # nominal size: (layers, dModel)


def pinned(cpus: list[int] | None) -> list[str]:
    """A command prefix pinning the process to those cores (None: the kernel places it)."""
    ok = cpus is not None and shutil.which("taskset") is not None and (os.cpu_count() or 1) > 1
    return ["taskset", "-c", ",".join(map(str, cpus or []))] if ok else []


def placement(shards: int) -> tuple[list[list[int] | None], list[int] | None]:
    """Cores for the shards (one each) and the load generator (the rest) while there are enough;
    else the kernel balances them all over every core (pinning a shard beside the load generator
    would starve one of them while another core idles)."""
    cpus = sorted(os.sched_getaffinity(0))
    if shards + 1 <= len(cpus):
        return [[cpus[i]] for i in range(shards)], cpus[shards:]
    return [None] * shards, None


def manifest(layers: int, d_model: int, fragments: int, shards: int = 1, **syncer: Any) -> dict[str, Any]:
    return {
        "apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "syncer-scale"},
        "spec": {"learnerGroups": [{"name": "synthetic", "region": "bench", "replicas": 64}],
                 "syncer": {"fragments": fragments, "shards": shards, **syncer},
                 "model": {"layers": layers, "dModel": d_model, "heads": max(1, d_model // 64), "context": 128}},
    }


def shapes_of(layers: int, d_model: int) -> dict[str, list[int]]:
    """Parameter shapes, computed in a child process: this one stays free of JAX's threads."""
    code = ("import json, sys; from diloco.spec import TransformerModel; from diloco.trainer.model import parameter_shapes;"
            f"print(json.dumps(parameter_shapes(TransformerModel(layers={layers}, d_model={d_model}, "
            f"heads={max(1, d_model // 64)}, context=128))))")
    out = subprocess.run([sys.executable, "-P", "-c", code], check=True, capture_output=True, text=True, cwd=REPO)
    return {k: list(v) for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def start_syncer(config: Path, token: str, log: Path, shard: int, cpu: list[int] | None) -> tuple[subprocess.Popen[str], str]:
    env = dict(os.environ, DILOCO_TOKEN=token)
    with open(log, "w") as err:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([*pinned(cpu), sys.executable, "-P", "-m", "diloco.apps.cli", "syncer", "--config", str(config),
                                 "--port", "0", "--shard", str(shard)],
                                stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=REPO)
    assert proc.stdout is not None
    for line in proc.stdout:  # the ready line says the port; a large model takes a while to initialise
        if line.startswith("SYNCER_READY"):
            return proc, "127.0.0.1:" + line.split("port=")[1].split()[0]
    raise SystemExit(f"the syncer exited before serving; see {log}:\n{log.read_text()[-2000:]}")


def cpu_seconds(pid: int) -> float:
    """A live process's user + system CPU time so far (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def trial(address: str, token: str, shapes: Path, learners: int, step: float, slots: int, warmup: int, prefix: str,
          cpu: list[int] | None, syncers: list[int], rejoin_every: float = 0.0, processes: int = 1) -> dict[str, Any]:
    """One load-generator run; with it, how busy each side was (CPU seconds per wall second, over
    the whole run: joining, pushing, draining), so a row says which side ran out of core."""
    env = dict(os.environ, DILOCO_TOKEN=token)
    cmd = [*pinned(cpu), sys.executable, "-P", "-m", "diloco.apps.testkit.loadgen", "--address", address, "--shapes",
           str(shapes), "--learners", str(learners), "--step-seconds", str(step), "--slots", str(slots), "--warmup-cycles", str(warmup), "--prefix", prefix,
           "--rejoin-every", str(rejoin_every), "--processes", str(processes)]
    before, children, t0 = [cpu_seconds(p) for p in syncers], resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600 + 4 * slots * step)
    wall, after = time.monotonic() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    busy = {"syncer_cpu": [round((cpu_seconds(p) - b) / wall, 2) for p, b in zip(syncers, before)],
            "loadgen_cpu": round((after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime) / wall, 2)}
    if out.returncode != 0:
        return {"learners": learners, "sustained": False, "error": out.stderr.strip().splitlines()[-1:], **busy}
    return {**json.loads(out.stdout.strip().splitlines()[-1]), **busy}


def capacity(name: str, shards: int, learners: list[int], start: int, args: argparse.Namespace,
             tmp: Path) -> dict[str, Any]:
    """Start `shards` syncer processes for model `name`; try M = learners[start], ... upwards
    until one fails (downwards from there if the first fails): the largest M sustained."""
    layers, d_model = MODELS[name]
    shapes = shapes_of(layers, d_model)
    params = sum(math.prod(s) for s in shapes.values())
    key = f"{name}@{args.fragments}@{args.step_seconds}"
    config, shapes_file = tmp / f"{name}-{shards}.yaml", tmp / f"{name}.json"
    pacing = {} if args.join_bytes_per_second is None else {
        "joinBytesPerSecond": None if args.join_bytes_per_second == "none" else float(args.join_bytes_per_second)}
    config.write_text(yaml.safe_dump(manifest(layers, d_model, args.fragments, shards, **pacing)))
    shapes_file.write_text(json.dumps(shapes))
    token = secrets.token_hex(16)
    t0 = time.monotonic()
    cores, generator = placement(shards)
    syncers = [start_syncer(config, token, tmp / f"{name}-{shards}-{i}.log", i, cores[i]) for i in range(shards)]
    address = ",".join(a for _, a in syncers)
    seed([a for _, a in syncers], token, {n: tuple(v) for n, v in shapes.items()}, args.fragments)  # Θ₀ comes from learners
    print(f"{key}, {shards} shard(s) on cores {cores}, load generator on {generator} (None: unpinned): "
          f"{params:,} parameters, ready in {time.monotonic() - t0:.0f} s", flush=True)
    best, trials = 0, []

    def sustains(m: int) -> bool:
        row = trial(address, token, shapes_file, m, args.step_seconds, args.slots, args.warmup_cycles, f"m{len(trials)}-{m}", generator,
                    [proc.pid for proc, _ in syncers], args.rejoin_every,
                    args.loadgen_processes or len(generator or os.sched_getaffinity(0)))
        trials.append(row)
        print(f"  {m:3d} learners: " + ("sustained" if row.get("sustained") else "NOT sustained") +
              f"  {json.dumps({k: v for k, v in row.items() if k not in ('learners', 'sustained')})}", flush=True)
        return bool(row.get("sustained"))

    try:
        for m in learners[start:]:  # upwards until one fails
            if not sustains(m):
                break
            best = m
        if best == 0:  # the first tried failed: downwards until one holds
            best = next((m for m in reversed(learners[:start]) if sustains(m)), 0)
    finally:
        for proc, _ in syncers:
            proc.terminate()
        for proc, _ in syncers:
            proc.wait(timeout=120)
    return {"key": key, "parameters": params, "shards": shards, "max_learners": best, "rows": trials}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="1e8,1e9", help=f"nominal sizes, of {', '.join(MODELS)}")
    parser.add_argument("--fragments", type=int, default=24)
    parser.add_argument("--step-seconds", type=float, default=1.0)
    parser.add_argument("--learners", default="1,2,4,6,8,12,16,24,32,48,64")
    parser.add_argument("--shards", default="1,2", help="shard counts to measure, one first")
    parser.add_argument("--slots", type=int, default=96, help="slots per trial, warm-up included")
    parser.add_argument("--warmup-cycles", type=int, default=2,
                        help="cycles of P slots not counted: the first opens the rounds, the second absorbs "
                             "the backlog of a large model's first publishes")
    parser.add_argument("--rejoin-every", type=float, default=0.0,
                        help="seconds between whole Joins (a learner re-admitted: the model read to its last byte) "
                             "made by another process while the slots are counted; 0: none")
    parser.add_argument("--join-bytes-per-second", default=None,
                        help="spec.syncer.joinBytesPerSecond for the syncers ('none': unpaced; default: the spec's)")
    parser.add_argument("--loadgen-processes", type=int, default=0,
                        help="processes the synthetic learners are spread over (one Python process's gRPC threads "
                             "share one lock); 0: one per core the load generator has (4 on its one core here "
                             "kept fewer learners than 1: 6 against 10-12 at 1e9)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, P = 4, two short trials")
    args = parser.parse_args()
    if args.smoke:
        args.models, args.fragments, args.step_seconds, args.learners, args.slots = "5e5", 4, 0.5, "1,2", 12
        args.rejoin_every = args.rejoin_every or 2.0  # one whole Join in the counted slots
    counts = [int(x) for x in args.shards.split(",")]
    if counts[0] != 1:
        raise SystemExit("--shards: start with 1 (the speedup is over one shard)")
    learners = [int(x) for x in args.learners.split(",")]
    result: dict[str, Any] = {"bench": "syncer_scale", "max_learners": {}, "max_learners_by_shards": {},
                              "shard_speedup": {}, "trials": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            one = 0
            for shards in counts:
                start = next((i for i, m in enumerate(learners) if m >= one), 0) if shards > 1 else 0
                got = capacity(name, shards, learners, start, args, Path(tmp))
                key = got["key"]
                result["max_learners_by_shards"].setdefault(key, {})[str(shards)] = got["max_learners"]
                result["trials"].setdefault(key, {"parameters": got["parameters"], "rows": {}})["rows"][str(shards)] = got["rows"]
                if shards == 1:
                    one = got["max_learners"]
                    result["max_learners"][key] = one
                else:
                    result["shard_speedup"][key] = round(got["max_learners"] / one, 3) if one else None
    print(json.dumps(result))


if __name__ == "__main__":
    main()
