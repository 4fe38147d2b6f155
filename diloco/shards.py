"""A sharded syncer seen as one (spec.syncer.shards): addresses, and one status from N.

Shard s owns fragment p when p mod N == s (`diloco.core.fragments.owner`); each shard is a
whole syncer for its fragments. Learners, `diloco status`, the local runner and the operator
see the job's syncer through these functions, so they agree on what the shards add up to.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from diloco.contract import SHARD_INCARNATIONS
from diloco.core.fragments import owner
from diloco.wire import pb


def syncer_addresses(arg: str) -> list[str]:
    """`--syncer host:port[,host:port...]`: one address per shard, in shard order."""
    addresses = [a.strip() for a in arg.split(",")]
    if not addresses or any(not a or ":" not in a for a in addresses):
        raise ValueError(f"--syncer {arg!r}: expected host:port, or one host:port per syncer shard, comma-separated")
    return addresses


def server_names(arg: str | None, addresses: Sequence[str]) -> list[str | None]:
    """`--tls-server-name` per `--syncer` address: none, one name for every shard, or one per
    address, comma-separated in the same order (a sharded syncer exposed as shard-<i>.<host>
    and dialled inside its cluster by its pods' names)."""
    if arg is None:
        return [None] * len(addresses)
    names = [x.strip() for x in arg.split(",")]
    if any(not x for x in names):
        raise ValueError(f"--tls-server-name {arg!r}: expected a name, or one name per --syncer address, "
                         "comma-separated")
    if len(names) == 1:
        return [names[0]] * len(addresses)
    if len(names) != len(addresses):
        raise ValueError(f"--tls-server-name {arg!r}: {len(names)} names for {len(addresses)} --syncer addresses; "
                         "give one name for every shard, or one per --syncer address, in the same order")
    return list(names)


def aggregate(replies: Sequence[pb.StatusReply]) -> pb.StatusReply:
    """The job's syncer status from every shard's, in shard order. Per fragment the owner's
    version; counts of work summed (each shard does its own); tokens merged is the largest
    (every learner pushes to every shard, and each shard credits a token at its first merge
    after it, as one syncer does at its first merge of any fragment); the incarnation changes
    when any shard restarts."""
    if len(replies) == 1:
        return replies[0]
    n = len(replies)
    unseeded = any(r.unseeded for r in replies)
    versions = [replies[owner(p, n)].versions[p] for p in range(len(replies[0].versions))]
    learners: dict[str, pb.LearnerStatus] = {}
    for r in replies:
        for ls in r.learners:
            got = learners.setdefault(ls.learner, pb.LearnerStatus(learner=ls.learner, region=ls.region,
                                                                   seconds_since_seen=ls.seconds_since_seen, loss=ls.loss))
            got.joins = max(got.joins, ls.joins)
            got.contributions += ls.contributions
            got.tokens_merged = max(got.tokens_merged, ls.tokens_merged)
            got.tokens_trained = max(got.tokens_trained, ls.tokens_trained)  # each shard sees the pushes it owns
            got.bytes_received += ls.bytes_received
            if ls.seconds_since_seen < got.seconds_since_seen:
                got.seconds_since_seen, got.loss = ls.seconds_since_seen, ls.loss
    regions: dict[str, pb.RegionStatus] = {}
    for r in replies:
        for rs in r.regions:
            got_r = regions.setdefault(rs.region, pb.RegionStatus(region=rs.region))
            got_r.learners = max(got_r.learners, rs.learners)
            got_r.active_learners = max(got_r.active_learners, rs.active_learners)
            got_r.tokens_merged = max(got_r.tokens_merged, rs.tokens_merged)
            got_r.bytes_received += rs.bytes_received
            got_r.mean_staleness += rs.mean_staleness * rs.contributions  # a sum until divided below
            got_r.contributions += rs.contributions
            got_r.step_seconds = max(got_r.step_seconds, rs.step_seconds)  # every shard hears every learner
    for got_r in regions.values():
        got_r.mean_staleness = got_r.mean_staleness / got_r.contributions if got_r.contributions else 0.0
    return pb.StatusReply(
        incarnation=SHARD_INCARNATIONS.join(r.incarnation for r in replies), versions=versions,
        outer_steps=sum(r.outer_steps for r in replies), tokens_merged=max(r.tokens_merged for r in replies),
        active_learners=max(r.active_learners for r in replies), learners=[learners[k] for k in sorted(learners)],
        seconds_since_publish=min(r.seconds_since_publish for r in replies),
        checkpoint_version=sum(r.checkpoint_version for r in replies),
        grace_seconds=max(r.grace_seconds for r in replies), step_seconds=max(r.step_seconds for r in replies),
        contributions_refused=sum(r.contributions_refused for r in replies),
        bytes_received=sum(r.bytes_received for r in replies), bytes_sent=sum(r.bytes_sent for r in replies),
        regions=[regions[k] for k in sorted(regions)], max_norm_ratio=max(r.max_norm_ratio for r in replies),
        max_steps_ratio=max(r.max_steps_ratio for r in replies),
        refused_by_outcome=dict(sum((Counter(dict(r.refused_by_outcome)) for r in replies), Counter())),
        shard=0, shards=n, unseeded=unseeded,
    )


def syncer_name(shard: int, shards: int) -> str:
    """A shard's process name (local runner) and log name: `syncer` when unsharded."""
    return "syncer" if shards == 1 else f"syncer-{shard}"


def checkpoint_dir(base: str, shard: int, shards: int) -> str:
    """Each shard checkpoints its own fragments in its own directory (base itself when unsharded)."""
    return base if shards == 1 else f"{base}/shard-{shard}"
