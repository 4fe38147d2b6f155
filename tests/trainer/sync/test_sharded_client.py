"""A sharded syncer (spec.syncer.shards): each shard takes, publishes and recovers its own
fragments only; a learner's `ShardedClient` routes to the owners and sees one syncer."""

from __future__ import annotations

import copy
import time

import grpc
import numpy as np
import pytest

from diloco.core.codecs import decode_tensors, encode_tensors
from diloco.core.fragments import owned_by, owner
from diloco.shards import aggregate, server_names, syncer_addresses
from diloco.spec import Syncer as SyncerSpec
from diloco.trainer.sync.client import Push, SyncerClient
from diloco.trainer.sync.sharded_client import ShardedClient
from diloco.wire import auth_metadata, chunks, pb
from tests import syncer_harness as sh

SPEC = SyncerSpec(fragments=2, shards=2)  # a plan of 4: slot s is due for fragments 2(s mod 2) and 2(s mod 2) + 1


@pytest.fixture
def shards():
    hs = [sh.start(SPEC, shard=s) for s in range(2)]
    yield hs
    for h in hs:
        h.close()


def address(h: sh.Harness) -> str:
    return f"127.0.0.1:{h.port}"


@pytest.mark.parametrize(("fragments", "shards"), [(1, 1), (4, 1), (4, 2), (7, 3), (24, 4)])
def test_every_fragment_has_exactly_one_owner(fragments: int, shards: int) -> None:
    owned = [owned_by(s, fragments, shards) for s in range(shards)]
    assert sorted(p for o in owned for p in o) == list(range(fragments))
    assert all(owner(p, shards) == s for s, o in enumerate(owned) for p in o)
    assert max(map(len, owned)) - min(map(len, owned)) <= 1  # round robin: even shares


def test_a_push_to_the_wrong_shard_is_refused_and_changes_nothing(shards: list[sh.Harness]) -> None:
    h0, h1 = shards
    before = copy.deepcopy(h0.core.model.params), list(h0.core.model.versions)
    with pytest.raises(grpc.RpcError) as info:
        h0.push(1, h0.fragment_tensors(1))  # fragment 1 belongs to shard 1
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "belongs to syncer shard 1" in info.value.details()
    h0.core.merge_ready(flush=True)
    assert h0.core.model.versions == before[1]
    assert all(np.array_equal(h0.core.model.params[k], before[0][k]) for k in before[0])
    assert h0.core.metrics.contributions.labels("misrouted")._value.get() == 1
    assert h1.push(1, h1.fragment_tensors(1)).accepted  # the owner takes it
    h1.core.merge_ready(flush=True)
    assert h1.core.model.versions == [0, 1, 0, 0]


def test_every_slot_has_one_fragment_for_each_shard_and_no_other(shards: list[sh.Harness]) -> None:
    """Slot s is due for fragments 2(s mod 2) and 2(s mod 2) + 1 here: shard 1's fragment 1 in
    slot 1 (fragments 2 and 3's) is refused before its body is read; fragment 3 is taken."""
    h1 = shards[1]
    with pytest.raises(grpc.RpcError) as info:
        h1.push(1, h1.fragment_tensors(1), slot=1)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "slot 1 is due for fragments 2-3, not fragment 1" in info.value.details()
    assert h1.push(3, h1.fragment_tensors(3), slot=1).accepted and h1.push(1, h1.fragment_tensors(1), slot=2).accepted


def test_join_sends_only_the_shards_fragments(shards: list[sh.Harness]) -> None:
    h1 = shards[1]
    request = pb.JoinRequest(learner="a-0", region="r", process=7,
                             tensors=[pb.TensorShape(name=k, shape=list(s)) for k, s in sh.SHAPES.items()])
    parts = list(h1.stub.Join(request, metadata=auth_metadata(sh.TOKEN), timeout=10))
    header = parts[0].header
    assert (header.shard, header.shards) == (1, 2)
    got = decode_tensors(b"".join(p.data for p in parts))
    assert set(got) == {n for p in (1, 3) for n in h1.core.model.plan.fragments[p]}


def test_recover_of_another_shards_fragment_is_refused(shards: list[sh.Harness]) -> None:
    h0 = shards[0]
    names = h0.core.model.plan.fragments[1]
    blob = encode_tensors({n: h0.core.model.params[n] for n in names}, "fp32")
    header = pb.RecoverHeader(learner="a-0", fragments=[1], versions=[5], total_bytes=len(blob), tags=[b"x" * 32])
    msgs = [pb.RecoverChunk(header=header if i == 0 else None, data=bytes(c)) for i, c in enumerate(chunks(blob))]
    with pytest.raises(grpc.RpcError) as info:
        h0.stub.Recover(iter(msgs), metadata=auth_metadata(sh.TOKEN), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "other syncer shards" in info.value.details()
    assert h0.core.model.versions == [0, 0, 0, 0]


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_sharded_client_joins_pushes_to_owners_and_adopts_from_all(shards: list[sh.Harness]) -> None:
    client = ShardedClient([address(h) for h in shards], lambda a: SyncerClient(a, sh.TOKEN, "a-0", "r"))
    try:
        joined = client.join_with_retry(dict(sh.SHAPES))
        assert joined.owned == [0, 1, 2, 3] and joined.versions == [0, 0, 0, 0]
        assert all(np.array_equal(joined.params[k], v) for k, v in sh.params().items())  # Θ₀ from the owners
        client.start()
        plan = shards[0].core.model.plan
        for p in range(4):
            delta = {n: np.full(sh.SHAPES[n], 0.01, np.float32) for n in plan.fragments[p]}
            client.submit(Push(fragment=p, base_version=0, push_id=p + 1, slot=p // 2, steps=4, tokens=4 * 512,
                               session_tokens=(p // 2 + 1) * 2048, delta=delta, blob=encode_tensors(delta, "int4"),
                               incarnation="", step_seconds=0.05, loss=2.0, train_seconds=1.0))
        wait_for(lambda: sum(len(h.core.book.contributors(p)) for h in shards for p in h.core.owned) == 4)
        for h in shards:
            h.core.merge_ready(flush=True)
        assert [h.core.model.versions for h in shards] == [[1, 0, 1, 0], [0, 1, 0, 1]]
        got: dict[int, int] = {}
        tokens: dict[int, int] = {}
        accepted: list[tuple[int, int, int, bool]] = []

        def arrived() -> bool:
            u = client.take_updates()
            got.update({p: a.version for p, a in u.published.items()})
            tokens.update({p: a.job_tokens for p, a in u.published.items()})
            accepted.extend(u.accepted)
            return len(got) == 4 and len(accepted) == 4

        wait_for(arrived)
        assert got == {0: 1, 1: 1, 2: 1, 3: 1}
        # Each publish carries its shard's count of the job's tokens (every push carries its
        # learner's cumulative count, one push per shard each slot): two slots' worth on each.
        assert max(tokens[0], tokens[2]) == shards[0].core.model.tokens_merged == 2 * 2048
        assert max(tokens[1], tokens[3]) == shards[1].core.model.tokens_merged == 2 * 2048
        assert sorted(f for f, *_ in accepted) == [0, 1, 2, 3]
        status = aggregate([h.core.status() for h in shards])
        assert list(status.versions) == [1, 1, 1, 1] and status.outer_steps == 4 and status.shards == 2
    finally:
        client.close()


def test_a_client_given_the_shards_out_of_order_refuses_to_start(shards: list[sh.Harness]) -> None:
    client = ShardedClient([address(h) for h in reversed(shards)], lambda a: SyncerClient(a, sh.TOKEN, "a-0", "r"))
    try:
        with pytest.raises(RuntimeError, match="position 0 is shard 1 of 2"):
            client.join_with_retry(dict(sh.SHAPES))
    finally:
        client.close()


def test_status_of_shards_adds_up_to_one_syncer() -> None:
    a = pb.StatusReply(incarnation="x", versions=[3, 0, 5, 0], outer_steps=8, tokens_merged=900, bytes_sent=10,
                       checkpoint_version=8, seconds_since_publish=2.0, shard=0, shards=2,
                       learners=[pb.LearnerStatus(learner="a-0", contributions=4, tokens_merged=900,
                                                  seconds_since_seen=1.0)])
    b = pb.StatusReply(incarnation="y", versions=[0, 4, 0, 6], outer_steps=10, tokens_merged=1000, bytes_sent=20,
                       checkpoint_version=7, seconds_since_publish=0.5, shard=1, shards=2,
                       learners=[pb.LearnerStatus(learner="a-0", contributions=5, tokens_merged=1000,
                                                  seconds_since_seen=3.0)])
    s = aggregate([a, b])
    assert list(s.versions) == [3, 4, 5, 6] and s.outer_steps == 18 and s.tokens_merged == 1000
    assert s.incarnation == "x+y" and s.bytes_sent == 30 and s.checkpoint_version == 15
    assert s.seconds_since_publish == 0.5
    assert [(ls.learner, ls.contributions, ls.tokens_merged) for ls in s.learners] == [("a-0", 9, 1000)]
    assert aggregate([a]) is a


@pytest.mark.parametrize("arg", ["", "host", "a:1,,b:2", ",a:1"])
def test_malformed_syncer_addresses_are_refused(arg: str) -> None:
    with pytest.raises(ValueError, match="host:port"):
        syncer_addresses(arg)
    assert syncer_addresses("a:1, b:2") == ["a:1", "b:2"]


@pytest.mark.parametrize(("names", "expected"), [
    (None, [None, None]),  # no TLS, or the addresses' own hosts
    ("syncer.example.com", ["syncer.example.com"] * 2),  # one name for every shard (a *.host certificate's own)
    ("shard-0.s.example.com, shard-1.s.example.com", ["shard-0.s.example.com", "shard-1.s.example.com"]),
])
def test_tls_server_name_is_one_for_every_shard_or_one_per_address(names: str | None,
                                                                   expected: list[str | None]) -> None:
    assert server_names(names, ["a:1", "b:2"]) == expected


@pytest.mark.parametrize("names", ["x,y,z", "x,", ",x"])
def test_a_tls_server_name_per_address_must_match_the_syncer_list(names: str) -> None:
    from argparse import Namespace
    from types import SimpleNamespace

    from diloco.contract import Exit
    from diloco.trainer.bringup import EndsEarly, connect

    with pytest.raises(ValueError, match="--tls-server-name") as info:
        server_names(names, ["a:1", "b:2"])
    if names.count(",") == 2:
        assert "3 names for 2 --syncer addresses" in str(info.value)
    # The learner exits at bring-up with a flag error (Exit.CONFIG), before dialling anything.
    me = SimpleNamespace(args=Namespace(syncer="a:1,b:2", tls_server_name=names, restart=None),
                         spec=SimpleNamespace(syncer=SimpleNamespace(shards=2)))
    with pytest.raises(EndsEarly) as ended:
        connect(me, SimpleNamespace())  # type: ignore[arg-type]
    assert ended.value.code == Exit.CONFIG and "--tls-server-name" in ended.value.reason


def test_diloco_status_adds_up_the_shards(shards: list[sh.Harness]) -> None:
    import json
    import os
    import subprocess
    import sys

    from diloco.contract import TOKEN_ENV

    assert shards[1].push(1, shards[1].fragment_tensors(1)).accepted
    shards[1].core.merge_ready(flush=True)
    res = subprocess.run([sys.executable, "-P", "-m", "diloco.apps.cli", "status", "--syncer",
                          ",".join(address(h) for h in shards)], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, **{TOKEN_ENV: sh.TOKEN}))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert [int(v) for v in out["versions"]] == [0, 1, 0, 0] and out["shards"] == 2
    assert [s.get("shard", 0) for s in out["per_shard"]] == [0, 1]


def test_a_shard_holds_and_checkpoints_its_own_fragments_only(tmp_path) -> None:
    from diloco.checkpoint import CheckpointStore, params_of
    from diloco.syncer.global_model import GlobalModel

    h = sh.start(SPEC, checkpoint_dir=str(tmp_path), shard=1)
    try:
        model = h.core.model
        mine = {n for p in (1, 3) for n in model.plan.fragments[p]}
        assert all((v.strides == (0,) * v.ndim) != (n in mine) for n, v in model.params.items())  # placeholders
        assert h.push(3, h.fragment_tensors(3)).accepted
        h.core.merge_ready(flush=True)
        assert h.core.checkpoint()
    finally:
        h.close()
    loaded, _ = CheckpointStore(str(tmp_path)).load_latest()
    assert loaded is not None and set(params_of(loaded.arrays)) == mine
    restored = GlobalModel.from_state(SPEC, loaded.arrays, loaded.meta, expect=dict(sh.SHAPES), owned=(1, 3))
    assert restored.versions == [0, 0, 0, 1]
    assert np.array_equal(restored.params[model.plan.fragments[3][0]], model.params[model.plan.fragments[3][0]])
    for spec, owned in ((SyncerSpec(fragments=4), None), (SyncerSpec(fragments=1, shards=4), (1,))):  # plans of 4
        with pytest.raises(ValueError, match=r"spec\.syncer\.shards changed since it was written"):
            GlobalModel.from_state(spec, loaded.arrays, loaded.meta, expect=dict(sh.SHAPES), owned=owned)


def test_the_operator_sees_a_sharded_syncer_as_one(shards: list[sh.Harness]) -> None:
    from diloco.operator.syncer_client import SyncerClients, Target

    for h, p in zip(shards, (0, 1)):
        assert h.push(p, h.fragment_tensors(p)).accepted
        h.core.merge_ready(flush=True)
    clients = SyncerClients()
    try:
        view, error = clients.status("research", "demo", Target(",".join(address(h) for h in shards), sh.TOKEN))
        assert error == "" and view is not None and view.outer_version == 2
        shards[1].close()  # one shard down: the syncer as a whole does not answer
        view, error = clients.status("research", "demo", Target(",".join(address(h) for h in shards), sh.TOKEN))
        assert view is None and error == "UNAVAILABLE"
    finally:
        clients.close()
