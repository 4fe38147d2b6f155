"""The syncer's hand-written chunk parser (diloco.wire.chunk_parser) against protobuf's own."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.core.ledger import Push
from diloco.wire import _varint, chunk_parser, pb, push_header

KINDS = [(pb.PushChunk, pb.PushHeader), (pb.RecoverChunk, pb.RecoverHeader), (pb.StateChunk, pb.StateHeader)]
# A varint, 64-bit or 32-bit field of a number these chunks do not have (a newer sender's).
unknown_field = st.builds(lambda n, kind, v: _varint(n << 3 | kind) + (_varint(v) if kind == 0 else bytes(8 if kind == 1 else 4)),
                          st.integers(3, 15), st.sampled_from([0, 1, 5]), st.integers(0, 2**40))


@given(st.sampled_from(KINDS), st.booleans(), st.binary(max_size=600), st.integers(0, 2**31), st.lists(unknown_field, max_size=2))
@settings(max_examples=150, deadline=None)
def test_valid_chunks_parse_as_protobuf_parses_them(kind, with_header: bool, data: bytes, total: int, extra: list[bytes]) -> None:
    message, header_type = kind
    chunk = message(data=data)
    if with_header:
        chunk.header.CopyFrom(header_type(total_bytes=total))
    raw = b"".join(extra) + chunk.SerializeToString()  # unknown fields first: they are skipped
    got = chunk_parser(header_type)(raw)
    want = message.FromString(raw)
    assert got.error == ""
    assert bytes(got.data) == want.data
    assert (got.header is not None) == want.HasField("header")
    if got.header is not None:
        assert got.header == want.header


@given(st.binary(max_size=64))
@settings(max_examples=300, deadline=None)
def test_any_bytes_give_a_chunk_or_a_reason_never_an_exception(raw: bytes) -> None:
    got = chunk_parser(pb.PushHeader)(raw)
    if got.error:
        assert got.error.startswith("malformed PushChunk") and got.header is None and not got.data
    else:  # what we accept, protobuf reads the same way
        want = pb.PushChunk.FromString(raw)
        assert bytes(got.data) == want.data and (got.header is not None) == want.HasField("header")


def test_a_push_record_fills_every_field_of_its_header() -> None:
    """`push_header` is the one conversion of the learner's push record to the wire: each header
    field comes from the record or the sender's Join, and a field added to PushHeader that it
    forgets fails here."""
    push = Push(fragment=3, base_version=7, push_id=11, slot=13, steps=4, tokens=2048, session_tokens=8192,
                delta={}, blob=b"x" * 17, incarnation="inc", step_seconds=0.25, loss=2.5, train_seconds=9.0)
    h = push_header(push, learner="a-0", region="eu", session=5, secret=b"s3cret")
    assert all(h.HasField(f.name) if f.has_presence else getattr(h, f.name) for f in h.DESCRIPTOR.fields)
    assert (h.learner, h.region, h.session, h.session_secret) == ("a-0", "eu", 5, b"s3cret")
    assert (h.fragment, h.base_version, h.push_id, h.slot, h.steps, h.tokens, h.session_tokens, h.incarnation,
            h.step_seconds, h.loss, h.total_bytes) == (3, 7, 11, 13, 4, 2048, 8192, "inc", 0.25, 2.5, 17)


@pytest.mark.slow
def test_a_server_busy_on_an_rpc_for_several_keepalives_is_not_hung_up_on() -> None:
    """A client-streamed RPC the server works on for 8 of the client's keepalive intervals before
    answering (a large Seed): gRPC's default server policy hung up ("too many pings") after
    three; `server_options` takes the client's pings. Keepalive scaled to 1 s to be quick."""
    from concurrent import futures

    import grpc

    from diloco.wire import GRPC_OPTIONS, server_options

    ka = 1000  # gRPC pings no more often than about once a second, whatever is asked

    def slow(requests, context) -> bytes:
        got = sum(len(r) for r in requests)
        time.sleep(8 * ka / 1000)
        return str(got).encode()

    def call(options: list) -> str:
        handler = grpc.method_handlers_generic_handler("t.Slow", {"Up": grpc.stream_unary_rpc_method_handler(slow)})
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=options)
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        client = [(k, ka if k == "grpc.keepalive_time_ms" else v) for k, v in GRPC_OPTIONS]
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}", options=client) as channel:
                return channel.stream_unary("/t.Slow/Up")(iter([b"x" * 100] * 3), timeout=30).decode()
        except grpc.RpcError as exc:
            return exc.details() or ""
        finally:
            server.stop(None)

    assert call(server_options(ka)) == "300"
    assert call([(k, ka if k == "grpc.keepalive_time_ms" else v) for k, v in GRPC_OPTIONS]) == "Too many pings"
