"""A learner (re)joining: the checks its model passes, its session and the global model it
starts from (Join), and the optimizer state a peer may share with it (ShareState).

The checks and the Join's reply; the syncer core runs them holding its lock where they say so.
"""

from __future__ import annotations

import grpc

from diloco import copy_listings
from diloco.core.codecs import Pieces
from diloco.spec import Syncer as SyncerSpec
from diloco.syncer.acceptance import MAX_ID, Refused
from diloco.syncer.counter_bounds import SLACK_CYCLES
from diloco.syncer.global_model import GlobalModel
from diloco.wire import pb


def check_join(model: GlobalModel, request: pb.JoinRequest) -> None:
    """Raise Refused (not counted as a refused push) if a joining learner's model is not this job's."""
    if not request.learner or len(request.learner) > MAX_ID:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "learner id must be 1-128 characters", "")
    if {t.name: tuple(t.shape) for t in request.tensors} != model.shapes():
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                      "the learner's model does not match the syncer's (different spec.model?)", "")
    if request.init_hash and model.init_hash and request.init_hash != model.init_hash:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "the learner's initial model Θ₀ differs from the one the "
                      "syncer was seeded with (different spec.model or spec.data.seed?)", "")


def data_listing(request: pb.JoinRequest) -> copy_listings.Listing | None:
    """The joining learner's listing of its data copy, validated (a malformed one is refused);
    None where it sent none (the builtin corpus, or a learner older than the check). Outside the
    lock: 10,000 names take tens of milliseconds to check."""
    if not request.HasField("data"):
        return None
    try:
        return copy_listings.from_pb(request.data)
    except copy_listings.ListingError as exc:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{exc} (learner {request.learner!r})", "") from None


def admit_data(model: GlobalModel, listing: copy_listings.Listing | None, learner: str) -> None:
    """Keep the first admitted listing (in the model and its checkpoint) and refuse a learner
    whose copy of the data holds other files or sizes. Call under the core's lock."""
    if listing is None:
        return
    if model.data_listing is None:
        model.data_listing = (listing, f"learner {learner}")
        return
    kept, by = model.data_listing
    if (found := copy_listings.difference(kept, listing, by)) is not None:
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"learner {learner}'s data: {found[1]} "
                      "(spec.data.source.path, learnerGroups[].data)", "")


def check_data(model: GlobalModel, request: pb.JoinRequest) -> None:
    """`data_listing` then `admit_data`: a Join's data check, the state unchanged if refused."""
    admit_data(model, data_listing(request), request.learner)


def join_header(model: GlobalModel, spec: SyncerSpec, view: tuple[dict[int, int], Pieces, dict[int, bytes]], *,
                incarnation: str, shard: int, learner: str, secret: bytes, slot: int, job_tokens: int) -> pb.JoinHeader:
    """A Join's reply header over the global model as every subscriber holds it (`view`: the
    publisher's snapshot), so the learner's subscription continues the shared delta chain."""
    held, blob, tagged = view
    num = model.plan.num_fragments
    return pb.JoinHeader(
        incarnation=incarnation, versions=[held.get(p, 0) for p in range(num)], total_bytes=blob.size,
        fragments=[pb.FragmentNames(names=list(f)) for f in model.plan.fragments],
        codec=spec.compression, block_size=spec.block_size, slot=slot, tags=[tagged.get(p, b"") for p in range(num)],
        session_secret=secret, shard=shard, shards=spec.shards,
        tokens_merged=model.credits.credited_to(learner), job_tokens=job_tokens,
    )


def check_state_size(header: pb.StateHeader, max_state_bytes: int) -> None:
    """A donor's optimizer-state upload must be one to `max_state_bytes` (two moments of this model)."""
    if not 0 < header.total_bytes <= max_state_bytes:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"optimizer state of {header.total_bytes} bytes: "
                      f"expected 1 to {max_state_bytes} (two moments of this model)")


def check_state_count(header: pb.StateHeader, job_tokens: int, tokens_per_step: int, cycle: int) -> None:
    """A donor's AdamW step count, which sets the joiner's bias correction, must lie within the
    steps the job's accepted pushes vouch for (`job_tokens`); not the donor's own: a
    re-admitted learner carries on the count of the peer whose moments it adopted."""
    bound = job_tokens // max(tokens_per_step, 1) + SLACK_CYCLES * cycle
    if not 0 < (count := int(header.count)) <= bound:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"optimizer state at step {count}: the job's learners have trained at most {bound} steps "
                      f"as their pushes report (learner {header.learner!r})", "counters")
