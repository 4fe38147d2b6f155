"""`diloco learner`: one Decoupled DiLoCo learner (docs/ALGORITHM.md, "The learner loop").

Read `run` top to bottom: bring the learner up and join, pulling the global model
(trainer/bringup.py); then until the end: adopt (rebase onto) any global fragments that
arrived, take one AdamW step on our own shard, and hand the outer gradient of the fragment the
shared schedule says is due to the background sender; at the end, flush every fragment's
unmerged progress. What each fragment holds
between the devices and the syncer is trainer/sync/fragment_sync.py's `Fragments`. Events go to
stdout as JSON lines (the local runner and the operator's logs read them).
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from diloco.contract import Event, Exit, Finished
from diloco.trainer.bringup import (
    EndsEarly,
    Learner,
    compile_model,
    configure,
    connect,
    join,
    overlaps,
    start_warming_codecs,
)
from diloco.trainer.emitter import emit, termination_message
from diloco.trainer.timeline import Timeline

if TYPE_CHECKING:  # the rest imports JAX or numpy: only after pin_cpus and learner_runtime (trainer/bringup.py)
    import numpy as np

    from diloco.trainer.data import Batches
    from diloco.trainer.metrics import LearnerMetrics
    from diloco.trainer.sync.fragment_sync import Fragments
    from diloco.trainer.sync.link import SyncerLink
    from diloco.trainer.sync.messages import Updates
    from diloco.trainer.sync.peer_state import PeerStates

log = logging.getLogger("diloco.learner")
T = TypeVar("T")
FLUSH_SECONDS = 10.0  # at the end, time to get the last pushes accepted (one round trip each)


def _begin(me: Learner, fragments: Fragments, metrics: LearnerMetrics, *, real: SyncerLink | None,
           stop: threading.Event, started: float, join_began: float, batch: int) -> PeerStates:
    """Announce the join, start the link's sender and subscriber, and take SIGTERM from now on.
    The join's eval loss is the global model's as pulled: a late joiner starts from it."""
    from diloco.trainer.caches import compile_cache
    from diloco.trainer.sync.peer_state import PeerStates

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
    # arrive (trainer/sync/peer_state.py); every one-host learner shares its own when asked.
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
         # The events' key stays `trained_tokens` (the runner's tracker, the benches and recorded
         # event logs read it): the push header's `session_tokens`, this process's count.
         train_seconds=pr.train_seconds, trained_tokens=pr.session_tokens, skipped_slots=fragments.schedule.skipped,
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
         trained_tokens=pr.session_tokens, acked_train_seconds=link.acked_train_seconds, bytes_sent=link.bytes_sent,
         bytes_received=link.bytes_received, flushed=flushed, reason=reason)


def _next_batch(batches: Batches, k: int) -> np.ndarray | None:
    """Batch k, or None after a fatal event: bad input found mid-run (records.DataError: a corrupt
    row group, a cut .zst frame, a record without the text field), its line naming the file and
    where, and the fix. A restart would meet it again: the caller flushes and exits Exit.CONFIG."""
    from diloco.trainer.data.records import DataError  # loaded with the data (trainer/data/__init__.py)

    try:
        return batches.batch(k)
    except DataError as exc:
        emit(Event.FATAL, reason=str(exc))
        termination_message(str(exc))
        return None


def _around_step(fragments: Fragments, updates: Updates, dispatch: Callable[[], T], *, overlap: bool) -> T:
    """A step boundary's host work (adopt `updates`, send the last step's due pushes: the loop's
    one place where pushes go out) and the next step's dispatch: the host work first where it
    would only wait for the step on its core, behind the dispatched step where the devices would
    otherwise idle through it (trainer/bringup.py, `overlaps`)."""
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


def run(args: argparse.Namespace) -> int:
    """`diloco learner`: set up, join, train until the end, flush; the exit code (contract.Exit)."""
    t_process = time.monotonic()
    timeline = Timeline()  # the start's phases, reported at the first accepted push (trainer/timeline.py)
    termination_message("")
    try:
        me = configure(args)  # the spec, our group and hosts, our shard of the data
        timeline.mark("configured")
        m = compile_model(me)  # Θ₀, the mesh, the fragment plan; the steps compiled before joining
        timeline.mark("compiled")
        from diloco.trainer.metrics import LearnerMetrics
        metrics = LearnerMetrics(me.learner_id, me.group.region, args.metrics_port)
        link, real, stop = connect(me, m)
        t_join = time.monotonic()
        joined = join(link, m)
        timeline.mark("joined")
        # Cached codec kernels (numba: 0.6 s of CPU) load in the background from here, while the
        # join's evaluation and first step run: the join itself (fp32) needs none, and loading
        # them beside JAX's start took that CPU from the join on a learner of one core
        # (docs/BENCHMARKS.md §12). The first push and adoption wait for them.
        if not me.kernels_loading:
            start_warming_codecs(me.spec.syncer)
    except EndsEarly as end:
        return end.report()
    from diloco.trainer.recipe import scalar
    from diloco.trainer.sync.fragment_sync import Fragments

    tr, recipe, batches = me.spec.training, m.recipe, me.batches
    tokens_per_step = tr.batch_size * me.spec.model.context
    fragments = Fragments(joined=joined, plan=m.plan.fragments, recipe=recipe, hosts=me.hosts, link=link,
                          adoption=me.spec.syncer.adoption, shards=me.spec.syncer.shards,
                          learners=me.spec.shard_count, tokens_per_step=tokens_per_step, emit=emit)
    opt_state = recipe.init_state(fragments.theta)
    next_batch = joined.tokens_merged // tokens_per_step  # 0 on a first start
    peers = _begin(me, fragments, metrics, real=real, stop=stop, started=t_process, join_began=t_join,
                   batch=next_batch)  # the join's event; the sender and subscriber start; SIGTERM stops us

    pr, finished, last_report = fragments.progress, False, time.monotonic()
    bad_data = False  # a batch's input was found bad (_next_batch): flushed, then Exit.CONFIG
    overlap = overlaps(args.host_cpus)
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
        termination_message(Finished(me.learner_id, tr.steps, fragments.schedule.slot).line())
    return Exit.OK
