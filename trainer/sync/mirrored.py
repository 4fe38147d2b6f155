"""What the learner loop reads of its syncer, the same on every host of the learner.

Host 0 alone talks to the syncer (trainer/hosts.py); at every step boundary `MirroredClient`
shares what it heard through `Hosts`' collectives as typed arrays, never pickles: one int64
record of flags, counts and rows, and each published fragment's tensors as one int32 vector
laid out by the fragment plan every host holds.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from diloco.core.codecs import CODECS
from diloco.core.ledger import Arrival, Push
from diloco.trainer.hosts import Hosts, fits
from diloco.trainer.sync.link import LearnerLink, SyncerLink
from diloco.trainer.sync.messages import JoinRefused, JoinState, Unauthenticated, Updates

if TYPE_CHECKING:
    from diloco.core.seed import InitialModel


def _words(text: str) -> list[int]:
    raw = text.encode()
    return np.frombuffer(raw + bytes(-len(raw) % 8), "<i8").tolist()


def _text(words: Sequence[int], size: int) -> str:
    return np.asarray(words, "<i8").tobytes()[:size].decode()


# Step-boundary flags (host 0's), bit by bit.
STOPPING, RESYNC, STOP, SHARE_STATE, REJOINED, MALFORMED = (1 << i for i in range(6))
# What a shared join brings: a state, or one of the refusals every host raises alike.
STATE, UNAUTHENTICATED, JOIN_REFUSED, FAILED, UNFIT = range(5)


class MirroredClient:
    """What the learner loop uses of a syncer client (trainer/sync/link.py, `LearnerLink`), identical
    on every host. Host 0 holds the real client; at each `take_updates` it shares the updates
    and its stop flags, and the loop reads only those snapshots, so every host breaks out at
    the same step. `fragments` and `shapes` are the fragment plan and the model's shapes, which
    every host holds: they give the shared tensors their layout."""

    # Positional, not keyword-only: tests/trainer/test_hosts.py and bench/multihost_share.py pass all five.
    # The defaults suit one host, which shares nothing and so needs no layout; `shapes` left out
    # is taken from the join's.
    def __init__(self, hosts: Hosts, client: SyncerLink | None, stop: threading.Event, *,
                 fragments: Sequence[Sequence[str]] = (), shapes: Mapping[str, Sequence[int]] | None = None) -> None:
        self.hosts, self.client, self._stop = hosts, client, stop
        self.fragments = [list(f) for f in fragments]
        self.shapes = {n: tuple(int(d) for d in s) for n, s in (shapes or {}).items()}
        self.stopping = threading.Event()  # snapshot of: the syncer refused us for good
        self.resync = threading.Event()  # snapshot of: a push was refused as malformed
        self.stop_requested = False  # snapshot of host 0's SIGTERM

    def layout(self, p: int) -> list[tuple[str, tuple[int, ...]]]:
        return [(n, self.shapes[n]) for n in self.fragments[p]]

    def _fits(self, p: int, tensors: Mapping[str, Any]) -> bool:
        return 0 <= p < len(self.fragments) and all(n in self.shapes for n in self.fragments[p]) \
            and fits(tensors, self.layout(p))

    def _fragment(self, p: int, tensors: Mapping[str, Any] | None) -> dict[str, np.ndarray]:
        return self.hosts.share_tensors(tensors, self.layout(p))

    # -- the join (and a syncer shard's re-join): rare, but typed as well -----------------

    def _share_state(self, state: JoinState | BaseException | None) -> JoinState:
        """Host 0's join result on every host: a state, or the same refusal raised on each."""
        ints: list[int] | None = None
        if self.hosts.leader:
            if isinstance(state, BaseException):
                kinds: dict[type[BaseException], int] = {Unauthenticated: UNAUTHENTICATED, JoinRefused: JOIN_REFUSED}
                kind = kinds.get(type(state), FAILED)
                message = str(state) if kind != FAILED else f"host 0: {type(state).__name__}: {state}"
                ints = [kind, len(message.encode())] + _words(message)
            else:
                assert state is not None
                same = state.fragments == self.fragments  # else the learner ends on every host
                owned = [int(p) for p in state.owned]
                unfit = same and ({n for p in owned for n in self.fragments[p]} != set(state.params)
                                  or not all(self._fits(p, {n: state.params[n] for n in self.fragments[p]})
                                             for p in owned))
                if unfit:
                    ints = [UNFIT, 0]
                else:
                    ints = [STATE, len(state.incarnation.encode()), int(same), CODECS.index(state.codec),
                            state.block_size, state.slot, state.shard, state.shards, state.tokens_merged,
                            state.job_tokens, len(owned), len(state.versions), *owned, *state.versions,
                            *_words(state.incarnation)]
        record = self.hosts.share_ints(ints)
        kind, size = record[0], record[1]
        if kind != STATE:
            if self.hosts.leader:
                if isinstance(state, BaseException):
                    raise state
                raise RuntimeError("host 0's join state does not fit the fragment plan and the model's shapes")
            message = _text(record[2:], size) if kind != UNFIT else \
                "host 0's join state does not fit the fragment plan and the model's shapes"
            raise {UNAUTHENTICATED: Unauthenticated, JOIN_REFUSED: JoinRefused}.get(kind, RuntimeError)(message)
        plan, codec, block_size, slot, shard, shards, merged, job, n_owned, n_versions = record[2:12]
        owned = record[12:12 + n_owned]
        versions = record[12 + n_owned:12 + n_owned + n_versions]
        incarnation = _text(record[12 + n_owned + n_versions:], size)
        params: dict[str, np.ndarray] = {}
        if plan:
            for p in owned:
                params.update(self._fragment(p, state.params if isinstance(state, JoinState) else None))
        if isinstance(state, JoinState):
            return dataclasses.replace(state, params=params)
        return JoinState(incarnation=incarnation, versions=versions, fragments=[list(f) for f in self.fragments]
                         if plan else [], params=params, codec=CODECS[codec], block_size=block_size, slot=slot,
                         owned=owned, shard=shard, shards=shards, tokens_merged=merged, job_tokens=job)

    def join_with_retry(self, shapes: dict[str, tuple[int, ...]], initial: InitialModel | None = None) -> JoinState:
        if self.hosts.count == 1:
            assert self.client is not None
            return self.client.join_with_retry(shapes, initial)
        self.shapes = self.shapes or {n: tuple(s) for n, s in shapes.items()}
        result: JoinState | BaseException | None = None
        if self.client is not None:
            try:
                result = self.client.join_with_retry(shapes, initial)
            except Exception as exc:  # shared, so every host fails the same way
                result = exc
        return self._share_state(result)

    def start(self) -> None:
        if self.client is not None:
            self.client.start()

    def submit(self, item: Push) -> None:
        if self.client is not None:  # the other hosts computed the same push; host 0 sends it
            self.client.submit(item)

    # -- every step boundary ----------------------------------------------------------------

    def _record(self, u: Updates, stopping: bool, resync: bool, stop: bool) -> list[int]:
        """Host 0's step-boundary news as int64 words: flags, counts, then the rows."""
        flags = (STOPPING * stopping) | (RESYNC * resync) | (STOP * stop) | (SHARE_STATE * u.share_state) \
            | (REJOINED * (u.rejoined is not None))
        if not all(self._fits(p, a.tensors) for p, a in u.published.items()):
            return [flags | MALFORMED, 0, 0, 0]
        rows = [x for p, a in u.published.items() for x in (p, a.version, a.next_slot, a.job_tokens)]
        rows += [int(x) for a in u.accepted for x in a] + [x for r in u.refused for x in r]
        return [flags, len(u.published), len(u.accepted), len(u.refused), *rows]

    def take_updates(self) -> Updates:
        mine = None
        if self.client is not None:
            mine = self.client.take_updates()
            stopping, resync, stop = self.client.stopping.is_set(), self.client.resync.is_set(), self._stop.is_set()
        if self.hosts.count == 1:
            assert mine is not None
            updates = mine
        else:
            record = self.hosts.share_ints(self._record(mine, stopping, resync, stop) if mine is not None else None)
            flags, n_pub, n_acc, n_ref = record[:4]
            if flags & MALFORMED:
                raise RuntimeError("host 0 got a published fragment that does not fit the fragment plan")
            at = 4
            published = {}
            for _ in range(n_pub):
                p, version, next_slot, job_tokens = record[at:at + 4]
                at += 4
                tensors = self._fragment(p, mine.published[p].tensors if mine is not None else None)
                published[p] = Arrival(version, tensors, next_slot, job_tokens)
            accepted = [(p, push_id, into, bool(late)) for p, push_id, into, late in
                        (record[at + 4 * i:at + 4 * i + 4] for i in range(n_acc))]
            at += 4 * n_acc
            refused = [(p, push_id) for p, push_id in (record[at + 2 * i:at + 2 * i + 2] for i in range(n_ref))]
            rejoined = self._share_state(mine.rejoined if mine is not None else None) if flags & REJOINED else None
            updates = Updates(rejoined, published, accepted, refused, bool(flags & SHARE_STATE))
            stopping, resync, stop = bool(flags & STOPPING), bool(flags & RESYNC), bool(flags & STOP)
        for event, flag in ((self.stopping, stopping), (self.resync, resync)):
            event.set() if flag else event.clear()
        self.stop_requested = stop
        return updates

    def clear_resync(self) -> None:
        self.resync.clear()
        if self.client is not None:
            self.client.resync.clear()

    def until(self, deadline: float) -> bool:
        """Whether host 0 is still before `deadline` (monotonic) and not refused: one answer for all."""
        go = self.client is not None and time.monotonic() < deadline and not self.client.stopping.is_set()
        return self.hosts.share_flags(go)[0]

    def wait_for_news(self, timeout: float) -> None:
        if self.client is not None:
            self.client.wait_for_news(timeout)

    def flush(self, timeout: float) -> bool:
        return self.hosts.share_flags(bool(self.client.flush(timeout)) if self.client is not None else False)[0]

    def close(self) -> None:
        if self.client is not None:
            self.client.close()

    def _counter(self, name: str) -> Any:
        return getattr(self.client, name) if self.client is not None else 0

    @property
    def bytes_sent(self) -> int:
        return int(self._counter("bytes_sent"))

    @property
    def bytes_received(self) -> int:
        return int(self._counter("bytes_received"))

    @property
    def acked_train_seconds(self) -> float:
        return float(self._counter("acked_train_seconds"))


_conforms: type[LearnerLink] = MirroredClient  # mypy fails here when the class drifts from its protocol
