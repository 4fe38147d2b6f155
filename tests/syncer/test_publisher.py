"""Publish once: one encode per (fragment, version) for every subscriber, each view exact."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from diloco.core.codecs import decode_tensors, encode_tensors
from diloco.spec import Syncer as SyncerSpec
from diloco.syncer import publisher as publisher_module
from diloco.syncer.publisher import CHAIN, Update
from tests import syncer_harness as sh

Tensors = dict[str, np.ndarray]


class Subscriber:
    """A learner's copy, rebuilt from what its stream sends (as trainer/sync/client.py does), beside
    the first release's per-subscriber encoder run on the same Θ from the same starting copy:
    encode(Θ_p − held) for this subscriber alone, held += decode."""

    def __init__(self, stream: Iterator[Update], codec: str):
        self.stream, self.codec = stream, codec
        self.view: Tensors = {}
        self.reference: Tensors = {}
        self.versions: dict[int, int] = {}

    def receive(self, h: sh.Harness) -> Update:
        u = next(self.stream)
        values = decode_tensors(u.blob)
        if u.is_delta:
            values = {n: self.view[n] + t for n, t in values.items()}
            theta = h.core.model.fragment(u.fragment)
            mine = encode_tensors({n: theta[n] - self.reference[n] for n in values}, self.codec)  # type: ignore[arg-type]
            assert mine == u.blob  # the shared delta is byte for byte this subscriber's own
            self.reference.update({n: self.reference[n] + t for n, t in decode_tensors(mine).items()})
        else:
            self.reference.update(values)
        self.view.update(values)
        assert all(np.array_equal(self.view[n], self.reference[n]) for n in values)
        assert h.core.model.tag_matches(u.fragment, u.version, self.view, u.tag)  # the tag is over our copy
        self.versions[u.fragment] = u.version
        return u


def publish(h: sh.Harness, p: int, rng: np.random.Generator) -> None:
    delta = {n: rng.standard_normal(s).astype(np.float32) * 0.01 for n, s in h.core.model.shapes(p).items()}
    assert h.push(p, delta, codec="fp32", slot=h.core.book.next_slot // 2 * 2 + p).accepted
    h.clock.now += 10
    assert h.core.merge_ready() == [p]


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_every_subscriber_gets_the_same_bytes_and_the_view_the_per_subscriber_encoder_gives(codec: str) -> None:
    h = sh.start(SyncerSpec(fragments=2, broadcast_compression=codec, outer_learning_rate=1.0, outer_momentum=0.0))
    rng = np.random.default_rng(0)
    try:
        early = [Subscriber(h.core.updates([0, 0], exact=False, alive=lambda: True), codec) for _ in range(3)]
        for s in early:
            assert [s.receive(h).is_delta for _ in range(2)] == [False, False]  # keyframes first
        for step in range(12):
            publish(h, step % 2, rng)
            sent = [s.receive(h) for s in early]
            assert all(u.is_delta and u.blob is sent[0].blob for u in sent)  # one encode, shared
            if step == 5:  # one more subscriber mid-run: a keyframe of the shared view, then the chain
                early.append(Subscriber(h.core.updates([0, 0], exact=False, alive=lambda: True), codec))
                assert [early[-1].receive(h).is_delta for _ in range(2)] == [False, False]
        for p in range(2):
            views = [{n: s.view[n] for n in h.core.model.plan.fragments[p]} for s in early]
            assert all(np.array_equal(v[n], views[0][n]) for v in views for n in v)  # no copy drifts
            theta = h.core.model.fragment(p)
            assert max(float(np.abs(views[0][n] - theta[n]).max()) for n in theta) < 0.01  # error feedback holds
    finally:
        h.close()


def test_each_version_is_encoded_once_however_many_subscribe(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real, real_delta = publisher_module.encode_tensors, publisher_module.encode_delta_tensors

    def counting(tensors: Tensors, codec: str, block_size: int = 64) -> bytes:
        calls.append(codec)
        return real(tensors, codec, block_size)  # type: ignore[arg-type]

    def counting_delta(target: Tensors, base: Tensors, codec: str, block_size: int = 64) -> tuple[bytes, Tensors]:
        calls.append(codec)
        return real_delta(target, base, codec, block_size)  # type: ignore[arg-type]

    monkeypatch.setattr(publisher_module, "encode_tensors", counting)
    monkeypatch.setattr(publisher_module, "encode_delta_tensors", counting_delta)
    h = sh.start(SyncerSpec(fragments=2, broadcast_compression="int8"))
    rng = np.random.default_rng(1)
    try:
        joined = [h.core.updates([0, 0], exact=True, alive=lambda: True) for _ in range(8)]  # hold V at version 0
        for version in (1, 2, 3):
            publish(h, 0, rng)
            got = [next(s) for s in joined]
            assert all(u.is_delta and u.version == version and u.blob is got[0].blob for u in got)
        assert calls == ["int8"] * 3  # three publishes, eight subscribers: three encodes
        late = [h.core.updates([0, 0], exact=False, alive=lambda: True) for _ in range(4)]
        firsts = [next(s) for s in late]
        assert all(not u.is_delta and u.blob is firsts[0].blob for u in firsts)
        assert calls == ["int8"] * 3 + ["fp32"] * 2  # each fragment's keyframe once, for all four
    finally:
        h.close()


def test_a_subscriber_behind_gets_the_chain_or_else_a_keyframe() -> None:
    h = sh.start(SyncerSpec(fragments=2, broadcast_compression="int8"))
    rng = np.random.default_rng(2)
    try:
        behind = h.core.updates([0, 0], exact=True, alive=lambda: True)
        for _ in range(CHAIN):
            publish(h, 0, rng)
        assert [(u.version, u.is_delta) for u in (next(behind) for _ in range(CHAIN))] == [
            (v, True) for v in range(1, CHAIN + 1)]
        further = h.core.updates([0, 0], exact=True, alive=lambda: True)
        publish(h, 0, rng)  # now version 0 is CHAIN + 1 behind: beyond the chain
        u = next(further)
        assert (u.fragment, u.version, u.is_delta) == (0, CHAIN + 1, False)
        version, model, tags = h.core.publisher.snapshot()  # what Join sends: the same view, exactly
        blob = b"".join(model.parts)
        assert version == {0: CHAIN + 1, 1: 0} and tags[0] == u.tag
        assert all(np.array_equal(decode_tensors(blob)[n], t) for n, t in decode_tensors(u.blob).items())
    finally:
        h.close()


def test_the_heap_a_syncer_reserves_holds_a_joins_snapshot_and_the_delta_chains() -> None:
    """A Join's snapshot keeps every view it started with alive while each fragment is
    republished under it, and each fragment keeps CHAIN deltas: `SyncerCore.headroom`, which the
    syncer faults in at start (diloco.launch.reserve_heap), is what that takes, for a shard's
    own fragments only."""
    import tracemalloc

    from diloco.core.codecs import encoded_size

    shapes = {f"layers_{i}/kernel": (128, 256) for i in range(4)}
    rng = np.random.default_rng(1)
    spec = SyncerSpec(fragments=2, shards=2)  # a plan of 4
    warm = sh.start(spec, model=sh.GlobalModel.fresh(spec, {n: np.zeros(s, np.float32) for n, s in shapes.items()}))
    warm.core.publisher.publish(0, 1, {n: v + 1 for n, v in warm.core.model.fragment(0).items()}, slot=0)
    warm.close()  # the encoder's kernels are compiled: only the views and deltas are counted below
    h = sh.start(spec, model=sh.GlobalModel.fresh(spec, {n: rng.standard_normal(s).astype(np.float32)
                                                          for n, s in shapes.items()}), shard=1)
    try:
        core = h.core
        own = [s for p in core.owned for s in core.model.shapes(p).values()]
        assert len(own) == 2 and core.headroom() == sum(
            encoded_size(s, "fp32") + CHAIN * encoded_size(s, spec.broadcast_compression) for s in own)
        updates = {p: [{n: v + 0.01 * (k + 1) for n, v in core.model.fragment(p).items()} for k in range(CHAIN + 1)]
                   for p in core.owned}  # Θ_p as the merges would make it, made before counting
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            snapshot = core.publisher.snapshot()  # what a Join holds until its last byte is sent
            for k in range(CHAIN + 1):
                for p in core.owned:
                    core.publisher.publish(p, k + 1, updates[p][k], slot=k)
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert 0.95 * core.headroom() <= grown <= 1.1 * core.headroom(), grown / core.headroom()
        del snapshot
    finally:
        h.close()
