"""A learner's speed: on a live syncer against the same recipe in a plain loop, and its MFU.

    python bench/learner.py [--config examples/quickstart.yaml] [--turns 10] [--turn-seconds 4]

Steps/s of `diloco learner` attached to a live syncer (pushing a fragment every step,
adopting every publish), against trainer/recipe.py's step in a plain loop with the same mesh
on the same devices and no syncer; both evaluate every `evalIntervalSteps`, as the recipe
does. Both processes stay alive, warm, on core 0 (the syncer gets core 1) and take turns:
one runs while the other is held with SIGSTOP, `--turns` times each, so the shared machine's
slow swings (here +-10% over tens of seconds) hit both alike instead of landing on one side
of an A/B run. A turn is shorter than the syncer's keepalive timeout, so holding the learner
never drops its stream. Two layouts, one after the other: `host_core`, XLA's threads on core 0
(the device) and the loops' own threads on core 1 (the host; the learner's `--host-cpus`), as on
an accelerator, whose host runs gRPC and the loop on cores of its own; and `one_core`, every
thread on core 0, where the learner's communication takes the device's cycles. Last line: JSON
with `ratio` (`host_core`; target >= 0.97 on CPU), `ratio_one_core`, each layout's per-turn
rates, and `mfu`: model FLOPs per second (6 x parameters + attention, per token) over the
devices' peak, from PEAK_FLOPS by device kind; a CPU has no fixed entry, so its peak is the
fp32 matmul rate XLA reaches on the same core in the same run (stated). Also
`host_wait_ms_per_step`: per loop, the time from reading one step's loss to dispatching the
next (evaluations excluded), which on an accelerator is the device idling on the host; and
`cpu_ms_per_step`, each loop's CPU per step by kind of thread (main, other threads of the
interpreter, XLA's, gRPC core's), which on this CPU is what the ratio is made of.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Dense bf16 peak per chip (vendor figures, no sparsity).
PEAK_FLOPS = {
    "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H200": 989e12, "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12, "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5p": 459e12, "TPU v6 lite": 918e12,
}

PLAIN = r"""
import json, os, signal, sys, time
os.sched_setaffinity(0, {0})
from diloco.launch import learner_runtime
from diloco.trainer.runtime import split_host_threads
learner_runtime()  # as the learner does: the same allocator and XLA settings on both sides
split_host_threads(sys.argv[2] or None)  # as the learner's --host-cpus does
import jax, numpy as np
from diloco.spec import load_job
from diloco.trainer import data, model, sharding
from diloco.trainer.recipe import Recipe, scalar
job = load_job(sys.argv[1]); spec = job.spec; cfg, tr = spec.model, spec.training
corpus = data.load(spec.data, cfg.vocab_size, cfg.context + 1)
batches = data.Batches(corpus.train, tr.batch_size, cfg.context + 1, seed=spec.data.seed, shard_index=0)
evals = data.eval_batches(corpus.held_out, batches=tr.eval_batches, batch=tr.batch_size, length=cfg.context + 1)
shapes = model.parameter_shapes(cfg)
recipe = Recipe(cfg, tr, sharding.layout(tr.mesh, shapes, tr.batch_size))  # the learner's own step and mesh
params = recipe.place(model.init_params(cfg, 0))
opt = recipe.init_state(params)
for n in range(3):  # compile
    params, opt, loss = recipe.step(params, opt, batches.batch(n), n)
recipe.eval_loss(params, evals)
# The CPU's peak for MFU: XLA's best fp32 matmul on this core, measured while nothing else runs.
a = jax.numpy.ones((1024, 1024), jax.numpy.float32)
mm = jax.jit(lambda a: a @ a)
mm(a).block_until_ready()
t = time.perf_counter(); reps = 20
for _ in range(reps):
    out = mm(a)
out.block_until_ready()
matmul = 2 * 1024 ** 3 * reps / (time.perf_counter() - t)
print(json.dumps({"device_kind": jax.devices()[0].device_kind, "devices": jax.device_count(), "matmul_flops": matmul}),
      flush=True)
os.kill(os.getpid(), signal.SIGSTOP)  # the bench resumes us for our turns
n, last, host_wait, done = 0, 0.0, 0.0, None
while True:
    batch = batches.batch(n)
    t0 = time.monotonic()
    if done is not None:
        host_wait += t0 - done  # measured as the learner measures it (trainer/learner.py)
    params, opt, loss = recipe.step(params, opt, batch, n)
    scalar(loss)  # the learner reads its loss every step too
    done = time.monotonic()
    n += 1
    if n % tr.eval_interval_steps == 0:
        recipe.eval_loss(params, evals)
        done = time.monotonic()
    if time.monotonic() - last >= 0.25:
        last = time.monotonic()
        print(json.dumps({"t": time.time(), "step": n, "host_wait_seconds": host_wait}), flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def device_env(config: str) -> dict[str, str]:
    """The CPU devices `diloco run` would give this learner (its mesh's share)."""
    from diloco.apps.local.runner import cpu_devices
    from diloco.spec import load_job

    return dict(os.environ, **cpu_devices(load_job(config).spec, 1))


class Lines:
    """A child's JSON lines, read in the background: (time, step) samples and the last event."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.samples, self.events = proc, [], []  # type: ignore[var-annotated]
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            event = json.loads(line)
            with self.lock:
                self.events.append(event)
                if "step" in event and event.get("event", "progress") == "progress":
                    self.samples.append((float(event["t"]), int(event["step"]), float(event["host_wait_seconds"])))

    def wait_for(self, test, timeout: float, what: str) -> dict:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                found = next((e for e in self.events if test(e)), None)
            if found is not None:
                return found
            if self.proc.poll() is not None:
                raise SystemExit(f"bench/learner.py: the {what} process exited ({self.proc.returncode})")
            time.sleep(0.1)
        raise SystemExit(f"bench/learner.py: no {what} within {timeout:.0f} s")

    def rate(self, start: float, end: float) -> tuple[int, float, float]:
        """(steps, seconds, seconds the devices waited between steps) between the first and last
        sample inside [start, end]."""
        with self.lock:
            inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return 0, 0.0, 0.0
        (t0, n0, w0), (t1, n1, w1) = inside[0], inside[-1]
        return n1 - n0, t1 - t0, w1 - w0


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of a process's threads so far (/proc/PID/task/*/schedstat, in ns), by kind:
    the main thread; the other threads named after the process ("python": JAX's runtime thread
    in both loops, and the learner's gRPC sender, subscriber and metrics threads); XLA's
    (compute and compilation); gRPC core's own; and the rest."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            ns = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that just ended
            continue
        kind = ("main" if task.name == str(pid) else "other threads" if name == "python"
                else "xla" if name.startswith(("tf_", "llvm")) else "grpc core"
                if name.startswith(("grpc", "event_engine", "lifeguard")) else "other")
        out[kind] = out.get(kind, 0.0) + ns / 1e9
    return out


def take_turns(config: str, turns: int, seconds: float, host_cpus: str) -> dict:
    """The plain loop and the attached learner on core 0, one held (SIGSTOP) while the other runs;
    their own threads on `host_cpus` ("1", beside the syncer) or, where empty, on core 0 too."""
    env = dict(device_env(config), DILOCO_TOKEN=secrets.token_hex(16), PYTHONUNBUFFERED="1")
    plain = subprocess.Popen([sys.executable, "-P", "-c", PLAIN, config, host_cpus], env=env, stdout=subprocess.PIPE,
                             text=True)
    procs = [plain]
    try:
        plain_lines = Lines(plain)
        info = plain_lines.wait_for(lambda e: "matmul_flops" in e, 300, "plain loop")
        port = free_port()
        procs.append(subprocess.Popen(["taskset", "-c", "1", sys.executable, "-P", "-m", "diloco.apps.cli", "syncer",
                                       "--config", config, "--port", str(port)],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        learner = subprocess.Popen([sys.executable, "-P", "-m", "diloco.apps.cli", "learner", "--config", config, "--group",
                                    "local", "--index", "0", "--syncer", f"127.0.0.1:{port}", "--cpus", "0"]
                                   + (["--host-cpus", host_cpus] if host_cpus else []),
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        procs.append(learner)
        learner_lines = Lines(learner)
        learner_lines.wait_for(lambda e: e.get("event") == "joined", 300, "learner")
        time.sleep(3.0)  # its first adoptions and pushes
        settle = 0.5  # after a resume: the held process catches up with what queued (publishes, a step)
        rates: dict[str, list[float]] = {"plain": [], "learner": []}
        totals = {"plain": [0, 0.0, 0.0], "learner": [0, 0.0, 0.0]}
        cpu: dict[str, dict[str, float]] = {"plain": {}, "learner": {}}
        cpu_steps = {"plain": 0.0, "learner": 0.0}  # steps in the CPU windows, at each turn's rate
        order = [("learner", learner, learner_lines, plain), ("plain", plain, plain_lines, learner)]
        os.kill(learner.pid, signal.SIGSTOP)
        for turn in range(turns):
            for name, proc, lines, other in order:
                os.kill(other.pid, signal.SIGSTOP)
                os.kill(proc.pid, signal.SIGCONT)
                start = time.time()
                time.sleep(settle)
                before, t_before = thread_cpu(proc.pid), time.time()
                time.sleep(seconds - settle)
                after, t_after = thread_cpu(proc.pid), time.time()
                steps, took, waited = lines.rate(start + settle, time.time())
                os.kill(proc.pid, signal.SIGSTOP)
                if took > 0:
                    cpu_steps[name] += steps / took * (t_after - t_before)
                    for kind, t in after.items():
                        cpu[name][kind] = cpu[name].get(kind, 0.0) + t - before.get(kind, 0.0)
                    rates[name].append(steps / took)
                    totals[name][0] += steps
                    totals[name][1] += took
                    totals[name][2] += waited
            print(f"turn {turn + 1}: plain {rates['plain'][-1]:.2f} steps/s, "
                  f"learner on live syncer {rates['learner'][-1]:.2f} steps/s", flush=True)
        with learner_lines.lock:
            last = next((e for e in reversed(learner_lines.events) if e.get("event") == "progress"), {})
        return {"info": info, "rates": rates, "last": last,
                **{name: steps / took for name, (steps, took, _) in totals.items()},
                "host_wait_ms": {name: 1e3 * waited / max(steps, 1) for name, (steps, _, waited) in totals.items()},
                "cpu_ms": {name: {kind: round(1e3 * t / max(cpu_steps[name], 1.0), 3) for kind, t in sorted(cpu[name].items())}
                           for name in cpu}}
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
        for proc in procs:
            proc.wait(30)


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


LAYOUTS = {  # name: the learner's --host-cpus (the plain loop's likewise)
    "host_core": "1",  # core 0 is the device, core 1 the host: XLA alone on the device, as on an accelerator
    "one_core": "",  # everything on core 0: the host's work takes the device's cycles, as no accelerator's does
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "examples" / "quickstart.yaml"))
    parser.add_argument("--turns", type=int, default=10, help="turns each, per layout (default 10)")
    parser.add_argument("--turn-seconds", type=float, default=4.0,
                        help="seconds per turn (default 4: under the syncer's 5 s keepalive timeout)")
    args = parser.parse_args()
    runs = {}
    for layout, host_cpus in LAYOUTS.items():
        print(f"layout {layout}: the learner's own threads on core {host_cpus or 0}, XLA's on core 0", flush=True)
        runs[layout] = res = take_turns(args.config, args.turns, args.turn_seconds, host_cpus)
        wait = res["host_wait_ms"]
        print(f"{layout}: learner/plain = {res['learner'] / res['plain']:.3f} (target >= 0.97); the devices wait on "
              f"the host {wait['learner']:.2f} ms a step in the learner, {wait['plain']:.2f} ms in the plain loop")
        for name, kinds in res["cpu_ms"].items():
            print(f"  CPU per step, {name}: " + ", ".join(f"{kind} {ms:.2f} ms" for kind, ms in kinds.items()))
    res = runs["host_core"]
    info = res["info"]
    kind, devices = info["device_kind"], info["devices"]
    peak = PEAK_FLOPS.get(kind, 0.0) * devices
    peak_source = f"{kind}: {PEAK_FLOPS[kind]:.3g} FLOP/s per device (vendor, dense bf16)" if peak else (
        f"{kind}: no table entry; XLA's fp32 1024^3 matmul on the same core, {info['matmul_flops']:.3g} FLOP/s")
    peak = peak or info["matmul_flops"]
    achieved = flops_per_step(args.config) * res["learner"]
    last = res["last"]
    print(f"mfu {achieved / peak:.3f} ({peak_source}); bytes sent {last.get('bytes_sent')}, "
          f"received {last.get('bytes_received')}")
    print(json.dumps({"ratio": res["learner"] / res["plain"],
                      "ratio_one_core": runs["one_core"]["learner"] / runs["one_core"]["plain"],
                      "mfu": achieved / peak, "model_flops_per_s": achieved, "peak_flops": peak,
                      "peak_source": peak_source, "devices": devices, "turns": args.turns,
                      "turn_seconds": args.turn_seconds, "config": os.path.relpath(args.config, ROOT),
                      **{layout: {"plain_steps_per_s": r["rates"]["plain"], "learner_steps_per_s": r["rates"]["learner"],
                                  "host_wait_ms_per_step": r["host_wait_ms"], "cpu_ms_per_step": r["cpu_ms"]}
                         for layout, r in runs.items()}}))


if __name__ == "__main__":
    main()
