"""`diloco learner`: one Decoupled DiLoCo learner (SPEC §2, the learner loop).

Read top to bottom: join and pull the global model; then forever: adopt any global
fragments that arrived, take one AdamW step on our own shard, and hand the outer
gradient of the one fragment that is due to the background sender. Events go to
stdout as JSON lines (the local runner and the operator's logs read them).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

log = logging.getLogger("diloco.learner")


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"t": time.time(), "event": event, **fields}), flush=True)


def run(args: argparse.Namespace) -> int:
    from diloco.launch import load_config, pin_cpus, read_pem, read_token

    t_process = time.monotonic()
    pin_cpus(args.cpus)  # before JAX starts its thread pools
    job = load_config(args.config)
    token = read_token(args)
    tls_ca = read_pem(args.tls_ca, "--tls-ca")
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from diloco.core.codecs import encode_tensors
    from diloco.core.fragments import due_fragment, plan_fragments, specs_from_shapes
    from diloco.trainer import data, model
    from diloco.trainer.client import Outgoing, SyncerClient, Unauthenticated
    from diloco.trainer.metrics import LearnerMetrics

    spec = job.spec
    group = next((g for g in spec.learner_groups if g.name == args.group), None)
    if group is None or args.index < 0:
        print(f"--group {args.group!r} --index {args.index}: no such learner in spec.learnerGroups", file=sys.stderr)
        return 2
    learner_id = f"{group.name}-{args.index}"
    # Disjoint across groups and clusters: spec.data.shards and the groups' shardOffset.
    shard_index, shard_count = spec.shard_of(group.name, args.index)

    # Data: our own disjoint shard, and the shared held-out split.
    corpus = data.corpus_bytes()
    train, held_out = data.split(corpus, spec.data.held_out_fraction)
    shard = data.shard(train, shard_index % shard_count, shard_count)
    # A restart must not replay the same batches: the runner passes its restart count; in a
    # pod (no count available) fresh entropy does the job.
    restart_entropy = args.restart if args.restart is not None else int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng([spec.data.seed, shard_index, restart_entropy])
    window = spec.model.context + 1
    evals = [jnp.asarray(b) for b in data.eval_batches(held_out, spec.training.eval_batches, spec.training.batch_size, window)]

    # Model and inner optimizer: AdamW, linear warmup then cosine decay.
    cfg, tr = spec.model, spec.training
    params = model.init_params(cfg, spec.data.seed)
    shapes = model.shapes(params)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, tr.learning_rate, tr.warmup_steps, tr.decay_steps, tr.learning_rate * tr.min_lr_ratio)
    tx = optax.chain(optax.clip_by_global_norm(tr.grad_clip), optax.adamw(schedule, weight_decay=tr.weight_decay))

    @jax.jit
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: model.loss_fn(cfg, p, batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    batch_loss = jax.jit(lambda params, b: model.loss_fn(cfg, params, b))

    def eval_loss(params) -> float:  # one compiled forward pass, reused for every batch
        return float(np.mean([float(batch_loss(params, b)) for b in evals]))

    # Compile before joining, so the state we pull is fresh when training starts.
    opt_state = tx.init(params)
    jax.block_until_ready(train_step(params, opt_state, data.sample_batch(shard, tr.batch_size, window, rng)))
    eval_loss(params)

    # Join: pull the whole current global model with its versions (re-admission on restart).
    metrics = LearnerMetrics(learner_id, group.region, args.metrics_port)
    client = SyncerClient(args.syncer, token, learner_id, group.region, on_event=emit,
                          tls_ca=tls_ca, tls_server_name=args.tls_server_name)
    t_join = time.monotonic()
    try:
        joined = client.join_with_retry(shapes)
    except Unauthenticated as exc:
        emit("fatal", reason=f"syncer refused the token: {exc}")
        return 3
    plan = plan_fragments(specs_from_shapes(shapes), spec.syncer.fragments, spec.syncer.fragmentation)
    if [list(f) for f in plan.fragments] != joined.fragments:
        emit("fatal", reason="fragment plan differs from the syncer's; learner and syncer run different specs")
        return 2
    P = plan.num_fragments

    def adopt(state) -> dict[str, np.ndarray]:
        nonlocal params, versions, incarnation
        params = {n: jnp.asarray(v) for n, v in state.params.items()}
        versions, incarnation = list(state.versions), state.incarnation
        return {n: np.array(v) for n, v in state.params.items()}

    versions: list[int] = []
    incarnation = ""
    anchors = adopt(joined)
    opt_state = tx.init(params)
    steps_since = [0] * P
    tokens_since = [0] * P
    tokens_per_step = tr.batch_size * spec.model.context
    pull_seconds = time.monotonic() - t_join
    metrics.badput("startup", t_join - t_process)
    metrics.badput("state_pull", pull_seconds)
    first_eval = eval_loss(params)  # the global model as pulled: a late joiner starts from it
    emit("joined", learner=learner_id, region=group.region, restart=args.restart or 0, versions=versions,
         eval_loss=first_eval, startup_seconds=round(t_join - t_process, 3),
         pull_seconds=round(pull_seconds, 3), incarnation=incarnation)
    client.start()

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    step, train_seconds, step_ema, loss_value = 0, 0.0, 0.0, float("nan")
    last_report = time.monotonic()
    while not stop.is_set() and not client.stopping.is_set():
        # 1. Adopt what the syncer published: θ_p ← α·θ_p + (1−α)·Θ_p, A_p ← Θ_p, counters reset.
        rejoined, updates = client.take_updates()
        if rejoined is not None:
            anchors = adopt(rejoined)
            steps_since, tokens_since = [0] * P, [0] * P
            emit("readopted", incarnation=incarnation, versions=versions)
        for p, (version, tensors) in updates.items():
            alpha = spec.syncer.blend
            for n, v in tensors.items():
                params[n] = jnp.asarray(v if alpha == 0 else alpha * np.asarray(params[n]) + (1 - alpha) * v)
                anchors[n] = v
            versions[p], steps_since[p], tokens_since[p] = version, 0, 0

        # 2. One inner step on our shard (stretched by the group's slowdown factor).
        t0 = time.monotonic()
        batch = data.sample_batch(shard, tr.batch_size, window, rng)
        params, opt_state, loss = train_step(params, opt_state, batch)
        loss_value = float(loss)
        compute = time.monotonic() - t0
        if group.slowdown > 1:
            time.sleep(compute * (group.slowdown - 1))
        dt = time.monotonic() - t0
        train_seconds += dt
        step_ema = dt if step == 0 else 0.9 * step_ema + 0.1 * dt
        steps_since = [s + 1 for s in steps_since]
        tokens_since = [k + tokens_per_step for k in tokens_since]
        metrics.step(dt, tokens_per_step, loss_value)

        # A diverged learner pushes nothing and starts over from the global model; so does one
        # whose outer gradient the syncer refused as malformed or non-finite.
        if not np.isfinite(loss_value) or client.resync.is_set():
            emit("diverged" if not np.isfinite(loss_value) else "resynced", step=step)
            client.resync.clear()
            params = {n: jnp.asarray(v) for n, v in anchors.items()}
            opt_state = tx.init(params)
            steps_since, tokens_since = [0] * P, [0] * P
            step += 1
            continue

        # 3. The due fragment's outer gradient Δ = A_p − θ_p, compressed, to the sender.
        p = due_fragment(step, P)
        delta = {n: anchors[n] - np.asarray(params[n]) for n in plan.fragments[p]}
        if step == args.inject_nan_at_step:  # fault injection: a learner whose state went bad
            params = {n: v * jnp.nan if n in delta else v for n, v in params.items()}
            delta = {n: d * np.nan for n, d in delta.items()}
        blob = encode_tensors(delta, spec.syncer.compression, spec.syncer.block_size)
        client.submit(Outgoing(p, versions[p], steps_since[p], tokens_since[p], step_ema, loss_value,
                               blob, train_seconds, incarnation))
        step += 1

        if step % tr.eval_interval_steps == 0:
            ev = eval_loss(params)
            metrics.eval_loss.set(ev)
            emit("eval", step=step, eval_loss=ev, versions=list(versions))
        if time.monotonic() - last_report >= 1.0:
            last_report = time.monotonic()
            metrics.network(client.bytes_sent, client.bytes_received)
            metrics.productive(client.acked_train_seconds)
            emit("progress", step=step, loss=loss_value, step_seconds=step_ema, train_seconds=train_seconds,
                 acked_train_seconds=client.acked_train_seconds, bytes_sent=client.bytes_sent,
                 bytes_received=client.bytes_received, versions=list(versions))
        if args.max_steps and step >= args.max_steps:
            break

    # SIGTERM: finish the in-flight push and exit cleanly.
    flushed = client.flush(timeout=10.0)
    emit("exit", step=step, train_seconds=train_seconds, acked_train_seconds=client.acked_train_seconds,
         bytes_sent=client.bytes_sent, bytes_received=client.bytes_received, flushed=flushed,
         reason="fatal" if client.stopping.is_set() and not stop.is_set() else "stopped")
    client.close()
    return 0 if not client.stopping.is_set() or stop.is_set() else 3
