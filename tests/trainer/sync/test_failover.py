"""A learner given a syncer's two addresses (`a|b`, spec.syncer.standby) moves to the other one
when the one in use is unreachable, once however many threads notice, and refuses a Join from a
lease epoch below one it joined (a fenced syncer)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from diloco.trainer.sync import client as client_mod
from diloco.trainer.sync.client import SyncerClient
from diloco.trainer.sync.transport import UNREACHABLE
from diloco.wire import pb


def test_failover_moves_once_per_route_and_wraps() -> None:
    c = SyncerClient("127.0.0.1:1|127.0.0.1:2", "t" * 32, "us-0", "us")
    try:
        assert c.addresses == ["127.0.0.1:1", "127.0.0.1:2"] and c.address == "127.0.0.1:1"
        c.failover(0)
        c.failover(0)  # a second thread's notice of the same failure: nothing more
        assert (c.address, c.route) == ("127.0.0.1:2", 1)
        c.failover(1)
        assert (c.address, c.route) == ("127.0.0.1:1", 2)
    finally:
        c.close()
    single = SyncerClient("127.0.0.1:1", "t" * 32, "us-0", "us")
    try:
        single.failover(0)
        assert (single.address, single.route) == ("127.0.0.1:1", 0)  # one address: nothing to move to
    finally:
        single.close()


def test_a_call_on_the_stub_read_before_a_failover_fails_as_unreachable() -> None:
    """Another thread read the stub just before the failover: its call fails as an RpcError its
    loop handles (UNAVAILABLE), never with ValueError('Channel closed'), which killed the subscriber."""
    c = SyncerClient("127.0.0.1:1|127.0.0.1:2", "t" * 32, "us-0", "us")
    try:
        old = c.stub
        c.failover(0)
        with pytest.raises(grpc.RpcError) as err:
            old.Status(pb.StatusRequest(), timeout=5)
        assert err.value.code().name in UNREACHABLE
    finally:
        c.close()


def test_a_join_from_a_lower_lease_epoch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    c = SyncerClient("127.0.0.1:1|127.0.0.1:2", "t" * 32, "us-0", "us")
    answers = iter(["pod-b/1@3", "pod-a/2@2"])

    def join_call(client: Any, shapes: Any, timeout: float) -> tuple[Any, Any]:
        header = SimpleNamespace(incarnation=next(answers), total_bytes=0, session_secret=b"s", versions=[0],
                                 fragments=[], tags=[])
        return header, SimpleNamespace(owned=[], params={}, incarnation=header.incarnation)

    monkeypatch.setattr(client_mod, "join_call", join_call)
    try:
        assert c._join({}, 1.0).incarnation == "pod-b/1@3" and c.epoch == 3
        with pytest.raises(ConnectionError, match="fenced"):
            c._join({}, 1.0)  # epoch 2 after 3: a syncer that lost its lease
        assert c.incarnation == "pod-b/1@3"
    finally:
        c.close()
