"""The leader lease: which of a shard's syncers (the active one and its standby) may publish.

One small object beside the checkpoints, `syncer.lease`: `{"epoch", "holder", "renewal"}` (the
count makes every renewal a new version: S3's ETag is the content's MD5), replaced only by
compare-and-swap (S3's conditional PUT; a lock file in a directory: diloco/checkpoint.py `swap`).

- **Acquire:** a syncer that finds no lease writes epoch 1. A standby that watches the lease
  object and sees it unchanged for `seconds` (its own monotonic clock, from the moment it first
  saw that version) swaps in `epoch + 1` and itself: a takeover. Two standbys racing: one swap wins.
- **Renew:** the holder rewrites it (same epoch) every `seconds / 3`, each a compare-and-swap
  against the version it wrote last. A swap refused because someone else wrote it means the
  lease is lost: the syncer stops at once, publishing and checkpointing nothing more.
- **Valid:** the holder publishes only while its last renewal *started* less than
  `VALID * seconds` ago. A standby takes over no sooner than `seconds` after it saw that
  renewal land, so the old holder has stopped by then (clocks that run at nearly the same rate
  are all this assumes; a frozen process, SIGSTOP or a long pause, resumes with an expired lease
  and publishes nothing until a renewal succeeds, which a takeover makes impossible).
- **Fencing at the store:** a new holder first fences the checkpoint store for itself
  (`Store.fence`: the manifest, or a directory's `WRITER`, names it), so a checkpoint the old
  holder had in flight when it was frozen fails at its commit instead of landing after the takeover.
- **Fencing at the learners:** the epoch is part of the syncer's incarnation
  (`diloco/contract.py` `leased_incarnation`); a learner refuses a Join from an epoch below one it
  has joined, so even a publish that slipped past the clock check could not pull it back.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from diloco.checkpoint import Store

log = logging.getLogger("diloco.syncer")
FILE = "syncer.lease"
VALID = 0.8  # of the lease period: the holder's margin for clock rates and a slow swap
T = TypeVar("T")


@dataclass(frozen=True)
class Record:
    epoch: int
    holder: str


def parse(raw: bytes | None) -> Record | None:
    """The lease object's contents; None when absent. Malformed: epoch 0, so anyone may take it."""
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        epoch, holder = doc["epoch"], doc["holder"]
        if not isinstance(epoch, int) or epoch < 0 or not isinstance(holder, str):
            raise ValueError("epoch must be a count and holder a string")
    except (ValueError, KeyError, TypeError) as exc:
        log.error("syncer lease is malformed (%s); treating it as epoch 0", exc)
        return Record(0, "")
    return Record(epoch, holder)


@dataclass
class LeaderLease:
    """This syncer's side of the lease in `store`."""

    store: Store
    holder: str  # who we are: pod name (hostname) and incarnation
    seconds: float
    clock: Callable[[], float] = time.monotonic
    epoch: int = 0  # ours, once held
    token: str = ""  # the lease object's version as we last wrote it
    renewed_at: float = -math.inf  # when our last successful swap started
    lost: threading.Event = field(default_factory=threading.Event)
    successor: Record | None = None  # who took it from us
    renewals: int = 0

    def read(self) -> tuple[Record | None, str]:
        raw, token = self.store.read_versioned(FILE)
        return parse(raw), token

    def _write(self, epoch: int, expect: str) -> bool:
        started = self.clock()
        token = self.store.swap(FILE, self._body(epoch), expect)
        if token is None:
            return False
        self.epoch, self.token, self.renewed_at = epoch, token, started
        return True

    def _body(self, epoch: int) -> bytes:
        self.renewals += 1
        return json.dumps({"epoch": epoch, "holder": self.holder, "renewal": self.renewals}).encode()

    def acquire(self, seen: Record | None, token: str) -> bool:
        """Take the lease from the version `token` we saw (absent: ""): epoch one above it."""
        return self._write((seen.epoch if seen else 0) + 1, token)

    def renew(self) -> bool:
        """Rewrite our lease; False when the store refused or failed. Sets `lost` when another
        syncer holds it now."""
        if self.lost.is_set():
            return False
        started = self.clock()
        try:
            token = self.store.swap(FILE, self._body(self.epoch), self.token)
            if token is not None:
                self.token, self.renewed_at = token, started
                return True
            now, _ = self.read()
        except OSError as exc:
            log.warning("cannot renew the syncer lease in %s: %s", self.store.location, exc)
            return False
        if now is None or now != Record(self.epoch, self.holder):
            self.successor = now
            self.lost.set()
        return False

    def release(self) -> None:
        """On a clean stop (SIGTERM, after the final checkpoint): hand the lease back, so a
        standby takes over at its next poll instead of after the lease period."""
        try:
            if not self.lost.is_set() and self.store.swap(FILE, json.dumps(
                    {"epoch": self.epoch, "holder": "", "renewal": self.renewals + 1}).encode(), self.token):
                self.lost.set()
        except OSError as exc:
            log.warning("cannot hand the syncer lease back: %s; the standby takes over when it lapses", exc)

    def valid(self) -> bool:
        """Whether we may publish now."""
        return not self.lost.is_set() and self.clock() < self.renewed_at + VALID * self.seconds


def follow(lease: LeaderLease, stop: threading.Event, restore: Callable[[], T | None],
           poll: float | None = None) -> tuple[T | None, bool] | None:
    """The standby's loop: watch the lease and the active syncer's checkpoints (restoring each
    new one, so a takeover starts from a model already read and verified) until the lease is
    ours. Returns (the model restored from the newest checkpoint, whether we took it over from
    a holder), or None if stopped first."""
    poll = poll if poll is not None else min(1.0, lease.seconds / 8)
    seen_token: str | None = None
    seen_at = lease.clock()
    ready_seq: int | None = None
    announced = False
    while not stop.is_set():
        try:
            record, token = lease.read()
            took = False
            if record is None or not record.holder:  # none yet, or handed back on a clean stop
                took = lease.acquire(record, token)
            elif token != seen_token:
                seen_token, seen_at = token, lease.clock()
                if not announced:
                    log.info("standby: syncer %s holds the lease (epoch %d); following its checkpoints in %s",
                             record.holder, record.epoch, lease.store.location)
                    announced = True
            elif lease.clock() - seen_at >= lease.seconds:
                log.warning("standby: the lease of %s (epoch %d) was not renewed for %.1f s; taking over",
                            record.holder, record.epoch, lease.clock() - seen_at)
                took = lease.acquire(record, token)
                if not took:
                    seen_token = None  # someone else swapped first: watch the new version
            if took:  # fence first: the restore then sees the last checkpoint the old holder commits
                return (restore(), record is not None and bool(record.holder)) if _fence(lease, stop, poll) else None
            newest = lease.store.newest()
            if newest != ready_seq:  # read and verify each new one: a bad one shows before a takeover
                restore()
                ready_seq = newest
        except OSError as exc:
            log.warning("standby: cannot read %s: %s; retrying", lease.store.location, exc)
        stop.wait(poll)
    return None


def _fence(lease: LeaderLease, stop: threading.Event, poll: float) -> bool:
    """Fence the store for the new holder (`Store.fence`), retrying until it lands or we are
    stopped: a checkpoint the old holder has in flight must not commit after the takeover."""
    while True:
        try:
            lease.store.fence(lease.holder)
            return True
        except OSError as exc:
            log.warning("cannot fence %s for this syncer: %s; retrying", lease.store.location, exc)
        if stop.wait(poll):
            return False


def keep(lease: LeaderLease, stop: threading.Event, on_lost: Callable[[], None]) -> None:
    """The holder's thread: renew every third of the lease period until stopped or lost."""
    while not stop.wait(lease.seconds / 3):
        if lease.renew() or not lease.lost.is_set():
            continue
        who = lease.successor
        log.error("lost the syncer lease (epoch %d) to %s: stopping without publishing or checkpointing again",
                  lease.epoch, f"{who.holder} (epoch {who.epoch})" if who else "nobody (the lease object is gone)")
        on_lost()
        return
