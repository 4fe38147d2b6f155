"""What outlives a syncer incarnation: its checkpoints, its publish lease, and the merges
learners hand back (Recover) when it restarted from an older checkpoint than what it had
published.

Both take the round driver's `exclusive()` (no merge in flight) and the core's lock (the
driver's `lock`); the syncer core calls them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from diloco.checkpoint import FencedOut, Store
from diloco.core.codecs import CodecError, decode_tensors
from diloco.syncer.acceptance import Refused
from diloco.syncer.durable.lease import PublishLease
from diloco.syncer.global_model import GlobalModel
from diloco.syncer.metrics import SyncerMetrics
from diloco.syncer.publisher import Publisher
from diloco.syncer.round import RoundDriver
from diloco.wire import pb

log = logging.getLogger("diloco.syncer")


@dataclass(kw_only=True)
class Persistence:
    """The checkpoint store and publish lease of one syncer shard, over its model and driver."""

    store: Store | None
    lease: PublishLease
    model: GlobalModel
    driver: RoundDriver  # its `exclusive()`, `lock`, book and published slots
    publisher: Publisher  # re-based on what Recover adopts
    metrics: SyncerMetrics
    owned: Sequence[int]  # this shard's fragments
    shard: int
    max_recover_bytes: int  # every fragment in fp32: the whole model
    checkpoint_version: int = 0  # the outer version (sum of versions) of the newest checkpoint written
    # Whether this syncer may write its store now: with a standby, only while it holds the
    # leader lease (syncer/durable/leader.py), so a fenced syncer never overwrites its successor's.
    allowed: Callable[[], bool] = lambda: True

    def recover(self, header: pb.RecoverHeader, body: Callable[[], bytes | memoryview]) -> list[int]:
        """Adopt global fragments a learner received from a previous incarnation of this syncer
        when they are newer than ours (we restarted from an older checkpoint), only at a version
        the publish lease says could have been published, and only with the provenance tag that
        syncer sent them with: then they are a merge we would otherwise lose, not values a token
        holder made up. `body` reads the bundle once its declared size is known to fit the model."""
        if header.total_bytes > self.max_recover_bytes:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"recover: {header.total_bytes} bytes is more than the model")
        fragments, versions, tags, blob = list(header.fragments), list(header.versions), list(header.tags), body()
        num = self.model.plan.num_fragments
        if len(fragments) != len(versions) or len(set(fragments)) != len(fragments) or any(p >= num for p in fragments):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "recover: fragments must be distinct, known, one version each")
        if foreign := [p for p in fragments if p not in self.owned]:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"recover: fragments {foreign} belong to other syncer "
                          f"shards than this one ({self.shard})", "misrouted")
        if len(tags) != len(fragments):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "recover: one provenance tag per fragment is required",
                          "forged")
        expect = {n: s for p in fragments for n, s in self.model.shapes(p).items()}
        try:
            tensors = decode_tensors(blob, expect)
        except CodecError as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"recover: {exc}") from None
        if not all(np.all(np.isfinite(t)) for t in tensors.values()):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "recover: fragments hold NaN or Inf", "nonfinite")
        with self.driver.lock:
            newer = [(p, v) for p, v in zip(fragments, versions) if v > self.model.versions[p]]
            beyond = [(p, v) for p, v in newer if not self.lease.allows(p, v)]
        if beyond:
            p, v = beyond[0]
            log.warning("refused a recovery offer beyond the publish lease (fragment %d, version %d)", p, v)
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                          f"recover: fragment {p} at version {v} is beyond any version this job's syncer has "
                          "published (its publish lease); nothing was adopted", "forged")
        for (p, v), t in zip(zip(fragments, versions), tags):
            if (p, v) in newer and not self.model.tag_matches(p, v, tensors, t):
                log.warning("refused a recovery offer without a valid provenance tag (fragment %d, version %d)", p, v)
                raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                              f"recover: fragment {p} at version {v} does not carry this job's provenance tag "
                              "(not published by its syncer); nothing was adopted", "forged")
        adopted = []
        with self.driver.exclusive(), self.driver.lock:  # not while a merge of the fragment is in flight
            for p, v in newer:
                if v > self.model.versions[p]:
                    for n in self.model.plan.fragments[p]:
                        self.model.params[n] = tensors[n].astype(np.float32, copy=True)
                    self.model.versions[p] = v
                    # The open round stays: its outer gradients are progress, valid on any base.
                    adopted.append(p)
                    self.publisher.reset(p, v, self.model.fragment(p), self.driver.published_slot[p])
            if adopted:
                self.metrics.outer_version.set(sum(self.model.versions))
                self.driver.lock.notify_all()
        if adopted:
            log.info("recovered fragments %s from a learner; versions now %s", adopted, self.model.versions)
        return adopted

    def checkpoint(self) -> bool:
        """Write a checkpoint; on failure log a clear error, keep the previous one, keep going."""
        if self.store is None:
            return False
        if not self.allowed():
            log.warning("not checkpointing: this syncer does not hold its lease now (spec.syncer.standby)")
            return False
        started = time.monotonic()
        with self.driver.exclusive(), self.driver.lock:  # momentum is advanced by merges outside the lock
            self.model.schedule = self.driver.book.schedule_state()
            arrays, meta = self.model.state()
            arrays = {k: v.copy() for k, v in arrays.items()}
            version = sum(self.model.versions)
        held = time.monotonic() - started
        try:
            path = self.store.save(arrays, meta)
        except FencedOut as exc:  # frozen past its lease mid-save: the new holder's checkpoints stand
            log.error("checkpoint not committed: %s", exc)
            return False
        except OSError as exc:
            self.metrics.checkpoint_errors.inc()
            log.error("checkpoint failed in %s: %s; the previous checkpoint is intact, training goes on",
                      self.store.location, exc)
            return False
        self.checkpoint_version = version
        # Nothing here touches the directory again: its path may already name another volume.
        log.info("checkpoint %s at outer version %d: %d MB of state in %.2f s (%.2f s of it holding the merges)",
                 path.name, version, sum(a.nbytes for a in arrays.values()) >> 20, time.monotonic() - started, held)
        return True
