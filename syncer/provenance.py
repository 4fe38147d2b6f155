"""Provenance tags: proof that a syncer of this job published a fragment's values at a version.

Every value a learner receives (Join's exact fragments, each keyframe or delta a subscription
sends) comes with tag = BLAKE3 in keyed mode (a MAC) over the fragment, the version and the
values the learner now holds. The syncer mirrors each subscriber's copy bit for bit (error
feedback), so it can tag exactly what the learner holds, and a restarted syncer adopts a Recover
offer only if its tag verifies: a token holder can no longer replace Θ by claiming a high version.
The key is random per job and lives in the syncer's checkpoint, so tags outlive syncer restarts.

Why BLAKE3 and not HMAC-SHA256: every publish tags its whole fragment, and at a billion
parameters that is 166 MB per publish. SHA-256 hashes ~0.8-1.2 GB/s here (136 ms of the
syncer's ~0.5 s per publish, docs/BENCHMARKS.md §5); BLAKE3 ~3-4 GB/s on one core, with the
same 256-bit keyed security.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping, Sequence

import numpy as np
from blake3 import blake3

KEY_BYTES = 32  # BLAKE3's key length


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def tag(key: bytes, fragment: int, version: int, values: Mapping[str, np.ndarray], *, names: Sequence[str]) -> bytes:
    """The MAC over fragment, version, then each tensor in plan order: name, shape, fp32 bytes.
    Names and shapes are the syncer's own plan, so the encoding is unambiguous."""
    h = blake3(f"diloco-publish/{fragment}/{version}/".encode(), key=key)
    for name in names:
        a = np.ascontiguousarray(values[name], dtype="<f4")
        h.update(f"{name}:{a.shape}".encode())
        h.update(a.reshape(-1).view(np.uint8).data)
    return h.digest()


def verify(key: bytes, fragment: int, version: int, values: Mapping[str, np.ndarray], *, names: Sequence[str],
           presented: bytes) -> bool:
    return hmac.compare_digest(tag(key, fragment, version, values, names=names), presented)
