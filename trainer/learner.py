"""`diloco learner`: one Decoupled DiLoCo learner (docs/ALGORITHM.md, "The learner loop").

Read top to bottom: join and pull the global model; then until the end: adopt (rebase
onto) any global fragments that arrived, take one AdamW step on our own shard, and hand
the outer gradient of the fragment the shared schedule says is due to the background
sender; at the end, flush every fragment's unmerged progress. Events go to
stdout as JSON lines (the local runner and the operator's logs read them).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from typing import Any

log = logging.getLogger("diloco.learner")
FLUSH_SECONDS = 10.0  # at the end, time to get the last pushes accepted (one round trip each)


_EMITTING = threading.Lock()
_SPEAKS = [True]  # host 0 speaks for a multi-host learner (trainer/hosts.py); the others are silent


def emit(event: str, **fields: Any) -> None:  # one JSON object per line: contract.Event
    """Whole lines only: the loop and the client's threads all emit, and print() writes the
    object and its newline separately, so two threads could run their lines together."""
    if not _SPEAKS[0]:
        return
    line = json.dumps({"t": time.time(), "event": event, **fields}) + "\n"
    with _EMITTING:
        sys.stdout.write(line)
        sys.stdout.flush()


def _warm_codecs(syncer: Any) -> None:
    from diloco.core import kernels
    kernels.warm_codecs((syncer.compression, syncer.broadcast_compression), syncer.block_size)


def run(args: argparse.Namespace) -> int:
    from diloco.contract import Event, Exit, LearnerId
    from diloco.launch import learner_runtime, load_config, pin_cpus, read_pem, read_token
    from diloco.trainer.runtime import split_host_threads

    t_process = time.monotonic()
    pin_cpus(args.cpus)  # before JAX starts its thread pools
    learner_runtime()  # before XLA's first buffers and computation (diloco/launch.py)
    job = load_config(args.config, pretrained=True)
    token = read_token(args)
    tls_ca = read_pem(args.tls_ca, "--tls-ca")
    # Load the codec kernels while JAX starts, not at the first push and adoption after the
    # join: there a re-admitted learner is a second late and its first pushes arrive stale.
    # In the background, so a cold cache (compiling takes seconds) never delays the join.
    threading.Thread(target=_warm_codecs, args=(job.spec.syncer,), name="warm-kernels", daemon=True).start()
    import jax
    import numpy as np

    from diloco.core.fragments import plan_fragments, specs_from_shapes
    from diloco.core.ledger import Ledger, absorb, prepare_push
    from diloco.core.schedule import JobProgress, Schedule
    from diloco.core.seed import InitialModel
    from diloco.shards import syncer_addresses
    from diloco.trainer import data, model, sharding
    from diloco.trainer.client import JoinRefused, Outgoing, SyncerClient, Unauthenticated, Updates
    from diloco.trainer.hosts import Hosts, MirroredClient
    from diloco.trainer.metrics import LearnerMetrics
    from diloco.trainer.peer_state import PeerStates
    from diloco.trainer.recipe import Recipe, scalar
    from diloco.trainer.sharded_client import ShardedClient
    from diloco.trainer.theta0 import initial_params

    spec = job.spec
    group = next((g for g in spec.learner_groups if g.name == args.group), None)
    if group is None or args.index < 0:
        print(f"--group {args.group!r} --index {args.index}: no such learner in spec.learnerGroups", file=sys.stderr)
        return Exit.CONFIG
    learner_id = str(LearnerId(group.name, args.index))
    try:  # a learner of several hosts: join the others first, before JAX does anything else
        hosts = Hosts.start(args, group.hosts_per_learner)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return Exit.CONFIG
    _SPEAKS[0] = hosts.leader
    split_host_threads(args.host_cpus)  # after jax.distributed, before gRPC's and our threads start
    # Disjoint across groups and clusters: spec.data.shards and the groups' shardOffset.
    shard_index, shard_count = spec.shard_of(group.name, args.index)

    # Data (spec.data.source): our own disjoint shard, and the shared held-out split. Batch k is
    # a pure function of (seed, shard, k): a restarted learner resumes at the batch after the
    # last one the syncer merged (the Join says how many tokens that is), on every host alike.
    window = spec.model.context + 1
    try:
        # Only our shard is read (and, for text, tokenized): data.load.
        corpus = data.load(spec.data, spec.model.vocab_size, window, shard=(shard_index % shard_count, shard_count))
        batches = data.Batches(corpus.train, spec.training.batch_size, window, spec.data.seed, shard_index)
        evals = data.eval_batches(corpus.held_out, spec.training.eval_batches, spec.training.batch_size, window,
                                  spec.model.vocab_size)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return Exit.CONFIG

    # Model and inner step (trainer/recipe.py): AdamW, its learning rate taken from the shared
    # schedule's slot, so a (re)joining learner resumes the job's schedule; one SPMD program
    # over every device this learner has (spec.training.mesh; trainer/sharding.py).
    cfg, tr = spec.model, spec.training
    # Θ₀, as every learner has it; a restart reads it from beside the compilation cache (trainer/theta0.py).
    try:
        theta0 = initial_params(cfg, spec.data.seed, getattr(jax.config, "jax_compilation_cache_dir", None))
    except ValueError as exc:  # pretrained weights that do not fit their config (diloco/hf.py)
        print(exc, file=sys.stderr)
        return Exit.CONFIG
    shapes = model.shapes(theta0)  # not parameter_shapes: tracing the model again costs a restart 0.2 s of CPU
    try:
        layout = sharding.layout(tr.mesh, shapes, tr.batch_size)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return Exit.CONFIG
    # The fragment plan: P x shards fragments (core/schedule.py), derived as the syncer derives it.
    try:
        plan = plan_fragments(specs_from_shapes(shapes), spec.syncer.plan_size, spec.syncer.fragmentation)
    except ValueError as exc:
        emit(Event.FATAL, reason=f"spec.syncer.fragments {spec.syncer.fragments} x shards {spec.syncer.shards} "
                                 f"fragments do not fit this model: {exc}")
        return Exit.CONFIG

    recipe = Recipe(cfg, tr, layout, shapes, getattr(jax.config, "jax_compilation_cache_dir", None))

    # Compile before joining, so the state we pull is fresh when training starts.
    params = recipe.place(theta0)
    jax.block_until_ready(recipe.step(params, recipe.init_state(params), batches.batch(0), 0))
    recipe.eval_loss(params, evals[:1])

    # Join: pull the whole current global model with its versions (re-admission on restart).
    metrics = LearnerMetrics(learner_id, group.region, args.metrics_port)
    # A pod (no restart count) or a restarted process takes its id over from a predecessor the
    # syncer may still think alive; only the very first local process need not.
    def connect(address: str) -> SyncerClient:
        return SyncerClient(address, token, learner_id, group.region, on_event=emit, tls_ca=tls_ca,
                            tls_server_name=args.tls_server_name, supersede=args.restart is None or args.restart > 0)

    try:
        addresses = syncer_addresses(args.syncer)  # one per shard of spec.syncer.shards
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return Exit.CONFIG
    if len(addresses) != spec.syncer.shards:
        print(f"--syncer: {len(addresses)} addresses for spec.syncer.shards {spec.syncer.shards}; "
              "list every shard's host:port, in shard order", file=sys.stderr)
        return Exit.CONFIG
    real = (connect(addresses[0]) if len(addresses) == 1 else ShardedClient(addresses, connect)) if hosts.leader else None
    stop = threading.Event()  # SIGTERM; a multi-host learner acts on host 0's (client.stop_requested)
    client = MirroredClient(hosts, real, stop, plan.fragments, shapes)  # the plan lays out what host 0 shares
    t_join = time.monotonic()
    try:  # an unseeded syncer (no checkpoint yet) gets Θ₀ from the first learner: it runs no model code
        joined = client.join_with_retry(shapes, InitialModel(theta0, plan.fragments))
    except Unauthenticated as exc:
        emit(Event.FATAL, reason=f"syncer refused the token: {exc}")
        return Exit.REFUSED
    except JoinRefused as exc:
        emit(Event.FATAL, reason=str(exc))
        return Exit.CONFIG
    if [list(f) for f in plan.fragments] != joined.fragments:
        emit(Event.FATAL, reason="fragment plan differs from the syncer's; learner and syncer run different specs")
        return Exit.CONFIG
    P = plan.num_fragments  # P x shards: one fragment per shard is due in each slot
    codec, block_size = joined.codec, joined.block_size  # the syncer decides the wire format

    params = recipe.place(joined.params)
    ledger = Ledger(plan.fragments, joined.params, joined.versions, spec.syncer.adoption)
    schedule = Schedule(P, joined.slot, per_slot=spec.syncer.shards)
    incarnation = joined.incarnation
    opt_state = recipe.init_state(params)
    tokens_per_step = tr.batch_size * spec.model.context
    next_batch = joined.resume_tokens // tokens_per_step  # 0 on a first start
    # The learning rate follows the job's tokens, not slots (core/schedule.py, JobProgress): a
    # (re)joiner resumes the decay where the job is, and no learner decays faster than the job trains.
    job_progress = JobProgress(spec.shard_count, tokens_per_step)
    job_progress.observe(joined.job_tokens)
    pull_seconds = time.monotonic() - t_join
    metrics.mark_joined()
    metrics.badput("startup", t_join - t_process)
    metrics.badput("state_pull", pull_seconds)
    first_eval = recipe.eval_loss(params, evals)  # the global model as pulled: a late joiner starts from it
    emit(Event.JOINED, learner=learner_id, region=group.region, restart=args.restart or 0, versions=ledger.versions,
         slot=schedule.slot, eval_loss=first_eval, startup_seconds=round(t_join - t_process, 3),
         startup_cpu_seconds=round(time.process_time(), 3),  # this process's CPU until now, all threads
         pull_seconds=round(pull_seconds, 3), incarnation=incarnation, batch=next_batch)
    client.start()
    # A mid-run (re)joiner asks for a peer's AdamW moments and trains on fresh ones until they
    # arrive (trainer/peer_state.py); every one-host learner shares its own when asked.
    peers = PeerStates(real if hosts.count == 1 and tr.peer_optimizer_state else None, emit)
    if joined.slot > 0:
        peers.start_fetch()

    # An adoption's rebase is a shift of θ_p (core/ledger.py) that needs no read of θ_p. It is
    # added right after the next step is dispatched, queued behind that step on the devices,
    # so adopting costs the devices no wait at all; the step it misses keeps its progress.
    shifts: list[dict[str, np.ndarray]] = []

    def shift(by: dict[str, np.ndarray]) -> None:
        shifts.append(by)

    def shifted() -> None:
        for by in shifts:
            params.update(recipe.shift(params, by))
        shifts.clear()

    def fragment(p: int) -> dict[str, Any]:  # θ_p as it is now, on the devices
        return {n: params[n] for n in plan.fragments[p]}

    def local(p: int) -> dict[str, np.ndarray]:
        shifted()
        return hosts.host_copy(fragment(p))

    def apply(u: Updates) -> None:
        """Adopt at a step boundary what the syncer sent: a re-join, answers, fragments."""
        nonlocal incarnation
        if u.rejoined is not None:  # the syncer (shard) restarted: rebase its fragments onto its state
            anchors = ledger.anchors()
            shift({n: u.rejoined.params[n] - anchors[n] for n in u.rejoined.params})
            ledger.restart(u.rejoined.params, u.rejoined.versions, u.rejoined.owned)
            schedule.observe(u.rejoined.slot)
            job_progress.observe(u.rejoined.job_tokens)
            incarnation = u.rejoined.incarnation
            emit(Event.READOPTED, incarnation=incarnation, versions=ledger.versions)
        absorb(ledger, schedule, local, shift, u.refused, u.accepted, u.published)
        for arrival in u.published.values():
            job_progress.observe(arrival.job_tokens)

    push_seq = 0
    trained_tokens = 0

    def push(p: int, slot: int, theta: dict[str, Any]) -> None:
        """Hand fragment p's unpushed progress (θ_p as the step that filled `slot` left it, still
        on the devices) to the sender, recorded as the syncer will decode it."""
        nonlocal push_seq
        push_seq += 1
        blob, f = prepare_push(ledger, p, hosts.host_copy(theta), push_seq, codec, block_size)
        client.submit(Outgoing(p, ledger.books[p].version, f.steps, f.tokens, step_ema, loss_value, blob,
                               train_seconds, incarnation, push_seq, slot, trained_tokens))

    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    step, train_seconds, step_ema, loss_value = 0, 0.0, 0.0, float("nan")
    # The due pushes of the last step, (fragment, slot, θ_p on the devices), one per syncer shard:
    # they are read and encoded right after the next step is dispatched, so on an accelerator
    # that host work overlaps the devices' step instead of leaving them idle between steps; so
    # is the adoption's arithmetic.
    pending: list[tuple[int, int, dict[str, Any]]] = []
    host_wait, step_done = 0.0, None  # the devices' wait on this loop between two steps (the gap)
    finished = False
    last_report = time.monotonic()
    while True:
        # 1. One inner step on our shard, dispatched first: what follows until its loss is read
        #    runs while the devices compute it.
        batch = batches.batch(next_batch)
        next_batch += 1
        t0 = time.monotonic()
        if step_done is not None:
            host_wait += t0 - step_done
        params, opt_state, loss = recipe.step(params, opt_state, batch, job_progress.position())
        job_progress.stepped()

        # 2. Adopt what the syncer published: θ_p += Θ_p − A_p − (progress Θ_p already holds),
        #    added behind the step; share our optimizer state if a re-joining peer waits for
        #    it, or take a peer's. Then the last step's due push: read and encoded now.
        updates = client.take_updates()
        kept = []
        for waiting in pending:
            fate = updates.before(waiting[0])  # rarely not "keep": its fragment's news just came
            if fate == "send":
                push(*waiting)  # the books take it before the news of its fragment
            elif fate == "keep":
                kept.append(waiting)
        apply(updates)
        shifted()
        opt_state = peers.at_boundary(opt_state, updates.share_state)
        for waiting in kept:
            push(*waiting)
        pending = []
        stopping = client.stop_requested or client.stopping.is_set()

        # 3. The step's loss (stretched by the group's slowdown factor).
        loss_value = scalar(loss)
        compute = time.monotonic() - t0
        if group.slowdown > 1:
            time.sleep(compute * (group.slowdown - 1))
        step_done = time.monotonic()
        dt = step_done - t0
        train_seconds += dt
        step_ema = dt if step == 0 else 0.9 * step_ema + 0.1 * dt
        ledger.stepped(tokens_per_step)
        trained_tokens += tokens_per_step
        metrics.step(dt, tokens_per_step, loss_value)

        # A diverged learner pushes nothing and starts over from the global model; so does one
        # whose outer gradient the syncer refused as malformed or non-finite.
        if not np.isfinite(loss_value) or client.resync.is_set():
            emit(Event.DIVERGED if not np.isfinite(loss_value) else Event.RESYNCED, step=step)
            client.clear_resync()
            params = recipe.place(ledger.anchors())
            opt_state = recipe.init_state(params)
            ledger.restart()
            ledger.reset_counters()
            schedule.take()
            step += 1
            continue
        if stopping:  # SIGTERM, or the syncer refused us for good: this step's progress is flushed below
            step += 1
            break

        # 4. Our slot in the shared schedule: the due fragments' outer gradients (one per syncer
        #    shard) go out after the next dispatch, each unless its previous push is still in
        #    flight (then its progress goes out with the next one).
        slot, due = schedule.take()
        poisoned = step == args.inject_nan_at_step  # fault injection: a learner whose state went bad
        if poisoned:
            bad = {n for p in due for n in plan.fragments[p]}
            params = {n: v * np.nan if n in bad else v for n, v in params.items()}
        pending = [(p, slot, fragment(p)) for p in due if poisoned or not ledger.busy(p)]  # poison always goes out
        step += 1

        if step % tr.eval_interval_steps == 0:
            ev = recipe.eval_loss(params, evals)
            step_done = time.monotonic()  # the devices were evaluating, not waiting
            metrics.eval_loss.set(ev)
            emit(Event.EVAL, step=step, slot=slot, eval_loss=ev, versions=ledger.versions)
        if time.monotonic() - last_report >= 1.0:
            last_report = time.monotonic()
            metrics.network(client.bytes_sent, client.bytes_received)
            metrics.productive(client.acked_train_seconds)
            metrics.host_wait(host_wait)
            emit(Event.PROGRESS, step=step, slot=schedule.slot, epoch=round(batches.epoch(next_batch), 4),
                 loss=loss_value, step_seconds=step_ema, host_wait_seconds=round(host_wait, 6),
                 learning_rate=float(recipe.lr(job_progress.at)),
                 lr_position=job_progress.at,  # the job's progress in steps of one learner (JobProgress)
                 train_seconds=train_seconds, trained_tokens=trained_tokens, skipped_slots=schedule.skipped,
                 acked_train_seconds=client.acked_train_seconds, bytes_sent=client.bytes_sent,
                 bytes_received=client.bytes_received, versions=ledger.versions)
        if (args.max_steps and step >= args.max_steps) or (tr.steps and schedule.slot >= tr.steps):
            finished = True
            break

    # The end (SIGTERM or the last step): push every fragment's unmerged progress, and wait
    # until the syncer has accepted all of it, so no trained step is lost at the end of a run.
    # A fragment is pushed once per global version it holds: one the syncer refused (too stale)
    # goes out again only after a newer version arrived, not in a loop of refusals.
    for waiting in pending:
        push(*waiting)
    shifted()
    flushed = False
    flushed_at: dict[int, int] = {}
    deadline = time.monotonic() + FLUSH_SECONDS
    while client.until(deadline):
        apply(client.take_updates())
        shifted()
        for p in range(P):
            if ledger.unpushed(p) and flushed_at.get(p) != ledger.books[p].version:
                flushed_at[p] = ledger.books[p].version
                push(p, schedule.next_slot_of(p), fragment(p))
        if not ledger.unacknowledged():
            flushed = client.flush(timeout=max(0.0, deadline - time.monotonic()))
            break
        client.wait_for_news(0.2)
    emit(Event.EXIT, step=step, slot=schedule.slot, train_seconds=train_seconds, trained_tokens=trained_tokens,
         acked_train_seconds=client.acked_train_seconds, bytes_sent=client.bytes_sent,
         bytes_received=client.bytes_received, flushed=flushed,
         reason="fatal" if client.stopping.is_set() and not client.stop_requested else ("finished" if finished else "stopped"))
    fatal = client.stopping.is_set() and not client.stop_requested  # the syncer refused us for good
    client.close()
    return Exit.REFUSED if fatal else Exit.OK
