"""Admission: which pushes the syncer may take, before anything touches the global model.

A push is checked in order of cost: its header (ids, incarnation, fragment, size bound, slot),
the sender's session (the process that joined under that learner id), the payload's codec
structure and finiteness, a retry of a push already taken, and the outlier bound on its norm.
Everything refused raises `Refused` with the gRPC status and the outcome it is counted under.
No networking and no locking here: the syncer core holds its lock around the stateful calls.
"""

from __future__ import annotations

import hmac
import logging
import math
import os
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from diloco.core.codecs import CodecError, Packed, parse_tensors
from diloco.core.fragments import owner
from diloco.core.schedule import due_fragments
from diloco.wire import pb

log = logging.getLogger("diloco.syncer")
MAX_ID = 128
NORM_HISTORY = 64  # accepted norms per fragment the median is taken over: ~16 rounds of 4 learners
NORM_WARMUP = 16  # no outlier check before this many: early rounds move fast, and few samples mislead


class Refused(Exception):
    """A request refused before it touched the global state; carries the gRPC status and the
    outcome it is counted under (empty: not counted as a refused push, e.g. a Join's checks)."""

    def __init__(self, code: grpc.StatusCode, reason: str, outcome: str = "invalid"):
        super().__init__(reason)
        self.code, self.reason, self.outcome = code, reason, outcome


@dataclass(frozen=True)
class Session:
    """A learner id's current holder: the process that joined last, and its secret."""

    process: int
    secret: bytes


def check_header(h: pb.PushHeader, incarnation: str, max_push_bytes: list[int], shards: int = 1) -> None:
    """Raise Refused if a push header is unacceptable (checked before reading the body). The
    plan holds one fragment per shard for each slot (core/schedule.py)."""
    problem, code, num = None, grpc.StatusCode.INVALID_ARGUMENT, len(max_push_bytes)
    if not h.learner or len(h.learner) > MAX_ID or len(h.region) > MAX_ID:
        problem = "learner id must be 1-128 characters"
    elif h.incarnation != incarnation:
        problem = f"syncer restarted (incarnation {incarnation}); rejoin"
        code = grpc.StatusCode.FAILED_PRECONDITION
    elif h.fragment >= num:
        problem = f"unknown fragment {h.fragment}; this job has {num}"
    elif h.total_bytes > max_push_bytes[h.fragment]:
        problem = f"push of {h.total_bytes} bytes exceeds the {max_push_bytes[h.fragment]}-byte bound of fragment {h.fragment}"
    elif not np.isfinite(h.step_seconds) or h.step_seconds < 0 or h.steps < 1:
        problem = "steps must be >= 1 and step_seconds finite and non-negative"
    elif h.slot > (1 << 48) or h.session_tokens > (1 << 62):
        problem = "slot and session_tokens are out of range"
    elif h.push_id and h.fragment not in (due := due_fragments(h.slot, num, shards)):
        problem = (f"slot {h.slot} is due for fragment{'s' if shards > 1 else ''} {_listed(due)}, not fragment "
                   f"{h.fragment} (slot s is due for fragment{'s' if shards > 1 else ''} {_rule(num, shards)})")
    if problem:
        raise Refused(code, problem)


def check_owned(fragment: int, owned: Sequence[int], shard: int, shards: int) -> None:
    """Raise Refused (`misrouted`) for a push of a fragment another syncer shard owns."""
    if fragment not in owned:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"fragment {fragment} belongs to syncer shard "
                      f"{owner(fragment, shards)}, not to this one ({shard})", "misrouted")


def _listed(due: range) -> str:
    return str(due.start) if len(due) == 1 else f"{due.start}-{due.stop - 1}"


def _rule(num: int, shards: int) -> str:
    return f"s mod {num}" if shards == 1 else f"(s mod {num // shards}) x {shards} + shard, one per shard"


def outer_gradient(blob: bytes | memoryview, p: int, shapes: Mapping[str, tuple[int, ...]]) -> tuple[dict[str, Packed], float]:
    """The push's tensors, validated but still encoded (the merge decodes them straight into its
    accumulator), and their norm: from the codes alone for int codecs, whose values are finite
    by construction once their scales are."""
    try:
        packed = parse_tensors(blob, shapes)
    except CodecError as exc:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"fragment {p}: {exc}") from None
    squares = 0.0
    for name, t in packed.items():
        sq = t.sumsq()
        if not math.isfinite(sq):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"outer gradient of {name!r} holds NaN or Inf (or values whose squares overflow)",
                          "nonfinite")
        squares += sq
    return packed, math.sqrt(squares)


@dataclass(kw_only=True)
class Admission:
    """Who holds each learner id, which pushes were taken (for retries), and each fragment's
    recent norms (for the outlier bound)."""

    num_fragments: int
    max_norm_ratio: float | None  # spec.syncer.maxNormRatio
    sessions: dict[str, Session] = field(default_factory=dict)  # learner id -> its current holder
    # Recently accepted pushes per learner process: push id -> the version merging it, so a
    # push retried after a lost reply is acknowledged again instead of merged twice.
    accepted: dict[tuple[str, int], OrderedDict[int, int]] = field(default_factory=dict)
    norms: list[deque[float]] = field(default_factory=list)  # per fragment: recent accepted norms
    max_ratio_seen: float = 0.0  # of every push checked, the largest norm over the median

    def __post_init__(self) -> None:
        self.norms = [deque(maxlen=NORM_HISTORY) for _ in range(self.num_fragments)]

    def open_session(self, learner: str, process: int, supersede: bool, live: bool) -> bytes:
        """Bind `learner` to the joining process and return the secret its pushes and
        subscriptions must carry. Another live process holding the id keeps it unless the joiner
        supersedes it explicitly (a restarted pod); the same process re-joining simply renews."""
        current = self.sessions.get(learner)
        if current is not None and current.process != process and live and not supersede:
            raise Refused(grpc.StatusCode.ALREADY_EXISTS,
                          f"learner id {learner!r} is held by another live process; a restarted process "
                          "joins with supersede", "impostor")
        secret = os.urandom(16)
        self.sessions[learner] = Session(process, secret)
        return secret

    def check_session(self, learner: str, secret: bytes) -> None:
        """Raise Refused unless `secret` is the one the current holder of `learner` got at Join."""
        current = self.sessions.get(learner)
        if current is None or not hmac.compare_digest(current.secret, secret):
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                          f"learner {learner!r}: no session, or a newer process joined under this id; "
                          "this process must stop", "impostor")

    def retried(self, origin: tuple[str, int], push_id: int) -> int | None:
        """The version a push already taken merges into, if this is a retry of it."""
        seen = self.accepted.get(origin)
        return seen.get(push_id) if seen is not None and push_id else None

    def check_norm(self, p: int, norm: float, learner: str) -> float | None:
        """Refuse an outer gradient far larger than the fragment's recent ones; the ratio checked."""
        history = self.norms[p]
        if len(history) < NORM_WARMUP:
            return None
        median = float(np.median(history))
        ratio = norm / median if median > 0 else 0.0
        self.max_ratio_seen = max(self.max_ratio_seen, ratio)
        bound = self.max_norm_ratio
        if bound is not None and ratio > bound:
            log.warning("refused an outlier from %s: fragment %d norm %.3g is %.1fx the median", learner, p, norm, ratio)
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"outer gradient of fragment {p} has norm {norm:.3g}, {ratio:.1f}x the median of its last "
                          f"{len(history)} accepted ({median:.3g}; spec.syncer.maxNormRatio {bound:g}); "
                          "re-sync from the global model", "outlier")
        return ratio

    def taken(self, origin: tuple[str, int], push_id: int, *, p: int, norm: float, merged_into: int) -> None:
        """Record an accepted push: its norm joins the statistic, its id answers retries."""
        self.norms[p].append(norm)
        if push_id:
            seen = self.accepted.setdefault(origin, OrderedDict())
            seen[push_id] = merged_into
            while len(seen) > 4 * self.num_fragments:
                seen.popitem(last=False)
