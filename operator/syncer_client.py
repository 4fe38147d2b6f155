"""The operator's view of a syncer: one Status RPC per timer tick, with a short deadline.

Channels are cached per job and target (gRPC reconnects by itself) and closed when the job
goes. A syncer that does not answer is not an error here: the caller gets the gRPC
status code's name, so the job status can tell a refused token (UNAUTHENTICATED) from a
syncer that is not there yet (UNAVAILABLE).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from diloco.contract import ALTERNATE, REFUSED_WITHOUT_WORK
from diloco.operator.status.job import RegionView, SyncerView

log = logging.getLogger("diloco.operator")
TIMEOUT = 3.0



@dataclass(frozen=True)
class Target:
    """A syncer as the operator dials it: address (one per shard, comma-separated), the job token
    and, for TLS, CA and name (one for every shard, or one per shard, comma-separated)."""

    address: str
    token: str
    ca: bytes | None = None
    server_name: str | None = None


ChannelKey = tuple[str, str, str, bytes | None, str | None]  # namespace, job, address, CA, server name


class SyncerClients:
    def __init__(self) -> None:
        self._channels: dict[ChannelKey, Any] = {}
        self._lock = threading.Lock()

    def _channel(self, key: ChannelKey) -> Any:
        from diloco.wire import channel as open_channel

        _, _, address, ca, server_name = key
        with self._lock:
            channel = self._channels.get(key)
            if channel is None:
                channel = self._channels[key] = open_channel(address, ca, server_name)
        return channel

    def status(self, namespace: str, job: str, target: Target) -> tuple[SyncerView | None, str]:
        """The syncer's view and "", or None and the gRPC status code's name."""
        import grpc

        from diloco.shards import aggregate, server_names, syncer_addresses
        from diloco.wire import auth_metadata, pb, rpc

        replies = []
        addresses = syncer_addresses(target.address)  # every shard of a sharded syncer, in order
        # Each shard checked for its own name (shard-<i>.<host>), or every one for the one name;
        # a shard whose standby runs in another cluster is asked at either syncer (a|b), in turn.
        for shard, name in zip(addresses, server_names(target.server_name, addresses), strict=True):
            code = ""
            for address in shard.split(ALTERNATE):
                channel = self._channel((namespace, job, address, target.ca, name))
                try:
                    replies.append(rpc.SyncerStub(channel).Status(
                        pb.StatusRequest(), metadata=auth_metadata(target.token), timeout=TIMEOUT))
                    break
                except grpc.RpcError as exc:
                    log.debug("syncer %s: Status failed: %s", address, exc.code())
                    code = exc.code().name
            else:
                return None, code
        reply = aggregate(replies)
        regions = tuple(RegionView(region=r.region, learners=int(r.learners), active_learners=int(r.active_learners),
                                   tokens_merged=int(r.tokens_merged), bytes_received=int(r.bytes_received),
                                   contributions=int(r.contributions), mean_staleness=float(r.mean_staleness),
                                   step_seconds=float(r.step_seconds))
                        for r in reply.regions)
        return SyncerView(
            incarnation=reply.incarnation,
            outer_version=int(sum(reply.versions)),
            tokens_merged=int(reply.tokens_merged),
            active_learners=int(reply.active_learners),
            readmissions=int(sum(max(0, ls.joins - 1) for ls in reply.learners)),
            regions=regions,
            refused=int(sum(n for outcome, n in reply.refused_by_outcome.items() if outcome not in REFUSED_WITHOUT_WORK)),
        ), ""

    def forget(self, namespace: str, job: str) -> None:
        """Close the job's channels (a changed address or CA leaves the old one open until then)."""
        with self._lock:
            gone = [self._channels.pop(k) for k in [k for k in self._channels if k[:2] == (namespace, job)]]
        for channel in gone:
            channel.close()

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
