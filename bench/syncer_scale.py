"""How many learners one syncer sustains, measured end to end with real processes.

    python bench/syncer_scale.py [--models 1e8,1e9] [--fragments 24] [--step-seconds 1.0]
                                 [--learners 1,2,4,6,8,12,16] [--slots 72] [--smoke]

For each model size: a real syncer process (`diloco syncer`, the job's defaults but for the
model and P, no checkpoints) pinned to CPU 0, and for M = 1, 2, 4, ... a load generator process
(`diloco.testing.loadgen`: M synthetic learners over real gRPC, no JAX) pinned to CPU 1, pushing
precomputed int4 outer gradients on the shared schedule at one step per `--step-seconds`. M is
sustained when every push is accepted and sent on time and every slot's merge reaches every
learner before the next slot begins (the first P slots, which open the rounds, excluded). The
search stops at the first M not sustained. The load generator runs on its own core, so the
syncer has one core, as one shard would.

Last line: JSON with `max_learners` keyed "<params>@<P>@<step seconds>" (the largest M sustained;
0 if not even one) and every trial's figures. `shard_speedup` is null: the sharded syncer is not
built yet.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
MODELS = {"5e5": (2, 128), "1e7": (6, 384), "1e8": (14, 768), "1e9": (24, 1856)}  # nominal size: (layers, dModel)


def pinned(cpu: int) -> list[str]:
    """A command prefix pinning the process to one core (each JAX-free process gets its own)."""
    return ["taskset", "-c", str(cpu)] if shutil.which("taskset") and os.cpu_count() and os.cpu_count() > 1 else []


def manifest(layers: int, d_model: int, fragments: int) -> dict[str, Any]:
    return {
        "apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "syncer-scale"},
        "spec": {"learnerGroups": [{"name": "synthetic", "region": "bench", "replicas": 64}],
                 "syncer": {"fragments": fragments},
                 "model": {"layers": layers, "dModel": d_model, "heads": max(1, d_model // 64), "context": 128}},
    }


def shapes_of(layers: int, d_model: int) -> dict[str, list[int]]:
    """Parameter shapes, computed in a child process: this one stays free of JAX's threads."""
    code = ("import json, sys; from diloco.spec import TransformerModel; from diloco.trainer.model import parameter_shapes;"
            f"print(json.dumps(parameter_shapes(TransformerModel(layers={layers}, d_model={d_model}, "
            f"heads={max(1, d_model // 64)}, context=128))))")
    out = subprocess.run([sys.executable, "-P", "-c", code], check=True, capture_output=True, text=True, cwd=REPO)
    return {k: list(v) for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def start_syncer(config: Path, token: str, log: Path) -> tuple[subprocess.Popen[str], str]:
    env = dict(os.environ, DILOCO_TOKEN=token)
    with open(log, "w") as err:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([*pinned(0), sys.executable, "-P", "-m", "diloco.cli", "syncer", "--config", str(config),
                                 "--port", "0"], stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=REPO)
    assert proc.stdout is not None
    for line in proc.stdout:  # the ready line says the port; a large model takes a while to initialise
        if line.startswith("SYNCER_READY"):
            return proc, "127.0.0.1:" + line.split("port=")[1].split()[0]
    raise SystemExit(f"the syncer exited before serving; see {log}:\n{log.read_text()[-2000:]}")


def trial(address: str, token: str, shapes: Path, learners: int, step: float, slots: int, prefix: str) -> dict[str, Any]:
    env = dict(os.environ, DILOCO_TOKEN=token)
    cmd = [*pinned(1), sys.executable, "-P", "-m", "diloco.testing.loadgen", "--address", address, "--shapes",
           str(shapes), "--learners", str(learners), "--step-seconds", str(step), "--slots", str(slots), "--prefix", prefix]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600 + 4 * slots * step)
    if out.returncode != 0:
        return {"learners": learners, "sustained": False, "error": out.stderr.strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="1e8,1e9", help=f"nominal sizes, of {', '.join(MODELS)}")
    parser.add_argument("--fragments", type=int, default=24)
    parser.add_argument("--step-seconds", type=float, default=1.0)
    parser.add_argument("--learners", default="1,2,4,6,8,12,16,24,32,48,64")
    parser.add_argument("--slots", type=int, default=72, help="slots per trial (the first P are not counted)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, P = 4, two short trials")
    args = parser.parse_args()
    if args.smoke:
        args.models, args.fragments, args.step_seconds, args.learners, args.slots = "5e5", 4, 0.5, "1,2", 12
    result: dict[str, Any] = {"bench": "syncer_scale", "max_learners": {}, "shard_speedup": None, "trials": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            layers, d_model = MODELS[name]
            shapes = shapes_of(layers, d_model)
            params = sum(math.prod(s) for s in shapes.values())
            key = f"{name}@{args.fragments}@{args.step_seconds}"
            config, shapes_file = Path(tmp) / f"{name}.yaml", Path(tmp) / f"{name}.json"
            config.write_text(yaml.safe_dump(manifest(layers, d_model, args.fragments)))
            shapes_file.write_text(json.dumps(shapes))
            token = secrets.token_hex(16)
            t0 = time.monotonic()
            syncer, address = start_syncer(config, token, Path(tmp) / f"{name}.log")
            print(f"{key}: {params:,} parameters, syncer ready in {time.monotonic() - t0:.0f} s", flush=True)
            best, trials = 0, []
            try:
                for m in (int(x) for x in args.learners.split(",")):
                    row = trial(address, token, shapes_file, m, args.step_seconds, args.slots, f"m{m}")
                    trials.append(row)
                    print(f"  {m:3d} learners: " + ("sustained" if row.get("sustained") else "NOT sustained") +
                          f"  {json.dumps({k: v for k, v in row.items() if k not in ('learners', 'sustained')})}", flush=True)
                    if not row.get("sustained"):
                        break
                    best = m
            finally:
                syncer.terminate()
                syncer.wait(timeout=120)
            result["max_learners"][key] = best
            result["trials"][key] = {"parameters": params, "rows": trials}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
