"""A re-joining learner's optimizer state from a healthy peer: the syncer's relay (who is asked,
when, what is dropped), the RPCs that carry it, and the learner's checks before adopting it."""

from __future__ import annotations

import threading

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco.core.codecs import encode_tensors
from diloco.spec import Training
from diloco.syncer.joins.peer_state import ASK_SECONDS, StateRelay
from diloco.trainer.recipe import optimizer
from diloco.trainer.sync import peer_state
from diloco.trainer.sync.messages import PeerState
from diloco.wire import auth_metadata, pb
from tests import syncer_harness as sh

# -- the relay (syncer/joins/peer_state.py), on an injected clock ----------------------------


def waiting(relay: StateRelay, requester: str, wait: float = 5.0) -> tuple[threading.Thread, list]:
    """A FetchState in flight: a thread blocked in `fetch`, its result in the list."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(relay.fetch(requester, wait)))
    t.start()
    for _ in range(200):
        if relay.waiting:
            break
        threading.Event().wait(0.01)
    return t, out


def test_nobody_is_asked_while_nobody_waits_and_never_the_requester_itself() -> None:
    clock = sh.FakeClock()
    relay = StateRelay(clock)
    assert not relay.should_share("b")
    t, out = waiting(relay, "a")
    assert not relay.should_share("a")  # its own push: it has nothing to give itself
    assert relay.should_share("b")
    assert not relay.should_share("c")  # one donor at a time
    assert relay.offer("b", 40, b"moments")
    t.join(5)
    assert out == [relay_donated("b", 40, b"moments")]
    assert not relay.waiting and relay.latest is None  # the copy is dropped once nobody waits


def relay_donated(donor: str, count: int, blob: bytes):
    from diloco.syncer.joins.peer_state import Donated

    return Donated(donor, count, blob)


def test_a_silent_donor_is_given_up_after_the_ask_window_and_a_declining_one_at_once() -> None:
    clock = sh.FakeClock()
    relay = StateRelay(clock)
    t, out = waiting(relay, "a")
    assert relay.should_share("b")
    clock.now += ASK_SECONDS / 2
    assert not relay.should_share("c")
    clock.now += ASK_SECONDS
    assert relay.should_share("c")  # b never answered
    relay.decline("c")  # c re-joined recently itself
    assert not relay.should_share("c") and relay.should_share("d")
    relay.offer("d", 99, b"x")
    t.join(5)
    assert out[0].donor == "d" and out[0].count == 99


def test_learners_that_all_joined_at_once_and_declined_are_asked_again_once_they_have_trained() -> None:
    """CI found it: three learners all (re)joined mid-run together, all waited, and each one
    asked declined (too few steps of its own); declines then stood while anybody waited, so
    nobody was asked again all run and no re-admitted learner got a peer's moments."""
    clock = sh.FakeClock()
    relay = StateRelay(clock)
    fetches = [waiting(relay, name, wait=30.0) for name in ("a", "b", "c")]
    for name in ("a", "b", "c"):
        assert relay.should_share(name)
        relay.decline(name)  # young: fewer than MIN_DONOR_STEPS of its own
    assert not any(relay.should_share(name) for name in ("a", "b", "c"))
    clock.now += ASK_SECONDS  # they have trained since
    assert relay.should_share("b")
    assert relay.offer("b", 120, b"moments")
    for (t, out), name in zip(fetches, ("a", "b", "c")):
        if name != "b":
            t.join(5)
            assert out and out[0].donor == "b"
    assert relay.should_share("a")  # b waits too, and cannot take its own copy
    assert relay.offer("a", 130, b"theirs")
    fetches[1][0].join(5)
    assert fetches[1][1][0].donor == "a"


def test_an_upload_nobody_waits_for_is_dropped_and_a_fetch_times_out_empty() -> None:
    relay = StateRelay(sh.FakeClock())
    assert not relay.offer("b", 40, b"late")
    assert relay.latest is None
    assert relay.fetch("a", 0.05) is None
    assert not relay.waiting


@pytest.mark.slow
def test_a_cancelled_fetch_stops_waiting() -> None:
    relay, alive = StateRelay(sh.FakeClock()), [True]
    t = threading.Thread(target=lambda: relay.fetch("a", 30.0, lambda: alive[0]))
    t.start()
    alive[0] = False  # the RPC was cancelled, or the server stops
    t.join(3)
    assert not t.is_alive() and not relay.waiting


def test_two_waiters_share_one_upload() -> None:
    relay = StateRelay(sh.FakeClock())
    (t1, out1), (t2, out2) = waiting(relay, "a"), waiting(relay, "b")
    assert relay.should_share("c")
    relay.offer("c", 50, b"m")
    t1.join(5), t2.join(5)
    assert out1[0] == out2[0] and relay.relayed == 2


# -- through gRPC, against the syncer harness ------------------------------------------


@pytest.fixture
def syncer():
    h = sh.start()
    yield h
    h.close()


def share(h: sh.Harness, learner: str, blob: bytes, count: int = 3, secret: bytes | None = None,
          total: int | None = None) -> pb.ShareStateReply:
    header = pb.StateHeader(learner=learner, session_secret=h.secret(learner) if secret is None else secret,
                            count=count, total_bytes=len(blob) if total is None else total)
    return h.stub.ShareState(iter([pb.StateChunk(header=header, data=blob)]), metadata=auth_metadata(sh.TOKEN),
                             timeout=10)


def test_a_push_reply_asks_a_peer_and_its_upload_reaches_the_waiting_learner(syncer: sh.Harness) -> None:
    result: list = []

    def fetch() -> None:
        req = pb.FetchStateRequest(learner="a-1", session_secret=syncer.secret("a-1"), wait_seconds=10)
        result.extend(syncer.stub.FetchState(req, metadata=auth_metadata(sh.TOKEN), timeout=20))

    t = threading.Thread(target=fetch)
    t.start()
    reply = None
    for _ in range(100):  # until the FetchState is waiting
        reply = syncer.push(0, syncer.fragment_tensors(0), learner="a-0", slot=0)
        if reply.share_state:
            break
        threading.Event().wait(0.02)
    assert reply is not None and reply.accepted and reply.share_state
    # One push of 4 steps so far: a step count of 8 is within what it vouched for (4, plus 2 cycles of 2).
    assert share(syncer, "a-0", b"moments" * 1000, count=8).relayed
    t.join(10)
    assert result[0].header.learner == "a-0" and result[0].header.count == 8
    assert b"".join(c.data for c in result) == b"moments" * 1000


def test_state_rpcs_refuse_strangers_and_oversize_uploads(syncer: sh.Harness) -> None:
    with pytest.raises(grpc.RpcError) as info:
        share(syncer, "a-0", b"x", secret=b"not-the-secret")
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as info:
        share(syncer, "a-0", b"x", total=1 << 40)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "expected 1 to" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        share(syncer, "a-0", b"xyz", total=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "truncated" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:  # a step count no push vouched for (it sets AdamW's bias correction)
        share(syncer, "a-0", b"x", count=10**9)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most" in info.value.details()
    req = pb.FetchStateRequest(learner="a-1", session_secret=syncer.secret("a-1"), wait_seconds=0.1)
    with pytest.raises(grpc.RpcError) as info:
        list(syncer.stub.FetchState(req, metadata=auth_metadata(sh.TOKEN), timeout=10))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


# -- the learner's side (trainer/sync/peer_state.py) ----------------------------------------


def trained_state(seed: int, steps: int, shapes: dict[str, tuple[int, ...]] | None = None):
    """An AdamW state (as the learner's recipe builds it) after `steps` updates."""
    shapes = shapes or {"w": (8, 16), "b": (16,)}
    tx = optimizer(Training())
    rng = np.random.default_rng(seed)
    params = {n: jnp.asarray(rng.standard_normal(s), jnp.float32) for n, s in shapes.items()}
    state = tx.init(params)
    for _ in range(steps):
        grads = {n: jnp.asarray(rng.standard_normal(s), jnp.float32) for n, s in shapes.items()}
        _, state = tx.update(grads, state, params)
    return state


@pytest.mark.slow
def test_a_peers_moments_and_step_count_are_adopted_within_bf16() -> None:
    donor, joiner = trained_state(0, 30), trained_state(1, 2)
    peer = PeerState("a-0", peer_state.step_count(donor), encode_tensors(peer_state.moments(donor), "bf16"))
    adopted = peer_state.adopt(joiner, peer)
    assert peer_state.step_count(adopted) == 30
    theirs, got = peer_state.moments(donor), peer_state.moments(adopted)
    assert set(got) == set(theirs) and any(".nu" in n for n in got) and any(".mu" in n for n in got)
    for n in got:
        np.testing.assert_allclose(got[n], theirs[n], rtol=1e-2, atol=1e-30)
    assert jax.tree_util.tree_structure(adopted) == jax.tree_util.tree_structure(joiner)


@pytest.mark.parametrize("bad", ["other-model", "nan", "negative-nu", "garbage", "zero-count"])
def test_a_state_that_does_not_fit_is_refused_and_ours_kept(bad: str) -> None:
    joiner = trained_state(1, 2)
    donor = trained_state(0, 30, {"w": (8, 8), "b": (16,)} if bad == "other-model" else None)
    arrays = {n: np.array(v) for n, v in peer_state.moments(donor).items()}
    if bad == "nan":
        arrays[next(iter(arrays))][0] = np.nan
    if bad == "negative-nu":
        name = next(n for n in arrays if ".nu" in n)
        arrays[name] = -np.abs(arrays[name]) - 1
    blob = b"\x00garbage" * 9 if bad == "garbage" else encode_tensors(arrays, "bf16")
    with pytest.raises(ValueError, match="peer"):
        peer_state.adopt(joiner, PeerState("a-0", 0 if bad == "zero-count" else 30, blob))
    assert peer_state.step_count(joiner) == 2  # adopt returns a new state: ours is untouched


def test_the_loop_shares_young_moments_as_a_refusal_and_adopts_only_older_ones() -> None:
    events: list[tuple[str, dict]] = []
    shared: list[tuple[int, bytes | None]] = []
    peers = peer_state.PeerStates(object(), lambda e, **kw: events.append((e, kw)))
    original = peer_state.share
    peer_state.share = lambda client, count, blob: shared.append((count, blob))  # type: ignore[assignment]
    try:
        young, old = trained_state(0, 3), trained_state(1, 40)
        assert peers.at_boundary(young, share_requested=True) is young
        assert peers.at_boundary(old, share_requested=True) is old
        for _ in range(100):
            if len(shared) == 2:
                break
            threading.Event().wait(0.02)
        assert sorted(c for c, _ in shared) == [3, 40]
        assert dict(shared)[3] is None and dict(shared)[40]  # a young learner declines
        peers.received = PeerState("a-0", 3, dict(shared)[40] or b"")  # claims fewer steps than ours
        assert peers.at_boundary(old, share_requested=False) is old
        assert events[-1][1]["adopted"] is False and "no older" in events[-1][1]["reason"]
        peers.received = PeerState("a-0", 40, dict(shared)[40] or b"")
        assert peer_state.step_count(peers.at_boundary(young, share_requested=False)) == 40
        assert events[-1][1]["adopted"] is True
    finally:
        peer_state.share = original  # type: ignore[assignment]
