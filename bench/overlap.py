"""Does communication hide behind compute? A learner on a live syncer against a plain loop.

    python bench/overlap.py [--seconds 25] [--rounds 2] [--config examples/quickstart.yaml]

In one run, alternating A/B `--rounds` times on the same pinned core (core 0; the syncer
gets core 1): steps/s of `diloco learner` attached to a live syncer, pushing one fragment
every step and adopting every published fragment, against the same model and optimizer
in a plain optax loop with no syncer. Last line: JSON with the ratio (target >= 0.95).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PLAIN = r"""
import os, sys, time
os.sched_setaffinity(0, {0})
import jax, numpy as np
from diloco.spec import load_job
from diloco.trainer import data, model
from diloco.trainer.recipe import Recipe
job = load_job(sys.argv[1]); spec = job.spec; cfg, tr = spec.model, spec.training
train, _ = data.split(data.corpus_bytes(), spec.data.held_out_fraction)
rng = np.random.default_rng(0)
recipe = Recipe(cfg, tr)  # the learner's own step
params = recipe.place(model.init_params(cfg, 0))
opt = recipe.init_state(params)
seconds = float(sys.argv[2]); n = 0; warm = 3.0
t0 = time.monotonic(); start = None
while True:
    params, opt, loss = recipe.step(params, opt, data.sample_batch(train, tr.batch_size, cfg.context + 1, rng), n)
    float(loss)  # the learner reads its loss every step too
    now = time.monotonic()
    if start is None and now - t0 >= warm:
        start, n = now, 0
    n += 1
    if start is not None and now - start >= seconds:
        break
print(n / (now - start))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def plain(config: str, seconds: float) -> float:
    out = subprocess.run([sys.executable, "-P", "-c", PLAIN, config, str(seconds)], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def attached(config: str, seconds: float) -> tuple[float, dict]:
    env = dict(os.environ, DILOCO_TOKEN=secrets.token_hex(16), PYTHONUNBUFFERED="1")
    port = free_port()
    syncer = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-P", "-m", "diloco.cli", "syncer", "--config", config,
                               "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    learner = subprocess.Popen([sys.executable, "-P", "-m", "diloco.cli", "learner", "--config", config, "--group",
                                "local", "--index", "0", "--syncer", f"127.0.0.1:{port}", "--cpus", "0"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    samples: list[tuple[float, int]] = []
    last: dict = {}
    try:
        for line in learner.stdout:  # type: ignore[union-attr]
            event = json.loads(line)
            if event["event"] == "progress":
                samples.append((event["t"], event["step"]))
                last = event
                if samples[-1][0] - samples[0][0] >= seconds + 3.0:
                    break
    finally:
        learner.terminate()
        learner.wait(30)
        syncer.terminate()
        syncer.wait(30)
    warm = [s for s in samples if s[0] >= samples[0][0] + 3.0]  # skip the first seconds, as the plain loop does
    (t0, s0), (t1, s1) = warm[0], warm[-1]
    return (s1 - s0) / (t1 - t0), last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default=str(ROOT / "examples" / "quickstart.yaml"))
    parser.add_argument("--seconds", type=float, default=25.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    plains, learners = [], []
    last: dict = {}
    for r in range(args.rounds):
        plains.append(plain(args.config, args.seconds))
        rate, last = attached(args.config, args.seconds)
        learners.append(rate)
        print(f"round {r + 1}: plain {plains[-1]:.2f} steps/s, learner on live syncer {rate:.2f} steps/s")
    ratio = sum(learners) / sum(plains)
    print(f"learner/plain = {ratio:.3f} (target >= 0.95); bytes sent {last.get('bytes_sent')}, received {last.get('bytes_received')}")
    print(json.dumps({"plain_steps_per_s": plains, "learner_steps_per_s": learners, "ratio": ratio,
                      "config": os.path.relpath(args.config, ROOT)}))


if __name__ == "__main__":
    main()
