"""A re-joining learner takes AdamW's moments from a healthy peer (docs/ALGORITHM.md, "Re-admission").

A learner restarted mid-run pulls the global model at Join, but fresh AdamW moments make its
first steps sign steps of the full learning rate: measured in the replay harness, a kill every
~40 slots cost 10% of final loss with fresh moments and 3% with a peer's (docs/BENCHMARKS.md).
So a learner that joins mid-run asks the syncer for a peer's state in the background and keeps
training; the syncer (syncer/joins/peer_state.py) asks another learner through a push reply, which
uploads its moments at its next step boundary; the joiner adopts them at one of its own. The
moments travel as a bf16 bundle (half of fp32, and AdamW's moments need no more than bf16's
three digits). A learner of several hosts neither asks nor shares: its state is spread over
processes that do not hold each other's shards.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import jax
import numpy as np

from diloco.contract import Event
from diloco.core.codecs import CodecError, decode_tensors, encode_tensors
from diloco.trainer.sync.messages import PeerState
from diloco.wire import chunks, pb

log = logging.getLogger("diloco.learner")
FETCH_SECONDS = 30.0  # how long a joiner waits for a donor (the syncer asks a new one every 5 s)
MIN_DONOR_STEPS = 20  # younger moments are hardly better than fresh ones (β₁ = 0.9 averages ~10 steps)


def _is_count(path: Any) -> bool:
    return getattr(path[-1], "name", None) == "count"


def _leaves(state: Any) -> list[tuple[str, Any, bool]]:
    """(tree path, leaf, is AdamW's step count) for every leaf of an optimizer state."""
    return [(jax.tree_util.keystr(path), leaf, _is_count(path))
            for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]]


def _relay(client: Any) -> Any:
    """The client whose syncer relays state: the only one, or shard 0's."""
    return getattr(client, "shards", [client])[0]


def _is_moment(leaf: Any) -> bool:
    return np.ndim(leaf) >= 1 and np.issubdtype(leaf.dtype, np.floating)


def step_count(state: Any) -> int:
    return max((int(leaf) for _, leaf, is_count in _leaves(state) if is_count), default=0)


def moments(state: Any) -> dict[str, np.ndarray]:
    """AdamW's moment arrays by tree path, on the host (waits for the step in flight)."""
    return jax.device_get({name: leaf for name, leaf, _ in _leaves(state) if _is_moment(leaf)})


def adopt(state: Any, peer: PeerState) -> Any:
    """`state` with the peer's moments and step count, placed where `state`'s own are. Raises
    ValueError naming what is off when the bytes do not fit this learner's optimizer."""
    ours = {name: tuple(leaf.shape) for name, leaf, _ in _leaves(state) if _is_moment(leaf)}
    try:
        theirs = decode_tensors(peer.blob, ours)
    except CodecError as exc:
        raise ValueError(f"the peer's optimizer state does not fit ours: {exc}") from exc
    for name, values in theirs.items():
        if not np.all(np.isfinite(values)):
            raise ValueError(f"the peer's {name} is not finite")
        if ".nu" in name and np.any(values < 0):
            raise ValueError(f"the peer's second moment {name} is negative")
    if peer.count < 1:
        raise ValueError(f"the peer's step count {peer.count} is not positive")

    def take(path: Any, leaf: Any) -> Any:
        name = jax.tree_util.keystr(path)
        if name in theirs:
            return jax.device_put(theirs[name].astype(leaf.dtype), leaf.sharding)
        if _is_count(path):
            return jax.device_put(np.asarray(peer.count, leaf.dtype), leaf.sharding)
        return leaf

    return jax.tree_util.tree_map_with_path(take, state)


def fetch(client: Any, wait: float) -> PeerState | None:
    """Wait for a peer's state through the syncer (its first shard when sharded)."""
    c = _relay(client)
    request = pb.FetchStateRequest(learner=c.learner, session_secret=c.secret, wait_seconds=wait)
    header, parts = None, []
    try:
        for chunk in c.stub.FetchState(request, metadata=c.metadata, timeout=wait + 30):
            header = chunk.header if chunk.HasField("header") else header
            parts.append(chunk.data)
    except grpc.RpcError as exc:
        log.info("no peer optimizer state: %s", exc.details())
        return None
    blob = b"".join(parts)
    if header is None or len(blob) != header.total_bytes:
        log.warning("a peer's optimizer state arrived incomplete")
        return None
    c.bytes_received += len(blob)
    return PeerState(header.learner, int(header.count), blob)


def share(client: Any, count: int, blob: bytes | memoryview | None) -> None:
    """Upload our moments (None: decline, so the syncer asks another learner at once)."""
    c = _relay(client)
    header = pb.StateHeader(learner=c.learner, session_secret=c.secret, count=count,
                            total_bytes=len(blob or b""), declined=blob is None)
    msgs = [pb.StateChunk(header=header)] if blob is None else [
        pb.StateChunk(header=header if i == 0 else None, data=bytes(part)) for i, part in enumerate(chunks(blob))]
    try:
        c.stub.ShareState(iter(msgs), metadata=c.metadata, timeout=60)
        c.bytes_sent += len(blob or b"")
    except grpc.RpcError as exc:
        log.warning("sharing our optimizer state failed: %s", exc.details())


class PeerStates:
    """The learner loop's side: `start_fetch` after a mid-run join; `at_boundary` each step."""

    def __init__(self, client: Any | None, emit: Callable[..., None]) -> None:
        self.client, self.emit = client, emit  # None: a learner of several hosts (neither asks nor shares)
        self.lock = threading.Lock()
        self.received: PeerState | None = None
        self.asked_at = 0.0

    def start_fetch(self) -> None:
        if self.client is None:
            return
        self.asked_at = time.monotonic()

        def run() -> None:
            got = fetch(self.client, FETCH_SECONDS)
            with self.lock:
                self.received = got

        threading.Thread(target=run, name="peer-state", daemon=True).start()

    def at_boundary(self, state: Any, share_requested: bool) -> Any:
        """Share ours if asked; adopt a peer's if one arrived. Returns the state to train on."""
        if self.client is None:
            return state
        if share_requested:
            count = step_count(state)
            host = moments(state) if count >= MIN_DONOR_STEPS else None
            threading.Thread(target=lambda: share(self.client, count, None if host is None else encode_tensors(host, "bf16")),
                             name="share-state", daemon=True).start()
        with self.lock:
            got, self.received = self.received, None
        if got is None:
            return state
        ours = step_count(state)
        try:
            if got.count <= ours:
                raise ValueError(f"the peer's moments ({got.count} steps) are no older than ours ({ours})")
            state = adopt(state, got)
        except ValueError as exc:
            self.emit(Event.PEER_STATE, adopted=False, donor=got.donor, reason=str(exc))
            return state
        self.emit(Event.PEER_STATE, adopted=True, donor=got.donor, count=got.count, bytes=len(got.blob),
                  own_steps=ours, seconds=round(time.monotonic() - self.asked_at, 3))
        return state
