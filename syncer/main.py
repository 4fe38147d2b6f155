"""`diloco syncer`: the syncer process (the container's command, and the local runner's).

Restores the newest valid checkpoint (or initialises the model from the job's seed),
serves gRPC, merges on its own thread, checkpoints on a schedule and on SIGTERM.

With spec.syncer.standby, two syncers (per shard) share one checkpoint store and a leader
lease in it (syncer/durable/leader.py): the one that holds the lease serves; the other follows
its checkpoints with its gRPC port closed (learners and the Service see it as not there) and
takes over when the lease goes unrenewed. A syncer that loses the lease exits at once.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures

import grpc
from google.protobuf.internal import api_implementation
from prometheus_client import start_http_server

from diloco.checkpoint import Store
from diloco.checkpoint_objects import StoreUnavailable, is_url, open_store, shard_location
from diloco.contract import Exit, leased_incarnation, parse_shard, ready_line
from diloco.core import warmup
from diloco.core.fragments import owned_by
from diloco.launch import keep_freed_memory, reserve_heap
from diloco.spec import DecoupledDiLoCoJob
from diloco.syncer.core import SyncerCore
from diloco.syncer.durable import leader
from diloco.syncer.global_model import GlobalModel
from diloco.syncer.joins.seeding import Switch, Unseeded
from diloco.syncer.metrics import SyncerMetrics
from diloco.syncer.servicer import SyncerServicer
from diloco.wire import add_syncer, server_options

log = logging.getLogger("diloco.syncer")


def restored_model(job: DecoupledDiLoCoJob, store: Store | None, shard: int = 0,
                   verb: str = "resumed from") -> GlobalModel | None:
    """The newest valid checkpoint's model, or None: then the first learner seeds Θ₀
    (syncer/joins/seeding.py). A shard holds its own fragments only."""
    if store is None:
        return None
    loaded, skipped = store.load_latest()
    for line in skipped:
        log.error("skipping corrupt checkpoint %s", line)
    if loaded is None:
        return None
    syncer = job.spec.syncer
    model = GlobalModel.from_state(syncer, loaded.arrays, loaded.meta, owned=owned_by(shard, syncer.plan_size, syncer.shards))
    log.info("%s %s at versions %s", verb, loaded.path.name, model.versions)
    return model


def checkpoint_store(location: str | None, shard: int, shards: int) -> Store | None:
    """The shard's store: a directory (its own volume), or `<url>/shard-<i>` of a shared URL."""
    if not location:
        return None
    try:
        return open_store(shard_location(location, shard, shards) if is_url(location) else location)
    except StoreUnavailable as exc:
        raise SystemExit(f"syncer: {exc}") from None


def serve(job: DecoupledDiLoCoJob, token: str, *, port: int, metrics_port: int | None,
          checkpoint_dir: str | None, tls: tuple[bytes, bytes] | None = None, host: str = "[::]",
          shard: int = 0) -> bool:
    """Serve until SIGTERM; False when the syncer stopped because it lost its lease (fenced)."""
    keep_freed_memory()
    store = checkpoint_store(checkpoint_dir, shard, job.spec.syncer.shards)
    metrics = SyncerMetrics()
    if metrics_port is not None:  # first: a standby's liveness is its metrics port
        start_http_server(metrics_port, addr="0.0.0.0", registry=metrics.registry)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    # Load the kernels before serving, not at the first pushes: loaded then, they make the first
    # rounds seconds late on a cold cache (about 0.4 s from the cache).
    warmup.warm(job.spec.syncer.block_size)
    nonce = uuid.uuid4().hex[:12]
    standby = job.spec.syncer.standby
    lease: leader.LeaderLease | None = None
    if standby is not None and store is not None:
        if not getattr(store, "conditional", True):
            raise SystemExit(f"syncer: spec.syncer.standby needs a store with conditional writes for its lease "
                             f"(s3://, or a directory both syncers share); {store.location} has none")
        lease = leader.LeaderLease(store, f"{socket.gethostname()}/{nonce}", standby.lease_seconds)
        metrics.leader.set(0)
        followed = leader.follow(lease, stop, lambda: restored_model(job, store, shard, "standby: read"))
        if followed is None:
            return True
        model, took_over = followed
        metrics.leader.set(1)
        metrics.lease_epoch.set(lease.epoch)
        if took_over:
            metrics.takeovers.inc()
        log.info("holding the syncer lease (epoch %d%s)", lease.epoch, ", taken over" if took_over else "")
        incarnation = leased_incarnation(lease.holder, lease.epoch)
    else:
        model = restored_model(job, store, shard)
        incarnation = nonce  # changes at every start: learners re-join a new one
    restored = model is not None
    # Each learner holds a subscription thread and briefly a push or join thread; spec.data.shards
    # counts other clusters' learners too, and the head-room admits scavengers.
    workers = 4 * max(job.spec.total_learners, job.spec.shard_count) + 64
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=server_options())
    may_publish = lease.valid if lease is not None else None

    def start(model: GlobalModel) -> SyncerCore:
        """The syncer proper, once it has a model; RPCs switch to it at once."""
        core = _start(job, model, store=store, metrics=metrics, shard=shard, incarnation=incarnation,
                      fresh=not restored, allowed=may_publish)
        switch.current = SyncerServicer(core, token)
        log.info("syncer %s shard %d of %d serving (incarnation %s, fragments %s of %d)", job.metadata.name,
                 shard, job.spec.syncer.shards, core.incarnation, list(core.owned), core.model.plan.num_fragments)
        return core

    unseeded = Unseeded(job.spec.syncer, shard, token, on_seed=start, incarnation=incarnation)
    switch = Switch(unseeded, gate=may_publish)
    add_syncer(switch, server)  # forwards every RPC to the current servicer
    bound = _listen(server, tls, f"{host}:{port}")
    if bound == 0:
        raise SystemExit(f"syncer: cannot listen on port {port}")
    fenced = threading.Event()
    if lease is not None:
        def lost() -> None:
            fenced.set()
            stop.set()

        threading.Thread(target=leader.keep, args=(lease, stop, lost), name="lease", daemon=True).start()
    core = start(model) if model is not None else None
    server.start()
    print(ready_line(bound, incarnation), flush=True)  # serving (an unseeded syncer answers Join and Seed)
    if core is None:
        log.info("no checkpoint: waiting on port %d for the first learner's initial model", bound)
        while not unseeded.seeded.wait(0.5):
            if stop.is_set():
                server.stop(grace=1).wait()
                return not fenced.is_set()
        core = unseeded.started
        log.info("seeded with Θ₀ by a learner: %d tensors", len(core.model.params))
    threading.Thread(target=_merge_loop, args=(core, stop, may_publish), name="merge", daemon=True).start()
    try:
        _run(core, stop, job.spec.syncer.checkpoint_interval_seconds, fenced)
    finally:
        # Also on a bug: gRPC's threads would otherwise keep a syncer that serves nothing alive
        # (no restart by the kubelet); stopped, the process exits with the traceback.
        server.stop(grace=0 if fenced.is_set() else 2).wait()
    if lease is not None and not fenced.is_set():
        lease.release()
    if fenced.is_set():
        log.error("fenced: %d merges in all; withheld %d calls and stream messages once the lease lapsed",
                  int(metrics.merges._value.get()), switch.withheld)
    return not fenced.is_set()


def _start(job: DecoupledDiLoCoJob, model: GlobalModel, *, store: Store | None, metrics: SyncerMetrics,
           shard: int, incarnation: str, fresh: bool, allowed: Callable[[], bool] | None = None) -> SyncerCore:
    """The syncer's core on `model`, its first checkpoint written (a `fresh` job's) and its heap reserved."""
    # Regions reported by name: this manifest's groups' and other clusters' (spec.syncer.remoteRegions).
    regions = frozenset([*(g.region for g in job.spec.learner_groups), *job.spec.syncer.remote_regions])
    core = SyncerCore(spec=job.spec.syncer, model=model, store=store, metrics=metrics, regions=regions, shard=shard,
                      incarnation=incarnation, tokens_per_step=job.spec.tokens_per_step)
    if allowed is not None:
        core.persistence.allowed = allowed
    if store is not None and fresh:
        # A fresh job's first checkpoint, before anything is published: it holds the provenance
        # key and Θ₀'s hash, so a syncer that crashes before its first scheduled checkpoint still
        # recognises what it published when learners hand it back (Recover).
        core.checkpoint()
    t0, headroom = time.monotonic(), core.headroom()
    reserve_heap(headroom)  # diloco/launch.py: faulted in now, not during the first rounds and Joins
    log.info("reserved %d MB of heap for republished fragments under a Join and the delta chains (%.1f s; "
             "protobuf: %s)",
             headroom >> 20, time.monotonic() - t0, api_implementation.Type())
    return core


def _listen(server: grpc.Server, tls: tuple[bytes, bytes] | None, address: str) -> int:
    """Bind `address` (with TLS if given a key and certificate); the port bound, 0 if none."""
    if tls is not None:
        key, cert = tls
        return int(server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)])))
    return int(server.add_insecure_port(address))


def _merge_loop(core: SyncerCore, stop: threading.Event, allowed: Callable[[], bool] | None = None) -> None:
    """The merge thread: woken by every accepted push; otherwise sleeps until the next grace deadline.
    Without the lease (`allowed` says no) it merges and publishes nothing."""
    while not stop.is_set():
        if allowed is not None and not allowed():
            stop.wait(0.1)
            continue
        try:
            core.merge_ready()
        except Exception:  # a bug must not silently end all merging: say so, keep serving
            core.metrics.merge_errors.inc()
            log.exception("merge failed; the round's contributions are dropped")
        core.wait_for_round()


def _run(core: SyncerCore, stop: threading.Event, interval: float, fenced: threading.Event | None = None) -> None:
    """Checkpoint every `interval` seconds until stopped; then the final merges and checkpoint
    (none when the lease was lost: the store is the successor's now)."""
    next_ckpt = time.monotonic() + interval
    while not stop.wait(timeout=max(0.05, min(1.0, next_ckpt - time.monotonic()))):
        if time.monotonic() >= next_ckpt:
            core.checkpoint()
            next_ckpt = time.monotonic() + interval
    if fenced is not None and fenced.is_set():
        core.stop()
        return
    log.info("stopping: final checkpoint")
    core.stop()
    core.merge_ready(flush=True)  # close open rounds: what learners flushed at SIGTERM is kept
    core.checkpoint()


def main(args: argparse.Namespace) -> int:
    from diloco.launch import load_config, read_pem, read_token

    logging.basicConfig(level=logging.INFO, format="%(asctime)s syncer %(levelname)s %(message)s")
    job = load_config(args.config)
    cert, key = read_pem(args.tls_cert, "--tls-cert"), read_pem(args.tls_key, "--tls-key")
    if (cert is None) != (key is None):
        raise SystemExit("--tls-cert and --tls-key go together")
    tls = (key, cert) if cert is not None and key is not None else None
    try:
        shard = parse_shard(args.shard, socket.gethostname())
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if not shard < job.spec.syncer.shards:
        raise SystemExit(f"--shard {args.shard}: spec.syncer.shards is {job.spec.syncer.shards}, "
                         f"so shards are 0 to {job.spec.syncer.shards - 1}")
    held = serve(job, read_token(args), port=args.port, metrics_port=args.metrics_port,
                 checkpoint_dir=args.checkpoint_dir, tls=tls, shard=shard)
    return 0 if held else int(Exit.FAILED)  # fenced: restart, as the standby it now is
