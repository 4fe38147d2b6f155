"""Θ₀'s fingerprint: the learners and the syncer must start from the same initial model.

The syncer runs no model code, so the first learner seeds it (the `Seed` RPC) and every later
learner proves at Join that its own Θ₀ is the same, tensor for tensor, by this hash over the
tensors that syncer (shard) holds: names, shapes and fp32 bytes, in name order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from diloco.core.fragments import owned_by


def seed_hash(tensors: Mapping[str, np.ndarray]) -> bytes:
    h = hashlib.sha256()
    for name in sorted(tensors):
        value = np.ascontiguousarray(tensors[name], dtype=np.float32)
        h.update(name.encode() + b"\0" + repr(tuple(value.shape)).encode() + b"\0")
        h.update(value.data)
    return h.digest()


@dataclass(frozen=True)
class InitialModel:
    """A learner's Θ₀ and the job's fragment plan: what it seeds each syncer shard with, and the
    hash it proves at Join that it starts from the same."""

    params: Mapping[str, np.ndarray]
    fragments: Sequence[Sequence[str]]
    _hashes: dict[tuple[int, int], bytes] = field(default_factory=dict, compare=False, repr=False)

    def held_by(self, shard: int, shards: int) -> dict[str, np.ndarray]:
        """The tensors of the fragments syncer shard `shard` of `shards` owns."""
        return {n: np.asarray(self.params[n], np.float32) for p in owned_by(shard, len(self.fragments), shards)
                for n in self.fragments[p]}

    def hash_for(self, shard: int, shards: int) -> bytes:
        """Computed once per shard (hashing a billion parameters takes seconds; re-joins are frequent)."""
        if (shard, shards) not in self._hashes:
            self._hashes[(shard, shards)] = seed_hash(self.held_by(shard, shards))
        return self._hashes[(shard, shards)]
