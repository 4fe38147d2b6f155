"""A learner's connection to a sharded syncer (spec.syncer.shards): one `SyncerClient` per shard.

Each shard is a whole syncer for the fragments it owns (p mod N == shard), so this only routes:
a push goes to its fragment's owner, arrivals and answers come from all of them, and the join
state is assembled fragment by fragment from the owners. When one shard restarts, only its
client re-joins, and the loop rebases only that shard's fragments (`JoinState.owned`); the other
shards never notice.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

from diloco.core.fragments import owner
from diloco.core.ledger import Push
from diloco.core.seed import InitialModel
from diloco.trainer.sync.client import JoinState, SyncerClient, Updates
from diloco.trainer.sync.link import SyncerLink


class ShardedClient:
    """The `SyncerClient` interface the learner loop uses, over every shard of the syncer."""

    def __init__(self, addresses: Sequence[str], make: Callable[[str], SyncerClient]):
        self.shards = [make(a) for a in addresses]
        self.stopping = threading.Event()  # shared: a fatal refusal by any shard stops the learner
        self.resync = threading.Event()  # shared: a push refused as malformed resets all our weights
        for i, c in enumerate(self.shards):
            c.stopping, c.resync, c.position = self.stopping, self.resync, (i, len(self.shards))
        # Per shard, the incarnation whose state the loop has adopted: a push made before the
        # loop rebased onto a restarted shard is against the old anchors, and is dropped.
        self.adopted = [""] * len(self.shards)

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in self.shards)

    @property
    def bytes_received(self) -> int:
        return sum(c.bytes_received for c in self.shards)

    @property
    def acked_train_seconds(self) -> float:
        """Training time every shard has acknowledged progress of."""
        return min(c.acked_train_seconds for c in self.shards)

    def join_with_retry(self, shapes: dict[str, tuple[int, ...]], initial: InitialModel | None = None) -> JoinState:
        states = [c.join_with_retry(shapes, initial) for c in self.shards]
        n = len(states)
        for i, st in enumerate(states):
            if (st.shard, st.shards) != (i, n):
                raise RuntimeError(f"the syncer at --syncer position {i} is shard {st.shard} of {st.shards}, "
                                   f"not {i} of {n}: list every shard's address, in shard order")
            if (st.codec, st.block_size, st.fragments) != (states[0].codec, states[0].block_size, states[0].fragments):
                raise RuntimeError(f"syncer shards 0 and {i} run different specs (codec, block size or fragments)")
        self.adopted = [st.incarnation for st in states]
        return merge_states(states)

    def start(self) -> None:
        for c in self.shards:
            c.start()

    def submit(self, item: Push) -> None:
        s = owner(item.fragment, len(self.shards))
        self.shards[s].submit(dataclasses.replace(item, incarnation=self.adopted[s]))

    def take_updates(self) -> Updates:
        parts = [c.take_updates() for c in self.shards]
        rejoined = [(i, u.rejoined) for i, u in enumerate(parts) if u.rejoined is not None]
        for i, st in rejoined:
            self.adopted[i] = st.incarnation
        return Updates(
            rejoined=merge_states([st for _, st in rejoined]) if rejoined else None,
            published={p: a for u in parts for p, a in u.published.items()},
            accepted=[a for u in parts for a in u.accepted],
            refused=[r for u in parts for r in u.refused],
            share_state=any(u.share_state for u in parts),  # only shard 0 relays state (trainer/sync/peer_state.py)
        )

    def wait_for_news(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(c.has_news() for c in self.shards) and time.monotonic() < deadline:
            time.sleep(0.02)

    def flush(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all([c.flush(max(0.0, deadline - time.monotonic())) for c in self.shards])

    def close(self) -> None:
        for c in self.shards:
            c.close()


_conforms: type[SyncerLink] = ShardedClient  # mypy fails here when the class drifts from its protocol


def merge_states(states: Sequence[JoinState]) -> JoinState:
    """One join state from shards' (each fragment from the shard that owns it)."""
    first, n = states[0], states[0].shards
    owned = sorted(p for st in states for p in st.owned)
    by_shard = {st.shard: st for st in states}
    versions = list(first.versions)
    for p in owned:
        versions[p] = by_shard[owner(p, n)].versions[p]
    return JoinState(
        incarnation="+".join(st.incarnation for st in states), versions=versions, fragments=first.fragments,
        params={k: v for st in states for k, v in st.params.items()}, codec=first.codec,
        block_size=first.block_size, slot=max(st.slot for st in states), owned=owned, shard=0, shards=n,
        tokens_merged=max(st.tokens_merged for st in states),  # each shard credits every push it merges
        job_tokens=max(st.job_tokens for st in states),  # so does each shard's count of the job's
    )
