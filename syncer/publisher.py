"""The broadcast: each (fragment, version) encoded once, for every subscriber.

The syncer keeps, per fragment, the view V_p every up-to-date learner holds. Publishing version
v of Θ_p encodes one delta, encode(Θ_p − V_p) in the broadcast codec, and advances
V_p ← V_p + decode(delta): what each learner computes from the same bytes, bit for bit, so error
feedback stays exact and one provenance tag (over V_p) serves everyone. A subscriber holding
version v − 1 gets that delta; one further behind than the chain reaches, or one that does not
know what it holds, gets a keyframe: V_p itself in fp32 (encoded once per version, on demand),
after which it follows the chain like the rest. The first release encoded and decoded every
merge once per subscriber (M² work per step); this is M times less, and no subscriber's copy
drifts from another's.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from diloco.core.codecs import Blob, Codec, Pieces, encode_delta_tensors, encode_tensors, fp32_pieces

Tensors = dict[str, np.ndarray]
CHAIN = 2  # deltas kept per fragment: a subscriber one publish behind catches up without a keyframe;
# each costs a compressed fragment of memory, and further behind a keyframe is about as cheap


@dataclass(frozen=True)
class Edition:
    """One published version of a fragment: the bytes that take V_p from version − 1 to version."""

    version: int
    slot: int
    delta: Blob
    tag: bytes


@dataclass(frozen=True)
class Update:
    """One message of a subscription: a delta (applied to what the subscriber holds) or a keyframe."""

    fragment: int
    version: int
    blob: Blob
    is_delta: bool
    slot: int
    tag: bytes


@dataclass
class _Head:
    version: int
    slot: int
    view: Tensors  # V_p: replaced, never mutated, so a reference taken under the lock is a snapshot
    tag: bytes
    chain: deque[Edition]
    keyframe: Blob | None = None  # fp32 of `view`, encoded when a subscriber first needs it


class Publisher:
    """Per fragment this syncer (shard) owns, the broadcast view, its delta chain and its
    keyframe; subscribers wait on `cond` for a version newer than theirs. Knows nothing of
    rounds or admission."""

    def __init__(self, codec: Codec, block_size: int, tagger: Callable[[int, int, Mapping[str, np.ndarray]], bytes]):
        self.codec, self.block_size, self.tagger = codec, block_size, tagger
        self.cond = threading.Condition()
        self.heads: dict[int, _Head] = {}  # by fragment, in order: the fragments this syncer publishes
        self.stopping = False

    def reset(self, p: int, version: int, values: Mapping[str, np.ndarray], slot: int = -1) -> None:
        """Make `values` (exact, fp32) fragment p's view at `version`, dropping its chain: at start,
        and when Θ_p is replaced outright (Recover). Subscribers behind it get a keyframe."""
        view = {n: np.array(v, np.float32) for n, v in values.items()}
        head = _Head(version, slot, view, self.tagger(p, version, view), deque(maxlen=CHAIN))
        with self.cond:
            self.heads[p] = head
            self.cond.notify_all()

    def publish(self, p: int, version: int, values: Mapping[str, np.ndarray], slot: int) -> None:
        """Θ_p at `version` is final: encode its delta against the view once, advance the view.
        The encode runs outside the lock, so subscribers keep streaming meanwhile; only the merge
        thread publishes."""
        with self.cond:
            prev = self.heads[p]
        if self.codec == "fp32":  # every message a keyframe of Θ_p itself
            self.reset(p, version, values, slot)
            return
        delta, view = encode_delta_tensors(values, prev.view, self.codec, self.block_size)  # one fused pass
        tag = self.tagger(p, version, view)
        with self.cond:
            head = self.heads[p]
            if head is not prev:  # replaced meanwhile (Recover): that view wins, this publish is moot
                return
            head.chain.append(Edition(version, slot, delta, tag))
            self.heads[p] = _Head(version, slot, view, tag, head.chain)
            self.cond.notify_all()

    def snapshot(self) -> tuple[dict[int, int], Pieces, dict[int, bytes]]:
        """What a joining learner receives exactly: per fragment published here its version and
        tag, and V of them all (fp32), read from the views themselves as it is sent (they are
        replaced, never mutated, so these references stay this snapshot)."""
        with self.cond:
            heads = dict(self.heads)
        views = {n: v for head in heads.values() for n, v in head.view.items()}
        return {p: h.version for p, h in heads.items()}, fp32_pieces(views), {p: h.tag for p, h in heads.items()}

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    def updates(self, known: list[int], exact: bool, alive: Callable[[], bool]) -> Iterator[Update]:
        """A subscription: yield each update the subscriber lacks, in version order per fragment.
        With `exact` it holds V_p at `known[p]` (it joined and received nothing since)."""
        held: dict[int, int] = {}
        if exact:
            held = {p: v for p, v in enumerate(known) if p in self.heads}
        while alive() and not self.stopping:
            with self.cond:
                todo = [self._catch_up(p, held.get(p)) for p, head in self.heads.items()
                        if p not in held or held[p] < head.version]
                if not todo:
                    self.cond.wait(timeout=1.0)
                    continue
            for messages in todo:
                for message in messages:
                    held[message.fragment] = message.version
                    yield message

    def _catch_up(self, p: int, held: int | None) -> list[Update]:
        """The deltas from `held` to the head if the chain still has them, else a keyframe
        (caller holds the lock)."""
        head = self.heads[p]
        if held is not None and held >= head.version - len(head.chain):
            wanted = [e for e in head.chain if e.version > held]
            if len(wanted) == head.version - held:
                return [Update(p, e.version, e.delta, True, e.slot, e.tag) for e in wanted]
        if head.keyframe is None:
            head.keyframe = encode_tensors(head.view, "fp32")
        return [Update(p, head.version, head.keyframe, False, head.slot, head.tag)]
