"""What a syncer checkpoint's metadata holds beyond Θ, its momentum and its versions, read and
checked: a malformed value refuses the checkpoint rather than starting a job on it.

The global model (syncer/global_model.py `GlobalModel.from_state`) checks what it must hold itself
(tensors, plan, shard, versions, momentum) and takes the rest from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from diloco import copy_listings
from diloco.core.rounds import checked_schedule
from diloco.syncer import provenance
from diloco.syncer.credits import TokenCredits


@dataclass(frozen=True)
class StoredMeta:
    tokens_merged: int
    outer_steps: int
    credits: TokenCredits
    schedule: dict[str, object]  # the round book's, as checkpointed
    init_hash: bytes  # empty: a checkpoint older than seeding
    data_listing: tuple[copy_listings.Listing, str] | None  # None: older than the check, or no learner with files yet
    publish_key: bytes | None  # None: a checkpoint older than provenance tags (keep a fresh key)


def read_meta(meta: Mapping[str, object], num_fragments: int) -> StoredMeta:
    """The checkpoint's counts, schedule, Θ₀ fingerprint, data listing and provenance key, each checked."""
    for key in ("tokens_merged", "outer_steps"):
        value = meta.get(key, 0)
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"checkpoint {key} is malformed")
    tokens_merged, outer_steps = meta.get("tokens_merged", 0), meta.get("outer_steps", 0)
    assert isinstance(tokens_merged, int) and isinstance(outer_steps, int)  # checked above
    credits = TokenCredits.from_meta(meta)
    schedule = meta.get("schedule", {})
    checked_schedule(schedule, num_fragments)
    init_hash = meta.get("init_hash", "")
    if not isinstance(init_hash, str) or len(init_hash) not in (0, 64):
        raise ValueError("checkpoint init_hash is malformed")
    listing = meta.get("data_listing")
    if listing is not None and not isinstance(listing, Mapping):
        raise ValueError("checkpoint data_listing is malformed")
    return StoredMeta(tokens_merged, outer_steps, credits, dict(schedule), bytes.fromhex(init_hash),  # type: ignore[call-overload]
                      copy_listings.from_dict(listing) if listing is not None else None, _publish_key(meta.get("publish_key")))


def _publish_key(stored: object) -> bytes | None:
    if stored is None:
        return None
    if not isinstance(stored, str) or len(stored) != 2 * provenance.KEY_BYTES:
        raise ValueError("checkpoint publish_key is malformed")
    try:
        return bytes.fromhex(stored)
    except ValueError:
        raise ValueError("checkpoint publish_key is malformed") from None


def checkpoint_shapes(meta: Mapping[str, object], held: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape as the checkpoint recorded it; an older one, which did not, holds all
    its tensors (unsharded) and its arrays say."""
    shapes = meta.get("shapes")
    if shapes is None:
        if meta.get("owned") is not None:
            raise ValueError("this shard's checkpoint predates recorded shapes; restore it with a syncer "
                             "of the release that wrote it, or start the job afresh")
        return dict(held)
    if not isinstance(shapes, dict) or any(
            not isinstance(k, str) or not isinstance(v, list) or not all(isinstance(d, int) and d > 0 for d in v)
            for k, v in shapes.items()):
        raise ValueError("checkpoint shapes are malformed")
    return {k: tuple(v) for k, v in shapes.items()}
