"""The operator's view of a syncer: one Status RPC per timer tick, with a short deadline.

Channels are cached per address (gRPC reconnects by itself) and closed when a job goes.
A syncer that does not answer is not an error here: the status then shows it not ready.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from diloco.operator.status import SyncerView

log = logging.getLogger("diloco.operator")
TIMEOUT = 3.0


class SyncerClients:
    def __init__(self) -> None:
        self._channels: dict[str, Any] = {}
        self._lock = threading.Lock()

    def status(self, address: str, token: str) -> SyncerView | None:
        import grpc

        from diloco.wire import GRPC_OPTIONS, auth_metadata, pb, rpc

        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        try:
            reply = rpc.SyncerStub(channel).Status(pb.StatusRequest(), metadata=auth_metadata(token),
                                                   timeout=TIMEOUT)
        except grpc.RpcError as exc:
            log.debug("syncer %s: Status failed: %s", address, exc.code())
            return None
        return SyncerView(
            incarnation=reply.incarnation,
            outer_version=int(sum(reply.versions)),
            tokens_merged=int(reply.tokens_merged),
            active_learners=int(reply.active_learners),
            readmissions=int(sum(max(0, ls.joins - 1) for ls in reply.learners)),
        )

    def forget(self, address: str) -> None:
        with self._lock:
            channel = self._channels.pop(address, None)
        if channel is not None:
            channel.close()

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
