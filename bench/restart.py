"""A learner's (re)start as the container makes it, cold and warm, beside the plain loop's own start.

    python bench/restart.py [--config examples/quickstart.yaml] [--rounds 5]

A re-admitted learner adds nothing to the model from its kill until the syncer accepts its next
push; this bench measures that start the way a pod makes it: `diloco learner` with the
arguments and variables the operator renders (the token from a file, the compilation cache of
operator/render/compile_cache.py in a folder standing in for the pod's volume), no pre-forked process,
pinned to core 0 beside a live syncer on core 1 that already holds the job's state (a re-join,
not a first start). Each round restarts it twice: `cold`, an empty cache (what every container
start paid before the operator rendered one), and `warm`, the cache its previous start left
(a container restart in its pod, or any start with a shared cache); then the plain loop (the
same recipe's step, no syncer) started cold and warm the same way. The learner's `training`
event (trainer/timeline.py) gives each phase in seconds since the process started: `imports`
(interpreter and imports), `configured`, `compiled`, `joined` (the global model pulled),
`first_step`, `first_push_accepted`. The plain loop reports its imports, its compile and its
first step. Last line: JSON with the medians per start kind and `warm_joined_seconds`, the
issue's figure (target <= 2.0 s on the quickstart model on this CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.learner import free_port  # noqa: E402

DILOCO = str(Path(sys.executable).parent / "diloco")  # the console script, as the image's PATH has it
PHASES = ("imports", "configured", "compiled", "joined", "first_step", "first_push_accepted")

PLAIN = r"""
import json, sys
from diloco.trainer.timeline import Timeline
timeline = Timeline()
from diloco.launch import learner_runtime, pin_cpus
pin_cpus("0")
learner_runtime()  # as the learner does: the same allocator and XLA settings
import jax
from diloco.spec import load_job
from diloco.trainer import data, model, sharding
from diloco.trainer.recipe import Recipe, scalar
job = load_job(sys.argv[1]); spec = job.spec; cfg, tr = spec.model, spec.training
corpus = data.load(spec.data, cfg.vocab_size, cfg.context + 1)
batches = data.Batches(corpus.train, tr.batch_size, cfg.context + 1, seed=spec.data.seed, shard_index=0)
timeline.mark("configured")
recipe = Recipe(cfg, tr, sharding.layout(tr.mesh, model.parameter_shapes(cfg), tr.batch_size))
params = recipe.place(model.init_params(cfg, spec.data.seed))
opt = recipe.init_state(params)
timeline.mark("compiled")
params, opt, loss = recipe.step(params, opt, batches.batch(0), 0)
scalar(loss)
timeline.mark("first_step")
print(json.dumps({"event": "training", **timeline.marks}), flush=True)
"""


def cache_env(config: str, cache: Path) -> dict[str, str]:
    """The learner container's cache variables as the operator renders them, the volume at `cache`."""
    from diloco.operator.render.compile_cache import variables
    from diloco.spec import load_job

    return variables(load_job(config).spec, mount=str(cache))


def base_env() -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "DILOCO_", "XLA_"))}
    return {**clean, "PYTHONUNBUFFERED": "1", "HOME": tempfile.gettempdir()}


def training_event(proc: subprocess.Popen[str], timeout: float, what: str) -> dict[str, Any]:
    """The child's `training` line (the rest of its stdout is ignored)."""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    for line in proc.stdout:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict) and event.get("event") == "training":
            return event
        if time.monotonic() > deadline:
            break
    raise SystemExit(f"bench/restart.py: {what} gave no training event (exit {proc.poll()})")


def learner_start(config: str, port: int, token_file: Path, cache: Path) -> dict[str, Any]:
    """`diloco learner` as the pod runs it, until its first accepted push; then SIGKILL (a lost pod)."""
    from diloco.contract import LearnerArgs

    args = LearnerArgs(config, "local", 0, f"127.0.0.1:{port}", metrics_port=free_port(), token_file=str(token_file))
    env = {**base_env(), **cache_env(config, cache)}
    proc = subprocess.Popen(["taskset", "-c", "0", DILOCO, "learner", *args.argv()], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        return training_event(proc, 300, "the learner")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)


def plain_start(config: str, cache: Path) -> dict[str, Any]:
    proc = subprocess.Popen([sys.executable, "-P", "-c", PLAIN, config], env={**base_env(), **cache_env(config, cache)},
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        return training_event(proc, 300, "the plain loop")
    finally:
        proc.wait(60)


def medians(rows: list[dict[str, Any]]) -> dict[str, float]:
    return {p: round(statistics.median(r[p] for r in rows), 3) for p in PHASES if all(p in r for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "examples" / "quickstart.yaml"))
    parser.add_argument("--rounds", type=int, default=5)
    a = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="restart-bench-"))
    token = work / "token"
    token.write_text(secrets.token_hex(16))
    port = free_port()
    syncer = subprocess.Popen(["taskset", "-c", "1", DILOCO, "syncer", "--config", a.config, "--port", str(port),
                               "--token-file", str(token), "--checkpoint-dir", str(work / "checkpoints")],
                              env=base_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs: dict[str, list[dict[str, Any]]] = {"learner_cold": [], "learner_warm": [], "plain_cold": [], "plain_warm": []}
    try:
        warm = work / "cache-warm"
        first = learner_start(a.config, port, token, warm)  # seeds the syncer and fills the cache: not counted
        print(f"first start (seeds the syncer, fills the cache): {first}", flush=True)
        plain_warm = work / "plain-warm"
        plain_start(a.config, plain_warm)
        for r in range(a.rounds):
            cold = work / f"cache-cold-{r}"
            runs["learner_cold"].append(learner_start(a.config, port, token, cold))
            runs["learner_warm"].append(learner_start(a.config, port, token, warm))
            runs["plain_cold"].append(plain_start(a.config, work / f"plain-cold-{r}"))
            runs["plain_warm"].append(plain_start(a.config, plain_warm))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1].get('joined', v[-1].get('first_step'))} s"
                                                  for k, v in runs.items()), flush=True)
            for folder in (cold, work / f"plain-cold-{r}"):
                shutil.rmtree(folder, ignore_errors=True)
    finally:
        syncer.terminate()
        syncer.wait(30)
        shutil.rmtree(work, ignore_errors=True)
    result = {kind: medians(rows) for kind, rows in runs.items()}
    for kind, row in result.items():
        print(f"{kind:>13}: " + "  ".join(f"{p} {v:.2f}" for p, v in row.items()), flush=True)
    result["warm_joined_seconds"] = result["learner_warm"]["joined"]
    result["cold_joined_seconds"] = result["learner_cold"]["joined"]
    result["rounds"] = a.rounds
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
