"""A learner's speed: on a live syncer against the same recipe in a plain loop, and its MFU.

    python bench/learner.py [--config examples/quickstart.yaml] [--seconds 25] [--rounds 2]

In one run, alternating A/B `--rounds` times on the same pinned core (core 0; the syncer
gets core 1): steps/s of `diloco learner` attached to a live syncer (pushing a fragment
every step, adopting every publish), against trainer/recipe.py's step in a plain loop with
the same mesh on the same devices and no syncer. On a CPU the learner's mesh gets its devices
as `diloco run` gives them (XLA host-platform devices). Last line: JSON with `ratio` (target
>= 0.97 on CPU) and `mfu`: model FLOPs per second (6 x parameters + attention, per token)
over the devices' peak, from PEAK_FLOPS by device kind; a CPU has no fixed entry, so its
peak is the fp32 matmul rate XLA reaches on the same core in the same run (stated).
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

# Dense bf16 peak per chip (vendor figures, no sparsity).
PEAK_FLOPS = {
    "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H200": 989e12, "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12, "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5p": 459e12, "TPU v6 lite": 918e12,
}

PLAIN = r"""
import json, os, sys, time
os.sched_setaffinity(0, {0})
import jax, numpy as np
from diloco.spec import load_job
from diloco.trainer import data, model, sharding
from diloco.trainer.recipe import Recipe, scalar
job = load_job(sys.argv[1]); spec = job.spec; cfg, tr = spec.model, spec.training
corpus = data.load(spec.data, cfg.vocab_size, cfg.context + 1)
batches = data.Batches(corpus.train, tr.batch_size, cfg.context + 1, spec.data.seed, 0)
shapes = model.parameter_shapes(cfg)
recipe = Recipe(cfg, tr, sharding.layout(tr.mesh, shapes, tr.batch_size))  # the learner's own step and mesh
params = recipe.place(model.init_params(cfg, 0))
opt = recipe.init_state(params)
seconds = float(sys.argv[2]); n = 0; warm = 3.0
t0 = time.monotonic(); start = None
while True:
    params, opt, loss = recipe.step(params, opt, batches.batch(n), n)
    scalar(loss)  # the learner reads its loss every step too
    now = time.monotonic()
    if start is None and now - t0 >= warm:
        start, n = now, 0
    n += 1
    if start is not None and now - start >= seconds:
        break
rate = n / (now - start)
# The CPU's peak for MFU: XLA's best fp32 matmul on this core, measured now.
a = jax.numpy.ones((1024, 1024), jax.numpy.float32)
mm = jax.jit(lambda a: a @ a)
mm(a).block_until_ready()
t = time.perf_counter(); reps = 20
for _ in range(reps):
    out = mm(a)
out.block_until_ready()
matmul = 2 * 1024 ** 3 * reps / (time.perf_counter() - t)
print(json.dumps({"steps_per_s": rate, "device_kind": jax.devices()[0].device_kind, "devices": jax.device_count(),
                  "matmul_flops": matmul}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def device_env(config: str) -> dict[str, str]:
    """The CPU devices `diloco run` would give this learner (its mesh's share)."""
    from diloco.local.runner import cpu_devices
    from diloco.spec import load_job

    return dict(os.environ, **cpu_devices(load_job(config).spec, 1))


def plain(config: str, seconds: float) -> dict:
    out = subprocess.run([sys.executable, "-P", "-c", PLAIN, config, str(seconds)], capture_output=True, text=True,
                         check=True, env=device_env(config))
    return json.loads(out.stdout.strip().splitlines()[-1])


def attached(config: str, seconds: float) -> tuple[float, dict]:
    env = dict(device_env(config), DILOCO_TOKEN=secrets.token_hex(16), PYTHONUNBUFFERED="1")
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


def flops_per_step(config: str) -> float:
    """Training FLOPs of one step: 6 per parameter per token plus attention's 12 x layers x
    context x width per token (PaLM's appendix B accounting)."""
    import numpy as np

    from diloco.spec import load_job
    from diloco.trainer.model import parameter_shapes

    spec = load_job(config).spec
    cfg, tokens = spec.model, spec.training.batch_size * spec.model.context
    n = sum(int(np.prod(s)) for s in parameter_shapes(cfg).values())
    return float(tokens * (6 * n + 12 * cfg.layers * cfg.context * cfg.d_model))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default=str(ROOT / "examples" / "quickstart.yaml"))
    parser.add_argument("--seconds", type=float, default=25.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    plains: list[dict] = []
    learners: list[float] = []
    last: dict = {}
    for r in range(args.rounds):
        plains.append(plain(args.config, args.seconds))
        rate, last = attached(args.config, args.seconds)
        learners.append(rate)
        print(f"round {r + 1}: plain {plains[-1]['steps_per_s']:.2f} steps/s, learner on live syncer {rate:.2f} steps/s")
    ratio = sum(learners) / sum(p["steps_per_s"] for p in plains)
    kind, devices = plains[-1]["device_kind"], plains[-1]["devices"]
    peak = PEAK_FLOPS.get(kind, 0.0) * devices
    peak_source = f"{kind}: {PEAK_FLOPS[kind]:.3g} FLOP/s per device (vendor, dense bf16)" if peak else (
        f"{kind}: no table entry; XLA's fp32 1024^3 matmul on the same core, {plains[-1]['matmul_flops']:.3g} FLOP/s")
    peak = peak or plains[-1]["matmul_flops"]
    achieved = flops_per_step(args.config) * sum(learners) / len(learners)
    print(f"learner/plain = {ratio:.3f} (target >= 0.97); mfu {achieved / peak:.3f} ({peak_source}); "
          f"bytes sent {last.get('bytes_sent')}, received {last.get('bytes_received')}")
    print(json.dumps({"plain_steps_per_s": [p["steps_per_s"] for p in plains], "learner_steps_per_s": learners,
                      "ratio": ratio, "mfu": achieved / peak, "model_flops_per_s": achieved, "peak_flops": peak,
                      "peak_source": peak_source, "devices": devices, "config": os.path.relpath(args.config, ROOT)}))


if __name__ == "__main__":
    main()
