"""Across a real throttled WAN: Decoupled DiLoCo against data-parallel and synchronous DiLoCo.

    sudo python bench/wan.py [--rates 50,10,2] [--seconds 25] [--budget 60]

Two regions, one learner each, reach a "home" namespace over veth links shaped with tbf
(apps/testkit/wan.py). Same model, same link, three ways to train:

- decoupled: the real `diloco syncer` (home) and `diloco learner`s, int4 both ways, P = 16;
- dp: the data-parallel equivalent: every step each learner sends its bf16 gradients to a
  reducer at home and waits for the bf16 average (a parameter-server all-reduce), then AdamW;
- sync: synchronous DiLoCo: every H inner steps each learner sends its bf16 outer gradient
  and waits for the average, then a Nesterov outer step.

For each, tokens/s at each link rate as a fraction of its own unthrottled speed (unshaped
veth), then held-out loss after the same wall-clock budget at the lowest rate. Last line JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from diloco.launch import learner_runtime

ROOT = Path(__file__).resolve().parents[1]
PORT, REDUCER_PORT = 50200, 50201
MODEL = {"layers": 2, "dModel": 64, "heads": 4, "context": 64}
SYNC_H = 20  # synchronous DiLoCo: inner steps between full syncs


def manifest(name: str) -> dict:
    return {
        "apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": name},
        "spec": {
            "learnerGroups": [{"name": "us", "region": "us", "replicas": 1}, {"name": "eu", "region": "eu", "replicas": 1}],
            "syncer": {"fragments": 16, "compression": "int4", "broadcastCompression": "int4",
                       "checkpointIntervalSeconds": 1000},
            "model": MODEL,
            "training": {"batchSize": 8, "warmupSteps": 20, "decaySteps": 3000, "evalIntervalSteps": 100000},
        },
    }


# -- the baselines' network: a reducer that averages one message from each learner per round --

def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(min(1 << 20, n - len(buf)))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return bytes(buf)


def reducer(learners: int) -> None:
    import numpy as np

    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", REDUCER_PORT))
    srv.listen()
    conns = [srv.accept()[0] for _ in range(learners)]
    while True:
        msgs = []
        for c in conns:
            (n,) = struct.unpack("<Q", _recv_exact(c, 8))
            msgs.append(np.frombuffer(_recv_exact(c, n), dtype=np.uint16))
        mean = np.mean([(m.astype(np.uint32) << 16).view(np.float32) for m in msgs], axis=0)
        out = (mean.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()  # bf16 (truncated)
        for c in conns:
            c.sendall(struct.pack("<Q", len(out)) + out)


def worker(mode: str, config: str, address: str, index: int, out: str) -> None:
    """A dp or sync learner: real JAX training, exchanging through the reducer."""
    os.sched_setaffinity(0, {index % 2})
    learner_runtime()  # as the learner does
    import jax.numpy as jnp
    import numpy as np

    from diloco.core.outer import NesterovSGD
    from diloco.spec import load_job
    from diloco.trainer import data, model
    from diloco.trainer.recipe import Recipe

    spec = load_job(config).spec
    cfg, tr = spec.model, spec.training
    train, _ = data.split(data.corpus_bytes(), spec.data.held_out_fraction)
    shard = data.shard(train, index, 2)
    rng = np.random.default_rng(index)
    params = model.init_params(cfg, 0)
    names = sorted(params)
    recipe = Recipe(cfg, tr)  # the learner's own AdamW, schedule and clipping
    opt = recipe.init_state(params)
    host, port = address.split(":")
    conn = socket.create_connection((host, int(port)))

    def allreduce(tensors: dict) -> dict:
        flat = np.concatenate([np.asarray(tensors[n], np.float32).reshape(-1) for n in names])
        payload = (flat.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        conn.sendall(struct.pack("<Q", len(payload)) + payload)
        (n,) = struct.unpack("<Q", _recv_exact(conn, 8))
        mean = (np.frombuffer(_recv_exact(conn, n), np.uint16).astype(np.uint32) << 16).view(np.float32)
        result, pos = {}, 0
        for name in names:
            size = int(np.prod(params[name].shape))
            result[name] = jnp.asarray(mean[pos : pos + size].reshape(params[name].shape))
            pos += size
        return result

    outer = NesterovSGD(0.7, 0.9)  # DiLoCo's outer optimizer at H = 20 inner steps
    anchor = {n: np.asarray(v) for n, v in params.items()}
    step = 0
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        while True:
            batch = data.sample_batch(shard, tr.batch_size, cfg.context + 1, rng)
            loss, grads = recipe.grads(params, batch)
            if mode == "dp":
                grads = allreduce(grads)
            params, opt = recipe.update(params, opt, grads, step)
            step += 1
            if mode == "sync" and step % SYNC_H == 0:
                delta = allreduce({n: anchor[n] - np.asarray(params[n]) for n in names})
                new = outer.step(anchor, {n: np.asarray(d) for n, d in delta.items()})
                anchor = new
                params = {n: jnp.asarray(v) for n, v in new.items()}
            if step % 10 == 0:
                print(json.dumps({"t": time.time(), "step": step, "loss": float(loss)}), flush=True)
    except (KeyboardInterrupt, ConnectionError):
        pass
    if index == 0 and out:
        final = anchor if mode == "sync" else {n: np.asarray(v) for n, v in params.items()}
        np.savez(out, **{n.replace("/", "|"): v for n, v in final.items()})


# -- running an arm over the lab --------------------------------------------------------------

def run_arm(net, mode: str, config: Path, seconds: float, workdir: Path) -> tuple[float, Path | None]:
    """Tokens/s over `seconds` after warm-up; returns it and where the final weights went."""
    env = dict(os.environ, DILOCO_TOKEN=secrets.token_hex(16), PYTHONUNBUFFERED="1")
    cli = [sys.executable, "-P", "-m", "diloco.apps.cli"]
    me = [sys.executable, str(Path(__file__).resolve())]
    procs, readers = [], []
    weights = workdir / f"{mode}-final.npz"
    ckpt = workdir / f"ckpt-{mode}-{time.time_ns()}"
    try:
        if mode == "decoupled":
            procs.append(subprocess.Popen(net.argv("home", cli + ["syncer", "--config", str(config), "--port", str(PORT),
                                          "--checkpoint-dir", str(ckpt)]), env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True))
        else:
            procs.append(subprocess.Popen(net.argv("home", me + ["reducer"]), env=env, start_new_session=True))
        time.sleep(1.0)
        for i, (group, region) in enumerate((("us", "us"), ("eu", "eu"))):
            if mode == "decoupled":
                argv = cli + ["learner", "--config", str(config), "--group", group, "--index", "0",
                              "--syncer", f"{net.links[region].home_ip}:{PORT}", "--cpus", str(i)]
            else:
                argv = me + ["worker", mode, str(config), f"{net.links[region].home_ip}:{REDUCER_PORT}", str(i),
                             str(weights) if i == 0 else ""]
            p = subprocess.Popen(net.argv(region, argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 text=True, start_new_session=True)
            procs.append(p)
            readers.append(p)
        samples: list[list[tuple[float, int]]] = [[] for _ in readers]

        def read(k: int, p: subprocess.Popen) -> None:
            for line in p.stdout:
                e = json.loads(line)
                if "step" in e:
                    samples[k].append((e["t"], e["step"]))

        for k, p in enumerate(readers):
            threading.Thread(target=read, args=(k, p), daemon=True).start()
        start = None
        while True:
            if all(samples) and start is None:
                start = time.time() + 3.0  # warm-up after both learners step
            if start is not None and time.time() >= start + seconds:
                break
            time.sleep(0.2)
    finally:
        for p in procs[::-1]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
    tokens_per_step = 8 * MODEL["context"]
    rate = 0.0
    for s in samples:
        window = [x for x in s if start <= x[0] <= start + seconds]
        if len(window) >= 2:
            rate += (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0]) * tokens_per_step
    final = weights if mode != "decoupled" else ckpt
    return rate, final


def eval_loss(config: Path, final: Path) -> float:
    import numpy as np

    from diloco.apps.local.report import evaluate
    from diloco.checkpoint import CheckpointStore, params_of
    from diloco.spec import load_job

    job = load_job(str(config))
    if final.suffix == ".npz":
        params = {k.replace("|", "/"): v for k, v in np.load(final).items()}
    else:
        loaded, _ = CheckpointStore(final).load_latest()
        params = params_of(loaded.arrays)
    return evaluate(job, params)


def plot(rates: list[float], fractions: dict[str, dict[str, float]], losses: dict[str, float], budget: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 3.6))
    for mode, fr in fractions.items():
        ax.plot(rates, [fr[f"{r:g}"] for r in rates], marker="o", label=mode)
    ax.set_xscale("log")
    ax.set_xlabel("link rate per region (Mbit/s)")
    ax.set_ylabel("tokens/s, fraction of unthrottled")
    ax.set_ylim(0, 1.1)
    ax.legend()
    bx.bar(list(losses), list(losses.values()), color=["tab:blue", "tab:orange", "tab:green"][: len(losses)])
    bx.set_ylabel(f"held-out loss after {budget:g} s")
    bx.set_title(f"at {rates[-1]:g} Mbit/s")
    fig.tight_layout()
    out = ROOT / "docs" / "img" / "bench_wan.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rates", default="50,10,2", help="link rates in Mbit/s")
    parser.add_argument("--seconds", type=float, default=20.0, help="measurement window per arm and rate")
    parser.add_argument("--budget", type=float, default=60.0, help="wall-clock budget for the loss comparison")
    parser.add_argument("--modes", default="decoupled,dp,sync")
    args = parser.parse_args()
    from diloco.apps.testkit import wan

    reason = wan.available()
    if reason:
        raise SystemExit(f"bench/wan.py: {reason}")
    rates = [float(r) for r in args.rates.split(",")]
    modes = args.modes.split(",")
    work = Path(tempfile.mkdtemp(prefix="diloco-wan-"))
    config = work / "job.yaml"
    config.write_text(yaml.safe_dump(manifest("wan")))
    speeds: dict[str, dict[str, float]] = {m: {} for m in modes}
    with wan.Wan(["us", "eu"], mbit=None) as net:
        for mode in modes:
            speeds[mode]["unthrottled"], _ = run_arm(net, mode, config, args.seconds, work)
            print(f"{mode:10} unthrottled {speeds[mode]['unthrottled']:9.0f} tokens/s", flush=True)
        for rate in rates:
            for region in ("us", "eu"):
                net.set_rate(region, rate)
            for mode in modes:
                speeds[mode][f"{rate:g}"], _ = run_arm(net, mode, config, args.seconds, work)
                frac = speeds[mode][f"{rate:g}"] / speeds[mode]["unthrottled"]
                print(f"{mode:10} {rate:6g} Mbit/s {speeds[mode][f'{rate:g}']:9.0f} tokens/s = {frac:6.1%} of unthrottled", flush=True)
        losses = {}
        for mode in modes:  # held-out loss after the same wall-clock budget at the lowest rate
            _, final = run_arm(net, mode, config, args.budget, work)
            losses[mode] = eval_loss(config, final)
            print(f"{mode:10} held-out loss after {args.budget:g} s at {rates[-1]:g} Mbit/s: {losses[mode]:.3f}", flush=True)
    fractions = {m: {r: v / speeds[m]["unthrottled"] for r, v in speeds[m].items() if r != "unthrottled"} for m in modes}
    plot(rates, fractions, losses, args.budget)
    print(json.dumps({"rates_mbit": rates, "tokens_per_s": speeds, "fraction_of_unthrottled": fractions,
                      "loss_after_budget": losses, "budget_s": args.budget, "model": MODEL, "sync_h": SYNC_H}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "reducer":
        reducer(2)
    elif len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6])
    else:
        main()
