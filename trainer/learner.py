"""`diloco learner`: one Decoupled DiLoCo learner (docs/ALGORITHM.md, "The learner loop").

Read `run` top to bottom: join and pull the global model; then until the end: adopt (rebase
onto) any global fragments that arrived, take one AdamW step on our own shard, and hand
the outer gradient of the fragment the shared schedule says is due to the background
sender; at the end, flush every fragment's unmerged progress. What each fragment holds
between the devices and the syncer is trainer/fragment_sync.py's `Fragments`. Events go to
stdout as JSON lines (the local runner and the operator's logs read them).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from diloco.contract import TERMINATION_LOG_ENV, Event, Exit, Finished, LearnerId
from diloco.trainer.startup import Timeline

if TYPE_CHECKING:  # the rest imports JAX or numpy: only after pin_cpus and learner_runtime (see _configure)
    import numpy as np

    from diloco.core.fragments import FragmentPlan
    from diloco.spec import JobSpec, LearnerGroup
    from diloco.trainer.data import Batches
    from diloco.trainer.fragment_sync import Fragments
    from diloco.trainer.hosts import Hosts, MirroredClient
    from diloco.trainer.link import SyncerLink
    from diloco.trainer.messages import JoinState, Updates
    from diloco.trainer.metrics import LearnerMetrics
    from diloco.trainer.peer_state import PeerStates
    from diloco.trainer.recipe import Recipe
    from diloco.wire import pb

log = logging.getLogger("diloco.learner")
T = TypeVar("T")
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


def _start_warming_codecs(syncer: Any) -> None:
    threading.Thread(target=_warm_codecs, args=(syncer,), name="warm-kernels", daemon=True).start()


def _kernels_cold() -> bool:
    """Whether numba will compile the codec kernels (seconds) rather than load them (0.6 s of
    CPU): an empty $NUMBA_CACHE_DIR, as the operator's cache volume is at a pod's first start.
    Without the variable numba caches beside the package (an image warms it at build time)."""
    folder = os.environ.get("NUMBA_CACHE_DIR")
    return folder is not None and folder != "" and not any(Path(folder).rglob("*.nbi"))


class EndsEarly(Exception):
    """This learner cannot train: its exit code, and why."""

    # fatal=False: most are the flags' or the spec's errors, which a person reads on stderr; the
    # syncer's refusals and a plan that does not fit are fatal events, which runner and operator read.
    def __init__(self, code: int, reason: str, *, fatal: bool = False) -> None:
        super().__init__(reason)
        self.code, self.reason, self.fatal = code, reason, fatal

    def report(self) -> int:
        if self.fatal:
            emit(Event.FATAL, reason=self.reason)
        else:
            print(self.reason, file=sys.stderr)
        return self.code


@dataclass
class Learner:
    """One learner as the spec and its flags make it, before it joins."""

    args: argparse.Namespace
    spec: JobSpec
    group: LearnerGroup
    learner_id: str  # group-index, as the syncer knows us (contract.LearnerId)
    hosts: Hosts
    token: str
    tls_ca: bytes | None
    batches: Batches  # our own disjoint shard: batch k is a pure function of (seed, shard, k)
    evals: list[np.ndarray]  # the shared held-out split
    data: pb.DataListing | None = None  # our copy's files, shown to the syncer at every Join (diloco/copies.py)
    kernels_loading: bool = False  # the codec kernels are already compiling in the background


@dataclass
class Model:
    """The model as every learner has it, and our compiled steps of it."""

    theta0: dict[str, np.ndarray]  # Θ₀, on the host
    shapes: dict[str, tuple[int, ...]]
    plan: FragmentPlan  # P x shards fragments (core/schedule.py), derived as the syncer derives it
    recipe: Recipe  # AdamW and the eval loss, one SPMD program over our devices


def _overlaps(host_cpus: str | None) -> bool:
    """Whether the loop's host work (adopting news, encoding pushes) can run beside the step:
    on an accelerator, or a CPU learner whose own threads have cores of their own (--host-cpus).
    Only then is it done while the step runs, each adoption and push a step later, to spare the
    devices the wait. On one core it would save nothing and the step's lateness costs quality:
    +1.1% held-out loss at seed 0 in bench/quality.py (docs/BENCHMARKS.md §1)."""
    import jax

    return host_cpus is not None or jax.default_backend() != "cpu"


def _configure(args: argparse.Namespace) -> Learner:
    """The spec, our group and hosts, and our shard of the data."""
    from diloco.launch import learner_runtime, load_config, pin_cpus, read_pem, read_token
    from diloco.trainer.runtime import split_host_threads

    pin_cpus(args.cpus)  # before JAX starts its thread pools
    learner_runtime()  # before XLA's first buffers and computation (diloco/launch.py)
    job = load_config(args.config, pretrained=True)
    token = read_token(args)
    tls_ca = read_pem(args.tls_ca, "--tls-ca")
    kernels_loading = _kernels_cold()  # compiling them takes seconds: beside JAX's own (cold) start
    if kernels_loading:
        _start_warming_codecs(job.spec.syncer)
    from diloco import copies
    from diloco.trainer import data
    from diloco.trainer.hosts import Hosts

    spec = job.spec
    group = next((g for g in spec.learner_groups if g.name == args.group), None)
    if group is None or args.index < 0:
        raise EndsEarly(Exit.CONFIG, f"--group {args.group!r} --index {args.index}: no such learner in "
                                     "spec.learnerGroups")
    try:  # a learner of several hosts: join the others first, before JAX does anything else
        hosts = Hosts.start(args, group.hosts_per_learner)
    except ValueError as exc:
        raise EndsEarly(Exit.CONFIG, str(exc)) from None
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
        # Our group's copy (spec.learnerGroups[].data, {region}: diloco/spec/copies.py), whose
        # files and sizes every Join shows the syncer: all copies must hold the same.
        ours = spec.data_for(group.name)
        corpus = data.load(ours, spec.model.vocab_size, window, shard=(shard_index % shard_count, shard_count))
        listing = copies.list_copy(ours.source)
        batches = data.Batches(corpus.train, spec.training.batch_size, window, seed=spec.data.seed, shard_index=shard_index)
        evals = data.eval_batches(corpus.held_out, batches=spec.training.eval_batches, batch=spec.training.batch_size,
                                  length=window, vocab_size=spec.model.vocab_size)
    except ValueError as exc:
        raise EndsEarly(Exit.CONFIG, str(exc)) from None
    return Learner(args=args, spec=spec, group=group, learner_id=str(LearnerId(group.name, args.index)), hosts=hosts,
                   token=token, tls_ca=tls_ca, batches=batches, evals=evals,
                   data=copies.to_pb(listing) if listing is not None else None, kernels_loading=kernels_loading)


def _compile(me: Learner) -> Model:
    """Θ₀, the mesh and the fragment plan; the train and eval steps compiled before joining, so
    the state we pull is fresh when training starts."""
    import jax

    from diloco.core.fragments import plan_fragments, specs_from_shapes
    from diloco.trainer import compile_cache, model, sharding
    from diloco.trainer.recipe import Recipe
    from diloco.trainer.theta0 import initial_params

    # The inner step (trainer/recipe.py): AdamW, its learning rate taken from the job's progress,
    # so a (re)joining learner resumes the job's schedule; one SPMD program over every device
    # this learner has (spec.training.mesh; trainer/sharding.py).
    spec, cfg, tr = me.spec, me.spec.model, me.spec.training
    compile_cache.watch()  # the joined line reports whether this start compiled or read the cache
    cache_dir = compile_cache.files_dir()
    # Θ₀, as every learner has it; a restart reads it from beside the compilation cache (trainer/theta0.py).
    try:
        theta0 = initial_params(cfg, spec.data.seed, cache_dir)
    except ValueError as exc:  # pretrained weights that do not fit their config (diloco/hf.py)
        raise EndsEarly(Exit.CONFIG, str(exc)) from None
    shapes = model.shapes(theta0)  # not parameter_shapes: tracing the model again costs a restart 0.2 s of CPU
    try:
        layout = sharding.layout(tr.mesh, shapes, tr.batch_size)
    except ValueError as exc:
        raise EndsEarly(Exit.CONFIG, str(exc)) from None
    try:
        plan = plan_fragments(specs_from_shapes(shapes), spec.syncer.plan_size, spec.syncer.fragmentation)
    except ValueError as exc:
        raise EndsEarly(Exit.CONFIG, f"spec.syncer.fragments {spec.syncer.fragments} x shards {spec.syncer.shards} "
                                     f"fragments do not fit this model: {exc}", fatal=True) from None
    recipe = Recipe(cfg, tr, layout, shapes=shapes, cache_dir=cache_dir)
    params = recipe.place(theta0)
    try:
        first = me.batches.batch(0)
    except ValueError as exc:  # bad input in a block past the first (trainer/streams.py): as _configure's
        raise EndsEarly(Exit.CONFIG, str(exc)) from None
    jax.block_until_ready(recipe.step(params, recipe.init_state(params), first, 0))
    recipe.eval_loss(params, me.evals[:1])
    return Model(theta0=theta0, shapes=shapes, plan=plan, recipe=recipe)


def _connect(me: Learner, m: Model) -> tuple[MirroredClient, SyncerLink | None, threading.Event]:
    """Our link to the syncer, the same on every host; host 0's own client (one per syncer shard,
    None on the other hosts); and the event SIGTERM sets."""
    from diloco.shards import syncer_addresses
    from diloco.trainer.client import SyncerClient
    from diloco.trainer.hosts import MirroredClient
    from diloco.trainer.sharded_client import ShardedClient

    args = me.args
    # A pod (no restart count) or a restarted process takes its id over from a predecessor the
    # syncer may still think alive; only the very first local process need not.
    def connect(address: str) -> SyncerClient:
        return SyncerClient(address, me.token, me.learner_id, me.group.region, on_event=emit, tls_ca=me.tls_ca,
                            tls_server_name=args.tls_server_name, supersede=args.restart is None or args.restart > 0,
                            data=me.data)

    try:
        addresses = syncer_addresses(args.syncer)  # one per shard of spec.syncer.shards
    except ValueError as exc:
        raise EndsEarly(Exit.CONFIG, str(exc)) from None
    if len(addresses) != me.spec.syncer.shards:
        raise EndsEarly(Exit.CONFIG, f"--syncer: {len(addresses)} addresses for spec.syncer.shards "
                                     f"{me.spec.syncer.shards}; list every shard's host:port, in shard order")
    real: SyncerLink | None = None
    if me.hosts.leader:
        real = connect(addresses[0]) if len(addresses) == 1 else ShardedClient(addresses, connect)
    stop = threading.Event()  # SIGTERM; a multi-host learner acts on host 0's (link.stop_requested)
    # The plan lays out what host 0 shares.
    link = MirroredClient(me.hosts, real, stop, fragments=m.plan.fragments, shapes=m.shapes)
    return link, real, stop


def _join(link: MirroredClient, m: Model) -> JoinState:
    """Pull the whole current global model with its versions (re-admission on a restart). An
    unseeded syncer (no checkpoint yet) gets Θ₀ from the first learner: it runs no model code."""
    from diloco.core.seed import InitialModel
    from diloco.trainer.messages import JoinRefused, Unauthenticated

    try:
        joined = link.join_with_retry(m.shapes, InitialModel(m.theta0, m.plan.fragments))
    except Unauthenticated as exc:
        raise EndsEarly(Exit.REFUSED, f"syncer refused the token: {exc}", fatal=True) from None
    except JoinRefused as exc:
        raise EndsEarly(Exit.CONFIG, str(exc), fatal=True) from None
    if [list(f) for f in m.plan.fragments] != joined.fragments:
        raise EndsEarly(Exit.CONFIG, "fragment plan differs from the syncer's; learner and syncer run different specs",
                        fatal=True)
    return joined


def _begin(me: Learner, fragments: Fragments, metrics: LearnerMetrics, *, real: SyncerLink | None,
           stop: threading.Event, started: float, join_began: float, batch: int) -> PeerStates:
    """Announce the join, start the link's sender and subscriber, and take SIGTERM from now on.
    The join's eval loss is the global model's as pulled: a late joiner starts from it."""
    from diloco.trainer import compile_cache
    from diloco.trainer.peer_state import PeerStates

    pull_seconds = time.monotonic() - join_began
    metrics.mark_joined()
    metrics.badput("startup", join_began - started)
    metrics.badput("state_pull", pull_seconds)
    first_eval = fragments.recipe.eval_loss(fragments.theta, me.evals)
    emit(Event.JOINED, learner=me.learner_id, region=me.group.region, restart=me.args.restart or 0,
         versions=fragments.ledger.versions, slot=fragments.schedule.slot, eval_loss=first_eval,
         startup_seconds=round(join_began - started, 3),
         startup_cpu_seconds=round(time.process_time(), 3),  # this process's CPU until now, all threads
         pull_seconds=round(pull_seconds, 3), incarnation=fragments.incarnation, batch=batch,
         compile_cache=compile_cache.tally())  # JAX's cache: hits on a warm restart, misses on a cold one
    fragments.link.start()
    # A mid-run (re)joiner asks for a peer's AdamW moments and trains on fresh ones until they
    # arrive (trainer/peer_state.py); every one-host learner shares its own when asked.
    peers = PeerStates(real if me.hosts.count == 1 and me.spec.training.peer_optimizer_state else None, emit)
    if fragments.schedule.slot > 0:  # joined mid-run: the schedule starts at the join's slot
        peers.start_fetch()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    return peers


def _report(fragments: Fragments, metrics: LearnerMetrics, *, epoch: float) -> None:
    """About once a second: the network, acknowledged-training and host-wait metrics, and a progress event."""
    link, pr, job = fragments.link, fragments.progress, fragments.job
    metrics.network(link.bytes_sent, link.bytes_received)
    metrics.productive(link.acked_train_seconds)
    metrics.host_wait(pr.host_wait)
    emit(Event.PROGRESS, step=pr.step, slot=fragments.schedule.slot, epoch=round(epoch, 4),
         loss=pr.loss, step_seconds=pr.step_ema, host_wait_seconds=round(pr.host_wait, 6),
         learning_rate=float(fragments.recipe.lr(job.at)),
         lr_position=job.at,  # the job's progress in steps of one learner (JobProgress)
         train_seconds=pr.train_seconds, trained_tokens=pr.trained_tokens, skipped_slots=fragments.schedule.skipped,
         acked_train_seconds=link.acked_train_seconds, bytes_sent=link.bytes_sent,
         bytes_received=link.bytes_received, versions=fragments.ledger.versions)


def _evaluate(fragments: Fragments, metrics: LearnerMetrics, evals: list[np.ndarray], *, slot: int) -> None:
    """The held-out loss of θ as it is now, as a metric and an event."""
    pr = fragments.progress
    ev = fragments.recipe.eval_loss(fragments.theta, evals)
    pr.step_done = time.monotonic()  # the devices were evaluating, not waiting
    metrics.eval_loss.set(ev)
    emit(Event.EVAL, step=pr.step, slot=slot, eval_loss=ev, versions=fragments.ledger.versions)


def _exited(fragments: Fragments, *, flushed: bool, reason: str) -> None:
    """The exit event: where the learner stopped, what the syncer acknowledged, and why."""
    pr, link = fragments.progress, fragments.link
    emit(Event.EXIT, step=pr.step, slot=fragments.schedule.slot, train_seconds=pr.train_seconds,
         trained_tokens=pr.trained_tokens, acked_train_seconds=link.acked_train_seconds, bytes_sent=link.bytes_sent,
         bytes_received=link.bytes_received, flushed=flushed, reason=reason)


def _next_batch(batches: Batches, k: int) -> np.ndarray | None:
    """Batch k, or None after a fatal event: bad input found mid-run (records.DataError: a corrupt
    row group, a cut .zst frame, a record without the text field), its line naming the file and
    where, and the fix. A restart would meet it again: the caller flushes and exits Exit.CONFIG."""
    from diloco.trainer.records import DataError  # loaded with the data (trainer/data.py)

    try:
        return batches.batch(k)
    except DataError as exc:
        emit(Event.FATAL, reason=str(exc))
        _termination_message(str(exc))
        return None


def _around_step(fragments: Fragments, updates: Updates, dispatch: Callable[[], T], *, overlap: bool) -> T:
    """A step boundary's host work (adopt `updates`, send the last step's due pushes: the loop's
    one place where pushes go out) and the next step's dispatch: the host work first where it
    would only wait for the step on its core, behind the dispatched step where the devices would
    otherwise idle through it (`_overlaps`)."""
    ahead = [dispatch()] if overlap else []
    fragments.send(fragments.at_boundary(updates))
    return ahead[0] if ahead else dispatch()


def _dispatch(fragments: Fragments, batches: Batches, k: int, opt_state: Any) -> tuple[Any, Any, float] | None:
    """Batch k's inner step, dispatched to the devices: the optimizer state after it, its loss
    (not yet read) and when it went; None when batch k's input is bad (`_next_batch`)."""
    batch = _next_batch(batches, k)
    if batch is None:
        return None
    t0 = time.monotonic()
    fragments.progress.dispatched(t0)
    fragments.theta, opt_state, loss = fragments.recipe.step(fragments.theta, opt_state, batch,
                                                             fragments.job.position())
    fragments.job.stepped()
    return opt_state, loss, t0


def _termination_message(text: str) -> None:
    """Write `text` to $DILOCO_TERMINATION_LOG (the container's terminationMessagePath), if set.
    The exit at spec.training.steps writes contract.Finished; bad input mid-run, its line; the start writes
    "", which clears a marker a runtime that kept the file across starts would show after a kill
    (the kubelet gives each container start a fresh, empty file)."""
    path = os.environ.get(TERMINATION_LOG_ENV)
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as out:
            out.write(text)
    except OSError as exc:
        print(f"${TERMINATION_LOG_ENV}={path}: cannot write the termination message: {exc}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """`diloco learner`: set up, join, train until the end, flush; the exit code (contract.Exit)."""
    t_process = time.monotonic()
    timeline = Timeline()  # the start's phases, reported at the first accepted push (trainer/startup.py)
    _termination_message("")
    try:
        me = _configure(args)  # the spec, our group and hosts, our shard of the data
        timeline.mark("configured")
        m = _compile(me)  # Θ₀, the mesh, the fragment plan; the steps compiled before joining
        timeline.mark("compiled")
        from diloco.trainer.metrics import LearnerMetrics
        metrics = LearnerMetrics(me.learner_id, me.group.region, args.metrics_port)
        link, real, stop = _connect(me, m)
        t_join = time.monotonic()
        joined = _join(link, m)
        timeline.mark("joined")
        # Cached codec kernels (numba: 0.6 s of CPU) load in the background from here, while the
        # join's evaluation and first step run: the join itself (fp32) needs none, and loading
        # them beside JAX's start took that CPU from the join on a learner of one core
        # (docs/BENCHMARKS.md §12). The first push and adoption wait for them.
        if not me.kernels_loading:
            _start_warming_codecs(me.spec.syncer)
    except EndsEarly as end:
        return end.report()
    from diloco.trainer.fragment_sync import Fragments
    from diloco.trainer.recipe import scalar

    tr, recipe, batches = me.spec.training, m.recipe, me.batches
    tokens_per_step = tr.batch_size * me.spec.model.context
    fragments = Fragments(joined=joined, plan=m.plan.fragments, recipe=recipe, hosts=me.hosts, link=link,
                          adoption=me.spec.syncer.adoption, shards=me.spec.syncer.shards,
                          learners=me.spec.shard_count, tokens_per_step=tokens_per_step, emit=emit)
    opt_state = recipe.init_state(fragments.theta)
    next_batch = joined.resume_tokens // tokens_per_step  # 0 on a first start
    peers = _begin(me, fragments, metrics, real=real, stop=stop, started=t_process, join_began=t_join,
                   batch=next_batch)  # the join's event; the sender and subscriber start; SIGTERM stops us

    pr, finished, last_report = fragments.progress, False, time.monotonic()
    bad_data = False  # a batch's input was found bad (_next_batch): flushed, then Exit.CONFIG
    overlap = _overlaps(args.host_cpus)
    while True:
        # 1. Adopt what the syncer published (θ_p += Θ_p − A_p − the progress Θ_p already holds),
        #    send the last step's due pushes, and (2.) dispatch one inner step on our shard, in the
        #    order `overlap` says (_around_step). What follows until the step's loss is read runs
        #    while the devices compute it; so does sharing our optimizer state with a re-joining peer.
        updates = link.take_updates()
        dispatched = _around_step(fragments, updates, partial(_dispatch, fragments, batches, next_batch, opt_state),
                                  overlap=overlap)
        if dispatched is None:  # bad input: the boundary still happened; flush and end
            bad_data = True
            break
        next_batch += 1
        opt_state, loss, t0 = dispatched
        opt_state = peers.at_boundary(opt_state, updates.share_state)
        stopping = link.stop_requested or link.stopping.is_set()

        # 3. The step's loss (stretched by the group's slowdown factor).
        pr.loss = scalar(loss)
        if me.group.slowdown > 1:
            time.sleep((time.monotonic() - t0) * (me.group.slowdown - 1))
        metrics.step(fragments.stepped(t0, tokens_per_step), tokens_per_step, pr.loss)
        timeline.mark("first_step")
        timeline.acked(link.acked_train_seconds, emit)

        # A diverged learner pushes nothing and starts over from the global model; so does one
        # whose outer gradient the syncer refused as malformed or non-finite.
        if not math.isfinite(pr.loss) or link.resync.is_set():
            opt_state = fragments.start_over()
            continue
        if stopping:  # SIGTERM, or the syncer refused us for good: this step's progress is flushed below
            pr.step += 1
            break

        # 4. Our slot in the shared schedule: its due fragments' outer gradients go out at the
        #    next boundary (poisoned at --inject-nan-at-step: fault injection).
        slot = fragments.take_due(poison=pr.step == args.inject_nan_at_step)
        pr.step += 1
        if pr.step % tr.eval_interval_steps == 0:
            _evaluate(fragments, metrics, me.evals, slot=slot)
        if time.monotonic() - last_report >= 1.0:
            last_report = time.monotonic()
            _report(fragments, metrics, epoch=batches.epoch(next_batch))
        if (args.max_steps and pr.step >= args.max_steps) or (tr.steps and fragments.schedule.slot >= tr.steps):
            finished = True
            break

    # The end (SIGTERM or the last step): push every fragment's unmerged progress, and wait
    # until the syncer has accepted all of it, so no trained step is lost at the end of a run.
    flushed = fragments.flush(FLUSH_SECONDS)
    fatal = link.stopping.is_set() and not link.stop_requested  # the syncer refused us for good
    _exited(fragments, flushed=flushed, reason="fatal" if fatal or bad_data else ("finished" if finished else "stopped"))
    link.close()
    if fatal:
        return Exit.REFUSED
    if bad_data:
        return Exit.CONFIG
    if finished and tr.steps and fragments.schedule.slot >= tr.steps:  # not --max-steps, never SIGTERM
        _termination_message(Finished(me.learner_id, tr.steps, fragments.schedule.slot).line())
    return Exit.OK
