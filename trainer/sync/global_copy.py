"""Our copy of the global model as one syncer (shard) sent it: the join's tensors, then each
published fragment's keyframe or delta applied to it (trainer/sync/client.py's subscriber).

Arrays are replaced, never mutated in place once handed out. The copy is also what we offer a
restarted syncer (Recover) and what a subscription tells the syncer we hold (known versions,
and whether the copy is still exactly the join's). The caller holds its lock around every call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from diloco.core.codecs import CodecError, decode_tensors, encode_tensors
from diloco.core.ledger import Arrival
from diloco.wire import chunks, pb


@dataclass(frozen=True)
class Offer:
    view: dict[str, np.ndarray]  # the owned fragments' tensors only
    versions: list[int]
    owned: list[int]
    tags: list[bytes]


class GlobalCopy:
    def __init__(self) -> None:
        self.view: dict[str, np.ndarray] = {}
        self.exact = False  # True from a join until the first subscription uses it
        self.fragments: list[list[str]] = []
        self.owned: list[int] = []  # the fragments of the syncer (shard) we are connected to
        self.tags: list[bytes] = []  # per fragment: the provenance tag our copy came with
        self.known_versions: list[int] = []
        self.shapes: dict[str, tuple[int, ...]] = {}  # every tensor's, as the model has it

    def joined(self, header: Any, owned: list[int], params: dict[str, np.ndarray],
               shapes: dict[str, tuple[int, ...]]) -> None:
        """Start over from a join's state (its header, our fragments of it and their tensors)."""
        self.shapes = dict(shapes)
        self.known_versions = list(header.versions)
        self.fragments = [list(f.names) for f in header.fragments]
        self.owned = owned
        self.view, self.exact = dict(params), True
        self.tags = list(header.tags) + [b""] * (len(header.fragments) - len(header.tags))

    def subscription(self, learner: str, incarnation: str, secret: bytes) -> pb.SubscribeRequest:
        """What we hold, for a new subscription; after it, our copy may hold decoded deltas."""
        request = pb.SubscribeRequest(learner=learner, incarnation=incarnation, known_versions=list(self.known_versions),
                                      exact=self.exact, session_secret=secret)
        self.exact = False
        return request

    def offer(self) -> Offer | None:
        """A snapshot of the owned fragments we hold, to offer a restarted syncer (`recovery`);
        None when we hold nothing to offer."""
        if not self.view or not self.owned or len(self.known_versions) != len(self.tags):
            return None
        return Offer(dict(self.view), [self.known_versions[p] for p in self.owned], list(self.owned),
                     [self.tags[p] for p in self.owned])

    def expects(self, fragment: int) -> dict[str, tuple[int, ...]] | None:
        """The tensors of a published fragment ours to take, by name; None when it is not ours."""
        if fragment not in self.owned:
            return None
        return {n: self.shapes[n] for n in self.fragments[fragment]}

    def apply(self, msg: Any, tensors: dict[str, np.ndarray]) -> Arrival:
        """A published fragment's decoded keyframe or delta into our copy: what the loop adopts.
        Θ + δ goes into the freshly decoded δ where it is ours to write (the same bits)."""
        if msg.delta:
            tensors = {n: np.add(t, self.view[n], out=t) if t.flags.writeable else self.view[n] + t
                       for n, t in tensors.items()}
        self.view.update(tensors)
        self.known_versions[msg.fragment] = msg.version
        self.tags[msg.fragment] = msg.tag
        return Arrival(int(msg.version), tensors, int(msg.slot), int(msg.job_tokens))


def decode(blob: bytes, expect: dict[str, tuple[int, ...]], fragment: int) -> dict[str, np.ndarray]:
    """A published fragment's tensors; a malformed one breaks the stream (resubscribing gets
    fresh keyframes)."""
    try:
        return decode_tensors(blob, expect)
    except CodecError as exc:
        raise ConnectionError(f"malformed published fragment {fragment}: {exc}") from None


def recovery(learner: str, offer: Offer) -> list[pb.RecoverChunk]:
    """The Recover request of an offer (encoded outside the client's lock: it is the whole copy)."""
    blob = encode_tensors(offer.view, "fp32")
    header = pb.RecoverHeader(learner=learner, fragments=offer.owned, versions=offer.versions,
                              total_bytes=len(blob), tags=offer.tags)
    return [pb.RecoverChunk(header=header if i == 0 else None, data=bytes(part)) for i, part in enumerate(chunks(blob))]
