"""A learner's bring-up, before its loop (trainer/learner.py): the spec, its group and hosts, its
shard of the data (`configure`); Θ₀, the mesh, the fragment plan and the compiled steps
(`compile_model`); its link to the syncer (`connect`) and the join (`join`). Whatever ends the
learner before it trains is an `EndsEarly`, with its exit code.

Module-level imports are light: the rest imports JAX or numpy, only after pin_cpus and
learner_runtime (configure).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diloco.contract import Event, Exit, LearnerId
from diloco.trainer.emitter import SPEAKS, emit

if TYPE_CHECKING:  # the rest imports JAX or numpy: only after pin_cpus and learner_runtime (see configure)
    import numpy as np

    from diloco.core.fragments import FragmentPlan
    from diloco.spec import JobSpec, LearnerGroup
    from diloco.trainer.data import Batches
    from diloco.trainer.hosts import Hosts
    from diloco.trainer.recipe import Recipe
    from diloco.trainer.sync.link import SyncerLink
    from diloco.trainer.sync.messages import JoinState
    from diloco.trainer.sync.mirrored import MirroredClient
    from diloco.wire import pb


def _warm_codecs(syncer: Any) -> None:
    from diloco.core import warmup
    warmup.warm_codecs((syncer.compression, syncer.broadcast_compression), syncer.block_size)


def start_warming_codecs(syncer: Any) -> None:
    threading.Thread(target=_warm_codecs, args=(syncer,), name="warm-kernels", daemon=True).start()


def kernels_cold() -> bool:
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
    data: pb.DataListing | None = None  # our copy's files, shown to the syncer at every Join (diloco/copy_listings.py)
    kernels_loading: bool = False  # the codec kernels are already compiling in the background


@dataclass
class Model:
    """The model as every learner has it, and our compiled steps of it."""

    theta0: dict[str, np.ndarray]  # Θ₀, on the host
    shapes: dict[str, tuple[int, ...]]
    plan: FragmentPlan  # P x shards fragments (core/schedule.py), derived as the syncer derives it
    recipe: Recipe  # AdamW and the eval loss, one SPMD program over our devices


def overlaps(host_cpus: str | None) -> bool:
    """Whether the loop's host work (adopting news, encoding pushes) can run beside the step:
    on an accelerator, or a CPU learner whose own threads have cores of their own (--host-cpus).
    Only then is it done while the step runs, each adoption and push a step later, to spare the
    devices the wait. On one core it would save nothing and the step's lateness costs quality:
    +1.1% held-out loss at seed 0 in bench/quality.py (docs/BENCHMARKS.md §1)."""
    import jax

    return host_cpus is not None or jax.default_backend() != "cpu"


def configure(args: argparse.Namespace) -> Learner:
    """The spec, our group and hosts, and our shard of the data."""
    from diloco.launch import learner_runtime, load_config, pin_cpus, read_pem, read_token
    from diloco.trainer.runtime import split_host_threads

    pin_cpus(args.cpus)  # before JAX starts its thread pools
    learner_runtime()  # before XLA's first buffers and computation (diloco/launch.py)
    job = load_config(args.config, pretrained=True)
    token = read_token(args)
    tls_ca = read_pem(args.tls_ca, "--tls-ca")
    kernels_loading = kernels_cold()  # compiling them takes seconds: beside JAX's own (cold) start
    if kernels_loading:
        start_warming_codecs(job.spec.syncer)
    from diloco import copy_listings
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
    SPEAKS[0] = hosts.leader
    split_host_threads(args.host_cpus)  # after jax.distributed, before gRPC's and our threads start
    # Disjoint across groups and clusters: spec.data.shards and the groups' shardOffset.
    shard_index, shard_count = spec.shard_of(group.name, args.index)
    # Data (spec.data.source): our own disjoint shard, and the shared held-out split. Batch k is
    # a pure function of (seed, shard, k): a restarted learner resumes at the batch after the
    # last one the syncer merged (the Join says how many tokens that is), on every host alike.
    window = spec.model.context + 1
    try:
        # Only our shard is read (and, for text, tokenized): data.load.
        # Our group's copy (spec.learnerGroups[].data, {region}: diloco/spec/copy_listings.py), whose
        # files and sizes every Join shows the syncer: all copies must hold the same.
        ours = spec.data_for(group.name)
        corpus = data.load(ours, spec.model.vocab_size, window, shard=(shard_index % shard_count, shard_count))
        listing = copy_listings.list_copy(ours.source)
        batches = data.Batches(corpus.train, spec.training.batch_size, window, seed=spec.data.seed, shard_index=shard_index)
        evals = data.eval_batches(corpus.held_out, batches=spec.training.eval_batches, batch=spec.training.batch_size,
                                  length=window, vocab_size=spec.model.vocab_size)
    except ValueError as exc:
        raise EndsEarly(Exit.CONFIG, str(exc)) from None
    return Learner(args=args, spec=spec, group=group, learner_id=str(LearnerId(group.name, args.index)), hosts=hosts,
                   token=token, tls_ca=tls_ca, batches=batches, evals=evals,
                   data=copy_listings.to_pb(listing) if listing is not None else None, kernels_loading=kernels_loading)


def compile_model(me: Learner) -> Model:
    """Θ₀, the mesh and the fragment plan; the train and eval steps compiled before joining, so
    the state we pull is fresh when training starts."""
    import jax

    from diloco.core.fragments import plan_fragments, specs_from_shapes
    from diloco.trainer import model, sharding
    from diloco.trainer.caches import compile_cache
    from diloco.trainer.caches.theta0 import initial_params
    from diloco.trainer.recipe import Recipe

    # The inner step (trainer/recipe.py): AdamW, its learning rate taken from the job's progress,
    # so a (re)joining learner resumes the job's schedule; one SPMD program over every device
    # this learner has (spec.training.mesh; trainer/sharding.py).
    spec, cfg, tr = me.spec, me.spec.model, me.spec.training
    compile_cache.watch()  # the joined line reports whether this start compiled or read the cache
    cache_dir = compile_cache.files_dir()
    # Θ₀, as every learner has it; a restart reads it from beside the compilation cache (trainer/caches/theta0.py).
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
    except ValueError as exc:  # bad input in a block past the first (trainer/data/streams.py): as configure's
        raise EndsEarly(Exit.CONFIG, str(exc)) from None
    jax.block_until_ready(recipe.step(params, recipe.init_state(params), first, 0))
    recipe.eval_loss(params, me.evals[:1])
    return Model(theta0=theta0, shapes=shapes, plan=plan, recipe=recipe)


def connect(me: Learner, m: Model) -> tuple[MirroredClient, SyncerLink | None, threading.Event]:
    """Our link to the syncer, the same on every host; host 0's own client (one per syncer shard,
    None on the other hosts); and the event SIGTERM sets."""
    from diloco.shards import server_names, syncer_addresses
    from diloco.trainer.sync.client import SyncerClient
    from diloco.trainer.sync.mirrored import MirroredClient
    from diloco.trainer.sync.sharded_client import ShardedClient

    args = me.args
    # A pod (no restart count) or a restarted process takes its id over from a predecessor the
    # syncer may still think alive; only the very first local process need not.
    def connect(address: str) -> SyncerClient:
        return SyncerClient(address, me.token, me.learner_id, me.group.region, on_event=emit, tls_ca=me.tls_ca,
                            tls_server_name=names[address], supersede=args.restart is None or args.restart > 0,
                            data=me.data)

    try:
        addresses = syncer_addresses(args.syncer)  # one per shard of spec.syncer.shards
        # The certificate's name per shard: one for all, or one each (--tls-server-name a,b,...).
        names = dict(zip(addresses, server_names(args.tls_server_name, addresses), strict=True))
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


def join(link: MirroredClient, m: Model) -> JoinState:
    """Pull the whole current global model with its versions (re-admission on a restart). An
    unseeded syncer (no checkpoint yet) gets Θ₀ from the first learner: it runs no model code."""
    from diloco.core.seed import InitialModel
    from diloco.trainer.sync.messages import JoinRefused, Unauthenticated

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
