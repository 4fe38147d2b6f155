"""Provenance tags: proof that a syncer of this job published a fragment's values at a version.

Every value a learner receives (Join's exact fragments, each keyframe or delta a subscription
sends) comes with tag = HMAC-SHA256(key, fragment, version, digest of the values the learner
now holds). The syncer mirrors each subscriber's copy bit for bit (error feedback), so it can
tag exactly what the learner holds, and a restarted syncer adopts a Recover offer only if its
tag verifies: a token holder can no longer replace Θ by claiming a high version. The key is
random per job and lives in the syncer's checkpoint, so tags outlive syncer restarts.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping, Sequence

import numpy as np

KEY_BYTES = 32  # HMAC-SHA256's block-size-independent key strength


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def digest(values: Mapping[str, np.ndarray], names: Sequence[str]) -> bytes:
    """SHA-256 over the fragment's tensors in plan order: name, shape and fp32 bytes of each."""
    h = hashlib.sha256()
    for name in names:
        a = np.ascontiguousarray(values[name], dtype="<f4")
        h.update(f"{name}:{a.shape}".encode())
        h.update(a.data)
    return h.digest()


def tag(key: bytes, fragment: int, version: int, values: Mapping[str, np.ndarray], names: Sequence[str]) -> bytes:
    message = f"diloco-publish/{fragment}/{version}/".encode() + digest(values, names)
    return hmac.new(key, message, hashlib.sha256).digest()


def verify(key: bytes, fragment: int, version: int, values: Mapping[str, np.ndarray], names: Sequence[str],
           presented: bytes) -> bool:
    return hmac.compare_digest(tag(key, fragment, version, values, names), presented)
