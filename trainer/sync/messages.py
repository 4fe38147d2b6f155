"""What the learner loop and its syncer client hand each other: the joined state, the updates
gathered between step boundaries, and the two refusals that end a learner. Pushes travel as the
ledger's own record of them (diloco/core/ledger.py `Push`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from diloco.core.codecs import Codec
from diloco.core.ledger import Arrival


class Unauthenticated(RuntimeError):
    """The syncer refused the job token: retrying cannot help."""


class JoinRefused(RuntimeError):
    """The syncer will not admit this learner as it is (another model, another Θ₀): restarting cannot help."""


@dataclass
class JoinState:
    incarnation: str
    versions: list[int]
    fragments: list[list[str]]
    params: dict[str, np.ndarray]
    codec: Codec
    block_size: int
    slot: int  # the shared schedule's next slot
    # The fragments this state is for: those of the syncer shard that sent it (all when
    # unsharded); `params` holds their tensors and `versions` is meaningful for them only.
    owned: list[int]
    shard: int = 0
    shards: int = 1
    tokens_merged: int = 0  # this learner id's tokens that merges credited: where its data resumes
    job_tokens: int = 0  # the job's trained tokens: where its learning-rate schedule stands (core/schedule.py JobProgress)


@dataclass
class Updates:
    """Everything that arrived since the last step boundary."""

    rejoined: JoinState | None
    published: dict[int, Arrival]
    accepted: list[tuple[int, int, int, bool]]  # (fragment, push id, version that merges it, late)
    refused: list[tuple[int, int]]  # (fragment, push id)
    share_state: bool = False  # the syncer asks for our optimizer state: a re-joining peer waits for it

    def before(self, p: int) -> Literal["keep", "send", "drop"]:
        """What becomes of a push of fragment p that waits to be encoded (trainer/sync/fragment_sync.py,
        `Fragments.pending`) when these updates are adopted first: kept, if they leave p's books alone;
        sent first, if they change them (a publish of p, an answer about p); dropped, if a syncer
        (shard) restarted: a push against the old anchors must not reach the new one, and its
        progress, never booked, leaves with p's next push."""
        if self.rejoined is not None:
            return "drop"
        if p in self.published or any(a[0] == p for a in self.accepted) or any(r[0] == p for r in self.refused):
            return "send"
        return "keep"


@dataclass(frozen=True)
class PeerState:
    """A peer's inner-optimizer state as the syncer relayed it (trainer/sync/peer_state.py reads it)."""

    donor: str
    count: int  # AdamW's step count with these moments
    blob: bytes  # the moments, a bf16 bundle
