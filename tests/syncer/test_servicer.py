"""The syncer refuses bad input with a clear status and leaves the global state unchanged."""

from __future__ import annotations

import copy
from concurrent import futures

import grpc
import numpy as np
import pytest

from diloco.core.codecs import encode_tensors
from diloco.spec import Syncer as SyncerSpec
from diloco.syncer.core import SyncerCore
from diloco.syncer.global_model import GlobalModel
from diloco.syncer.servicer import SyncerServicer
from diloco.trainer.sync.client import Push, SyncerClient
from diloco.wire import add_syncer, auth_metadata, pb, server_options
from tests import syncer_harness as sh


@pytest.fixture
def syncer():
    h = sh.start()
    yield h
    h.close()


def snapshot(h: sh.Harness):
    return copy.deepcopy(h.core.model.params), list(h.core.model.versions), h.core.book.contributors(0) | h.core.book.contributors(1)


def assert_unchanged(h: sh.Harness, before) -> None:
    params, versions, contributors = snapshot(h)
    assert versions == before[1] and contributors == before[2]
    assert all(np.array_equal(params[k], before[0][k]) for k in params)


def code_of(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code(), info.value.details()


@pytest.mark.parametrize("unary", [False, True], ids=["Push", "PushOne"])
def test_accepts_and_merges_a_good_push(syncer: sh.Harness, unary: bool) -> None:
    before = snapshot(syncer)
    reply = syncer.push(0, syncer.fragment_tensors(0), unary=unary)
    assert reply.accepted, reply.reason
    assert syncer.core.merge_ready() == []  # K = 1 reached; the grace window (1.6 steps) is still open
    syncer.clock.now += 0.09
    assert syncer.core.merge_ready() == [0]
    assert syncer.core.model.versions[0] == 1
    name = next(iter(syncer.core.model.shapes(0)))
    assert not np.array_equal(syncer.core.model.params[name], before[0][name])


@pytest.mark.parametrize("token", ["", "wrong-token-0123456789", sh.TOKEN + "x"])
def test_wrong_token_refused_everywhere(syncer: sh.Harness, token: str) -> None:
    before = snapshot(syncer)
    md = auth_metadata(token) if token else ()
    assert code_of(lambda: syncer.push(0, syncer.fragment_tensors(0), token=token))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: syncer.push(0, syncer.fragment_tensors(0), token=token, unary=True))[0] == \
        grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: syncer.stub.PushOne(pb.PushChunk(data=b"x"), metadata=md))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: syncer.stub.Status(pb.StatusRequest(), metadata=md))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: list(syncer.stub.Join(pb.JoinRequest(learner="x"), metadata=md)))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert_unchanged(syncer, before)


@pytest.mark.parametrize("unary", [False, True], ids=["Push", "PushOne"])
def test_bad_pushes_refused_with_clear_status(syncer: sh.Harness, unary: bool) -> None:
    before = snapshot(syncer)
    good = syncer.fragment_tensors(0)
    name = next(iter(good))
    wrong_shape = dict(good, **{name: np.zeros((3, 3), np.float32)})
    nan = dict(good, **{name: np.full(good[name].shape, np.nan, np.float32)})
    inf = dict(good, **{name: np.full(good[name].shape, np.inf, np.float32)})
    blob = bytes(encode_tensors(good, "int4"))  # bytes, to splice bad ones from

    def push(*args, **kwargs) -> pb.PushReply:  # type: ignore[no-untyped-def]
        return syncer.push(*args, unary=unary, **kwargs)

    cases = {
        "unknown fragment": (lambda: push(7, good), "unknown fragment 7"),
        "wrong shape": (lambda: push(0, wrong_shape), "does not match"),
        "nan": (lambda: push(0, nan, codec="fp32"), "NaN or Inf"),
        "nan int4": (lambda: push(0, nan), "non-finite"),
        "inf": (lambda: push(0, inf, codec="bf16"), "NaN or Inf"),
        "truncated": (lambda: push(0, blob=blob[:-5], total_bytes=len(blob)), "truncated"),
        "oversized": (lambda: push(0, blob=blob + b"\0" * 10, total_bytes=len(blob)), "larger than"),
        "over bound": (lambda: push(0, blob=b"\0" * 10, total_bytes=1 << 30), "exceeds"),
        "garbage": (lambda: push(0, blob=b"\x01" * 64), "magic"),
        "other fragment's tensors": (lambda: push(0, syncer.fragment_tensors(1)), "fragment 0"),
        "zero steps": (lambda: push(0, good, steps=0), "steps"),
    }
    for label, (fn, needle) in cases.items():
        code, details = code_of(fn)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, label
        assert needle in details, (label, details)
    assert_unchanged(syncer, before)
    syncer.clock.now += 100
    assert syncer.core.merge_ready() == []


def test_stale_and_future_pushes(syncer: sh.Harness) -> None:
    syncer.core.model.versions[0] = 5
    reply = syncer.push(0, syncer.fragment_tensors(0), base_version=1)
    assert not reply.accepted and "behind" in reply.reason
    reply = syncer.push(0, syncer.fragment_tensors(0), base_version=9)
    assert not reply.accepted and "rejoin" in reply.reason
    header_wrong_incarnation = pb.PushHeader(learner="a", incarnation="other", fragment=0, steps=1, total_bytes=1)
    code, details = code_of(lambda: syncer.stub.Push(iter([pb.PushChunk(header=header_wrong_incarnation, data=b"x")]),
                                                     metadata=auth_metadata(sh.TOKEN)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "rejoin" in details


def test_join_returns_plan_and_state_and_checks_shapes(syncer: sh.Harness) -> None:
    from diloco.core.codecs import decode_tensors

    req = pb.JoinRequest(learner="a-0", tensors=[pb.TensorShape(name=n, shape=list(s)) for n, s in sh.SHAPES.items()])
    msgs = list(syncer.stub.Join(req, metadata=auth_metadata(sh.TOKEN)))
    header = msgs[0].header
    state = decode_tensors(b"".join(m.data for m in msgs), sh.SHAPES)
    assert all(np.array_equal(state[k], syncer.core.model.params[k]) for k in sh.SHAPES)
    assert list(header.versions) == [0, 0] and len(header.fragments) == 2 and header.codec == "int4"
    bad = pb.JoinRequest(learner="a-0", tensors=[pb.TensorShape(name="x", shape=[1])])
    assert code_of(lambda: list(syncer.stub.Join(bad, metadata=auth_metadata(sh.TOKEN))))[0] == grpc.StatusCode.FAILED_PRECONDITION


def test_a_join_of_several_chunks_is_the_model_and_is_paced_while_learners_push(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks framed by hand (diloco.wire.framed) parse as JoinChunks. Every byte of the model is
    taken from the pacer re-admissions share (syncer/joins/pacing.py) while learners push, and none
    while nobody does (every learner re-joining a restarted syncer: no round waits)."""
    from diloco.core.codecs import decode_tensors
    from diloco.syncer.joins.pacing import Pacer

    taken: list[int] = []
    monkeypatch.setattr(Pacer, "take", lambda self, n: taken.append(n) or 0.0)
    shapes = {"embed/embedding": (700, 1000), "head/kernel": (1000, 300)}  # 4 MB: four chunks
    rng = np.random.default_rng(3)
    params = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    spec = SyncerSpec(fragments=2, join_bytes_per_second=5e8)
    h = sh.start(spec, model=GlobalModel.fresh(spec, params))
    req = pb.JoinRequest(learner="b-0", tensors=[pb.TensorShape(name=n, shape=list(s)) for n, s in shapes.items()])
    try:
        quiet = list(h.stub.Join(req, metadata=auth_metadata(sh.TOKEN), timeout=30))
        assert taken == []
        assert h.push(0, {n: np.full(s, 1e-3, np.float32) for n, s in h.core.model.shapes(0).items()}).accepted
        busy = list(h.stub.Join(req, metadata=auth_metadata(sh.TOKEN), timeout=30))
        h.clock.now += 11.0  # no push for longer than ROUNDS_RUNNING_SECONDS
        assert not h.core.rounds_running()
    finally:
        h.close()
    for msgs in (quiet, busy):
        blob = b"".join(m.data for m in msgs)
        assert len(msgs) == 4 and msgs[0].header.total_bytes == len(blob) and not any(m.HasField("header") for m in msgs[1:])
        assert all(np.array_equal(v, params[n]) for n, v in decode_tensors(blob, shapes).items())
    assert taken == [len(m.data) for m in busy]


def recover(h: sh.Harness, fragments, versions, tensors, token=sh.TOKEN, tags=None) -> pb.RecoverReply:
    """Offer `tensors` at `versions`; by default with the tags this syncer would have sent them with."""
    from diloco.wire import chunks

    blob = encode_tensors(tensors, "fp32")
    if tags is None:
        plan = h.core.model.plan
        tags = [h.core.model.tag(p, v, tensors) if p < plan.num_fragments else b"" for p, v in zip(fragments, versions)]
    header = pb.RecoverHeader(learner="a-0", fragments=fragments, versions=versions, total_bytes=len(blob), tags=tags)
    msgs = [pb.RecoverChunk(header=header if i == 0 else None, data=bytes(c)) for i, c in enumerate(chunks(blob))]
    return h.stub.Recover(iter(msgs), metadata=auth_metadata(token), timeout=10)


@pytest.mark.slow
def test_recover_adopts_only_newer_fragments(syncer: sh.Harness) -> None:
    syncer.core.model.versions[:] = [3, 5]  # as if restored from a checkpoint at these versions
    for p in (0, 1):
        syncer.core.publisher.reset(p, syncer.core.model.versions[p], syncer.core.model.fragment(p))
    syncer.core.persistence.lease.ceilings = [9, 9]  # a predecessor published up to version 9
    offered = {n: np.full(s, 7.0, np.float32) for n, s in sh.SHAPES.items()}
    reply = recover(syncer, [0, 1], [4, 5], offered)  # fragment 0 is newer, fragment 1 is not
    assert list(reply.adopted) == [0] and list(reply.versions) == [4, 5]
    for n in syncer.core.model.plan.fragments[0]:
        assert np.all(syncer.core.model.params[n] == 7.0)
    for n in syncer.core.model.plan.fragments[1]:
        assert not np.all(syncer.core.model.params[n] == 7.0)
    alive = iter([True, True, False])
    sent = list(syncer.core.updates([0, 5], exact=False, alive=lambda: next(alive)))
    assert [(u.fragment, u.version, u.is_delta) for u in sent] == [(0, 4, False), (1, 5, False)]  # keyframes


def test_recover_refuses_bad_offers(syncer: sh.Harness) -> None:
    before = snapshot(syncer)
    good = {n: np.ones(s, np.float32) for n, s in sh.SHAPES.items()}
    nan = dict(good, **{"head/kernel": np.full(sh.SHAPES["head/kernel"], np.nan, np.float32)})
    assert code_of(lambda: recover(syncer, [0, 1], [9, 9], good, token="nope-nope-nope-nope"))[0] == grpc.StatusCode.UNAUTHENTICATED
    for fragments, versions, tensors in (([0, 1], [9, 9], nan), ([0, 0], [9, 9], good), ([5], [9], good), ([0, 1], [9], good)):
        assert code_of(lambda: recover(syncer, fragments, versions, tensors))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert_unchanged(syncer, before)


def test_recover_refuses_what_this_syncer_never_published(syncer: sh.Harness) -> None:
    """A token holder offering made-up values at a high version (the attack the tags stop):
    refused with PERMISSION_DENIED, Θ bit for bit as before."""
    syncer.core.persistence.lease.ceilings = [9, 9]  # a predecessor published up to version 9
    before = snapshot(syncer)
    made_up = {n: np.full(s, 3.0, np.float32) for n, s in sh.SHAPES.items()}
    genuine = [syncer.core.model.tag(p, 9, made_up) for p in (0, 1)]
    other_key = sh.start(SyncerSpec(fragments=2))  # another job's syncer: another key
    try:
        foreign = [other_key.core.model.tag(p, 9, made_up) for p in (0, 1)]
    finally:
        other_key.close()
    for tags in ([b"", b""], [b"\x00" * 32] * 2, foreign, genuine[::-1], [syncer.core.model.tag(p, 8, made_up) for p in (0, 1)]):
        code, details = code_of(lambda: recover(syncer, [0, 1], [10 ** 9 if tags == [b"", b""] else 9] * 2, made_up,
                                                tags=tags))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert ("publish lease" if tags == [b"", b""] else "provenance tag") in details
    assert code_of(lambda: recover(syncer, [0, 1], [9, 9], made_up, tags=genuine[:1]))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert_unchanged(syncer, before)
    assert list(recover(syncer, [0, 1], [9, 9], made_up, tags=genuine).adopted) == [0, 1]  # what it did publish


def test_status_breaks_down_by_region(syncer: sh.Harness) -> None:
    syncer.core.registry.regions = frozenset({"us-east", "eu-west"})
    for learner, region in (("a-0", "us-east"), ("b-0", "eu-west"), ("x-0", "mars")):
        req = pb.JoinRequest(learner=learner, region=region,
                             tensors=[pb.TensorShape(name=n, shape=list(s)) for n, s in sh.SHAPES.items()])
        list(syncer.stub.Join(req, metadata=auth_metadata(sh.TOKEN)))
        assert syncer.push(0, syncer.fragment_tensors(0), learner=learner).accepted
    syncer.clock.now += 10
    assert syncer.core.merge_ready() == [0]
    status = syncer.stub.Status(pb.StatusRequest(), metadata=auth_metadata(sh.TOKEN))
    regions = {r.region: r for r in status.regions}
    assert set(regions) == {"us-east", "eu-west", "other"}  # an unknown region never becomes a label
    # Each push says its learner trained 4 steps x 512 tokens so far: credited once, in full.
    assert all(r.tokens_merged == 4 * 512 and r.contributions == 1 and r.bytes_received > 0 for r in regions.values())
    assert sum(r.tokens_merged for r in regions.values()) == status.tokens_merged


def test_broadcast_deltas_track_the_global_model_with_error_feedback(syncer: sh.Harness) -> None:
    """A subscriber's copy, rebuilt from keyframe plus int4 deltas, stays close to Θ for good."""
    from diloco.core.codecs import decode_tensors


    h = sh.start(SyncerSpec(fragments=2, broadcast_compression="int4", outer_learning_rate=1.0, outer_momentum=0.0))
    try:
        stream = h.core.updates([0, 0], exact=False, alive=lambda: True)
        view: dict[str, np.ndarray] = {}
        for _ in range(2):  # a new stream starts with keyframes
            u = next(stream)
            assert not u.is_delta
            view.update(decode_tensors(u.blob))
        rng = np.random.default_rng(0)
        errors = []
        for _ in range(30):
            delta = {n: rng.standard_normal(s).astype(np.float32) * 0.01 for n, s in h.core.model.shapes(0).items()}
            assert h.push(0, delta, codec="fp32").accepted
            h.clock.now += 10
            assert h.core.merge_ready() == [0]
            u = next(stream)
            assert (u.fragment, u.version, u.is_delta) == (0, h.core.model.versions[0], True)
            for n, t in decode_tensors(u.blob).items():
                view[n] = view[n] + t
            assert h.core.model.tag_matches(u.fragment, u.version, view, u.tag)  # the tag is over what we hold
            errors.append(max(float(np.abs(view[n] - h.core.model.params[n]).max()) for n in delta))
        assert max(errors) < 0.01 * 0.3  # well under one update's size, and it does not accumulate
        assert np.mean(errors[-10:]) <= 2 * np.mean(errors[:10])
    finally:
        h.close()


def test_a_retried_push_is_acknowledged_again_not_merged_twice(syncer: sh.Harness) -> None:
    first = syncer.push(0, syncer.fragment_tensors(0), push_id=5, slot=0)
    again = syncer.push(0, syncer.fragment_tensors(0), push_id=5, slot=0)  # the reply was lost
    assert first.accepted and again.accepted and first.merged_into == again.merged_into == 1
    syncer.clock.now += 10
    assert syncer.core.merge_ready() == [0]
    assert syncer.core.model.versions[0] == 1 and syncer.core.model.tokens_merged == 4 * 512


def test_the_final_flush_closes_rounds_below_quorum(syncer: sh.Harness) -> None:
    import dataclasses

    syncer.core.book.policy = dataclasses.replace(syncer.core.book.policy, quorum=3)
    assert syncer.push(1, syncer.fragment_tensors(1), slot=1).accepted
    syncer.clock.now += 100
    assert syncer.core.merge_ready() == []  # K = 3 not met
    assert syncer.core.merge_ready(flush=True) == [1] and syncer.core.model.versions == [0, 1]


def test_join_reports_the_schedule_position_and_the_jobs_tokens(syncer: sh.Harness) -> None:
    # A process's pushes of 4 steps (2048 tokens) each; its count reaches 2 x 2048 in the second.
    assert syncer.push(1, syncer.fragment_tensors(1), slot=41, session_tokens=2048).accepted
    syncer.clock.now += 10
    assert syncer.core.merge_ready() == [1]
    assert syncer.push(0, syncer.fragment_tensors(0), slot=44, session_tokens=2 * 2048).accepted  # not merged yet
    req = pb.JoinRequest(learner="b-0", region="r",
                         tensors=[pb.TensorShape(name=n, shape=list(s)) for n, s in sh.SHAPES.items()])
    header = next(iter(syncer.stub.Join(req, metadata=auth_metadata(sh.TOKEN)))).header
    assert header.slot == 45
    # Where the joiner's learning-rate schedule resumes: every token accepted pushes report,
    # merged (2048) or in an open round (2048 more).
    assert syncer.core.model.tokens_merged == 2048 and header.job_tokens == 2 * 2048
    status = syncer.stub.Status(pb.StatusRequest(), metadata=auth_metadata(sh.TOKEN))
    assert {ls.learner: ls.tokens_trained for ls in status.learners}["a-0"] == 2 * 2048  # its newest push's count


def test_an_outlier_outer_gradient_is_refused_and_nothing_changes(syncer: sh.Harness) -> None:
    """A broken learner's blow-up (finite, so the NaN check passes) is refused by norm against
    the fragment's recent median; honest pushes a few times larger still go in."""
    rng = np.random.default_rng(3)

    def delta(scale: float) -> dict[str, np.ndarray]:
        return {n: (scale * rng.standard_normal(s)).astype(np.float32) for n, s in syncer.core.model.shapes(0).items()}

    for i in range(16):  # NORM_WARMUP honest pushes of similar size
        assert syncer.push(0, delta(0.01), learner=f"a-{i % 4}", codec="fp32").accepted
    before = snapshot(syncer)
    code, details = code_of(lambda: syncer.push(0, delta(10.0), codec="fp32"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "maxNormRatio" in details and "re-sync" in details
    assert_unchanged(syncer, before)
    assert syncer.core.admission.max_ratio_seen > 100
    assert syncer.push(0, delta(0.03), codec="fp32").accepted  # 3x the median: well within the default 20x


def join(h: sh.Harness, learner: str, process: int, supersede: bool = False) -> pb.JoinHeader:
    req = pb.JoinRequest(learner=learner, tensors=[pb.TensorShape(name=n, shape=list(s)) for n, s in sh.SHAPES.items()],
                         process=process, supersede=supersede)
    first, *_ = h.stub.Join(req, metadata=auth_metadata(sh.TOKEN))  # the whole stream, as a learner reads it
    return first.header


def test_a_learner_id_belongs_to_the_process_that_joined_with_it(syncer: sh.Harness) -> None:
    """A second process cannot push as a live learner: it is refused at Join, and a push with a
    guessed or stolen-from-another-id secret is refused with Θ and the rounds untouched. A
    restarted process supersedes explicitly, and then its predecessor is the one refused."""
    first = join(syncer, "a-0", process=11)
    assert syncer.push(0, syncer.fragment_tensors(0), learner="a-0", secret=first.session_secret).accepted
    assert join(syncer, "a-0", process=11).session_secret  # the same process re-joining: fine
    code, details = code_of(lambda: join(syncer, "a-0", process=22))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "supersede" in details
    before = snapshot(syncer)
    other = join(syncer, "b-0", process=33).session_secret
    for secret in (b"", b"\x00" * 16, other, first.session_secret):  # the last: superseded by the re-join
        code, details = code_of(lambda: syncer.push(0, syncer.fragment_tensors(0), learner="a-0", secret=secret))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "a-0" in details
    assert_unchanged(syncer, before)
    restarted = join(syncer, "a-0", process=44, supersede=True)  # a restarted pod takes the id over
    assert syncer.push(0, syncer.fragment_tensors(0), learner="a-0", secret=restarted.session_secret).accepted
    assert syncer.core.metrics.registry.get_sample_value(
        "diloco_syncer_contributions_total", {"outcome": "impostor"}) == 5  # the refused Join and 4 pushes


def test_a_push_for_a_fragment_its_slot_does_not_assign_is_refused(syncer: sh.Harness) -> None:
    """Slot s is due for fragment s mod P (the shared schedule): a push claiming slot 3 for
    fragment 0 (of 2) is refused before its body is read, and nothing changes."""
    before = snapshot(syncer)
    code, details = code_of(lambda: syncer.push(0, syncer.fragment_tensors(0), slot=3))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "slot 3 is due for fragment 1, not fragment 0" in details
    assert_unchanged(syncer, before)
    assert syncer.push(0, syncer.fragment_tensors(0), slot=4).accepted


def test_admission_does_not_wait_for_a_merge(syncer: sh.Harness) -> None:
    """A push arriving while its fragment's round is being merged is admitted at once, into the
    version after the one being made, and both merges land."""
    import threading

    release, started = threading.Event(), threading.Event()
    real_merge = syncer.core.model.merge

    def slow_merge(closed, active=1):  # type: ignore[no-untyped-def]
        started.set()
        assert release.wait(10)
        return real_merge(closed, active)

    syncer.core.model.merge = slow_merge  # type: ignore[method-assign]
    assert syncer.push(0, syncer.fragment_tensors(0), slot=0).merged_into == 1
    syncer.clock.now += 10
    merger = threading.Thread(target=syncer.core.merge_ready)
    merger.start()
    try:
        assert started.wait(10)
        during = syncer.push(0, syncer.fragment_tensors(0), slot=2)  # would deadlock if admission waited
        assert during.accepted and during.merged_into == 2 and syncer.core.model.versions[0] == 0
    finally:
        release.set()
        merger.join(10)
    assert syncer.core.model.versions[0] == 1
    syncer.clock.now += 10
    assert syncer.core.merge_ready() == [0] and syncer.core.model.versions[0] == 2


def test_a_push_one_without_its_header_is_refused(syncer: sh.Harness) -> None:
    before = snapshot(syncer)
    code, details = code_of(lambda: syncer.stub.PushOne(pb.PushChunk(data=b"x"), metadata=auth_metadata(sh.TOKEN)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "header" in details
    assert_unchanged(syncer, before)


def test_a_malformed_push_is_refused_with_the_reason(syncer: sh.Harness) -> None:
    """Chunks are parsed by hand (diloco.wire.Chunk), so a malformed one must still be refused
    by name, not crash the handler or pass as an empty push."""
    before = snapshot(syncer)
    good = pb.PushChunk(header=pb.PushHeader(learner="a-0", fragment=0, total_bytes=3), data=b"abc").SerializeToString()
    raw = syncer.channel.unary_unary("/diloco.v1.Syncer/PushOne", request_serializer=lambda b: b,
                                     response_deserializer=pb.PushReply.FromString)
    for bad in (good[:-1], b"\x08\x01" + good, b"\x0a\x02\xff\xff"):
        code, details = code_of(lambda: raw(bad, metadata=auth_metadata(sh.TOKEN), timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "malformed PushChunk" in details, details
    assert_unchanged(syncer, before)


class Counting(SyncerServicer):
    """Counts which push RPC the client used; `push_one=False` plays a syncer from before PushOne."""

    def __init__(self, core: SyncerCore, push_one: bool) -> None:
        super().__init__(core, sh.TOKEN)
        self.push_one, self.calls = push_one, {"Push": 0, "PushOne": 0}

    def Push(self, request_iterator, context):  # type: ignore[no-untyped-def]
        self.calls["Push"] += 1
        return super().Push(request_iterator, context)

    def PushOne(self, request, context):  # type: ignore[no-untyped-def]
        self.calls["PushOne"] += 1
        if not self.push_one:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        return super().PushOne(request, context)


@pytest.mark.parametrize("push_one", [True, False], ids=["current syncer", "syncer without PushOne"])
def test_the_client_pushes_unary_and_streams_to_a_syncer_without_push_one(syncer: sh.Harness, push_one: bool) -> None:
    servicer = Counting(syncer.core, push_one)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=server_options())
    add_syncer(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = SyncerClient(f"127.0.0.1:{port}", sh.TOKEN, "a-0", "r")
    try:
        client.join_with_retry(dict(sh.SHAPES))
        client.start()
        plan = syncer.core.model.plan
        for push_id, p in enumerate((0, 1), start=1):
            delta = {n: np.full(sh.SHAPES[n], 0.01, np.float32) for n in plan.fragments[p]}
            client.submit(Push(fragment=p, base_version=0, push_id=push_id, slot=p, steps=4, tokens=2048,
                               session_tokens=2048 * push_id, delta=delta, blob=encode_tensors(delta, "int4"),
                               incarnation=client.incarnation, step_seconds=0.05, loss=2.0, train_seconds=1.0))
        assert client.flush(timeout=10)
        assert {p for p in (0, 1) if "a-0" in syncer.core.book.contributors(p)} == {0, 1}  # both admitted
        # A current syncer takes both as PushOne; an older one refuses the first, and the
        # client streams that one and every later push.
        assert servicer.calls == ({"Push": 0, "PushOne": 2} if push_one else {"Push": 2, "PushOne": 1})
        assert client.push_one is push_one
    finally:
        client.close()
        server.stop(0)


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, (1 << 20) + 5])
def test_a_publish_chunk_framed_by_hand_parses_as_the_message_protobuf_builds(size: int) -> None:
    """The syncer appends each chunk's data to a serialised head by hand (one copy of the bytes
    instead of three, one head for every chunk): every subscriber parses exactly the message the
    generated code would have sent."""
    from diloco.wire import framed

    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    head = pb.Published(fragment=3, version=9, total_bytes=size, last=True, incarnation="abc", delta=True, slot=4,
                        tag=b"t" * 32)
    whole = copy.deepcopy(head)
    whole.data = data
    number = pb.Published.DESCRIPTOR.fields_by_name["data"].number
    assert pb.Published.FromString(framed(head.SerializeToString(), number, memoryview(data))) == whole
