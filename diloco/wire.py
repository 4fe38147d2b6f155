"""The gRPC wire: stubs generated from `diloco/proto/diloco.proto`, chunking and auth.

Stubs are generated on first import (and at image build time, `python -m diloco.wire`)
with the grpcio-tools that is installed, so they always match the installed grpcio and
protobuf instead of pinning the versions that happened to generate a committed copy.
"""

from __future__ import annotations

import hmac
import importlib
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from diloco.core.codecs import encode_tensors
from diloco.core.seed import seed_hash

CHUNK_BYTES = 1 << 20  # 1 MiB: per-message overhead is negligible, and far below gRPC's message caps
MAX_MESSAGE_BYTES = 8 << 20  # head-room over one chunk plus headers
TOKEN_HEADER = "authorization"

_PROTO_DIR = Path(__file__).resolve().parent / "proto"
_GENERATED = ("diloco_pb2.py", "diloco_pb2.pyi", "diloco_pb2_grpc.py")
KEEPALIVE_MS = 10_000  # notice a dead peer within seconds, not minutes
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # A channel that failed to connect waits before trying again, growing to 120 s by default:
    # a learner would then sit out a restarted syncer for minutes. Keep retries within 2 s;
    # the callers' own backoff (trainer/sync/client.py) spaces out the RPCs themselves.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


def server_options(keepalive_ms: int = KEEPALIVE_MS) -> list[tuple[str, int]]:
    """A server's options: the channels' own, and pings accepted as often as peers send them.
    gRPC's server takes a ping at most every 5 minutes while it sends nothing and hangs up after
    two too early ("too many pings"), so an RPC it works on for 30 s without answering yet (a
    Seed of a 1e9 model: decoded and its heap reserved before the reply) was cut off by the
    client's own keepalive."""
    opts = [(k, keepalive_ms if k == "grpc.keepalive_time_ms" else v) for k, v in GRPC_OPTIONS]
    return [*opts, ("grpc.http2.min_ping_interval_without_data_ms", keepalive_ms // 2)]


def _generate() -> None:
    """Run protoc into a temporary tree and move the results in atomically."""
    from grpc_tools import protoc

    root = _PROTO_DIR.parent.parent
    with tempfile.TemporaryDirectory(dir=_PROTO_DIR) as tmp:
        include = Path(protoc.__file__).resolve().parent / "_proto"
        rc = protoc.main([
            "protoc", f"-I{root}", f"-I{include}", f"--python_out={tmp}", f"--grpc_python_out={tmp}",
            f"--pyi_out={tmp}",  # message types for mypy
            str(_PROTO_DIR.relative_to(root) / "diloco.proto"),
        ])
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc} on {_PROTO_DIR / 'diloco.proto'}")
        for name in _GENERATED:
            os.replace(Path(tmp) / "diloco" / "proto" / name, _PROTO_DIR / name)


def _load() -> tuple[ModuleType, ModuleType]:
    proto = _PROTO_DIR / "diloco.proto"
    made = [_PROTO_DIR / name for name in _GENERATED]
    if not all(m.exists() for m in made) or min(m.stat().st_mtime for m in made) < proto.stat().st_mtime:
        try:
            _generate()
        except OSError as exc:
            raise RuntimeError(
                f"cannot write gRPC stubs next to {proto} ({exc}); run `python -m diloco.wire` "
                "once as a user who can write there (the images do this at build time)"
            ) from exc
    return importlib.import_module("diloco.proto.diloco_pb2"), importlib.import_module("diloco.proto.diloco_pb2_grpc")


if TYPE_CHECKING:  # the generated .pyi types every message; the stubs module is plain Python
    from diloco.core.ledger import Push
    from diloco.proto import diloco_pb2 as pb
    from diloco.proto import diloco_pb2_grpc as rpc
else:
    pb, rpc = _load()


def channel(address: str, ca: bytes | None = None, server_name: str | None = None) -> grpc.Channel:
    """A channel to the syncer as every client opens it: TLS when a CA is given (the name the
    certificate carries may differ from the address: `server_name`), else plaintext."""
    if ca is None:
        return grpc.insecure_channel(address, options=GRPC_OPTIONS)
    options = GRPC_OPTIONS + ([("grpc.ssl_target_name_override", server_name)] if server_name else [])
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca), options=options)


def add_syncer(servicer: Any, server: grpc.Server) -> None:
    """`rpc.add_SyncerServicer_to_server`, except that Subscribe, Join and FetchState may also yield their
    messages already serialised (bytes), which go on the wire as they are: the syncer then
    serialises each publish once for all its subscribers instead of once per subscriber, and
    frames a Join's model chunks straight from its arrays; and
    Push, PushOne, Recover and ShareState receive `Chunk`s, parsed without upb."""

    class Capture:  # takes the generated method handlers instead of a server
        def __init__(self) -> None:
            self.handlers: dict[str, grpc.RpcMethodHandler] = {}

        def add_generic_rpc_handlers(self, _: object) -> None:
            pass

        def add_registered_method_handlers(self, _: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
            self.handlers = dict(handlers)

    capture = Capture()
    rpc.add_SyncerServicer_to_server(servicer, capture)
    handlers = capture.handlers
    for method in ("Subscribe", "Join", "FetchState"):  # server streams the syncer may frame itself (`framed`)
        handlers[method] = handlers[method]._replace(response_serializer=_serialised)  # type: ignore[attr-defined]
    for method, header in (("Push", pb.PushHeader), ("PushOne", pb.PushHeader), ("Recover", pb.RecoverHeader),
                           ("ShareState", pb.StateHeader)):  # client streams of chunks: parsed by hand (Chunk)
        handlers[method] = handlers[method]._replace(request_deserializer=chunk_parser(header))  # type: ignore[attr-defined]
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("diloco.v1.Syncer", handlers),))
    server.add_registered_method_handlers("diloco.v1.Syncer", handlers)  # type: ignore[attr-defined]  # grpcio >= 1.63


@dataclass(frozen=True)
class Chunk:
    """One message of a client stream (PushChunk, RecoverChunk, StateChunk: the header in the
    first, then bytes), parsed by hand on the syncer. `data` is a view of the received message.
    Parsed by protobuf's upb, every pushed byte was copied into the message's arena and out again
    as `bytes`, and every message's arena counted towards the malloc_trim(0) upb calls once per
    10,000 frees: at 1e9 parameters that handed GBs of the syncer's free heap back to the kernel
    about once a minute, to be faulted in again (docs/BENCHMARKS.md §5)."""

    header: Any  # the header message, None if the chunk has none
    data: memoryview
    error: str = ""  # why the bytes are not a valid chunk; "" when they are


def chunk_parser(header_type: Any) -> Callable[[bytes], Chunk]:
    """A request deserializer for chunks whose header (field 1) is a `header_type`. It never
    raises: a malformed message comes back with `error` set, so the servicer refuses it with a
    reason instead of gRPC's bare "Exception deserializing request". Unknown fields are skipped,
    as protobuf skips them, and repeated ones merge (header) or replace (data) as protobuf's do."""

    def parse(raw: bytes) -> Chunk:
        buf = memoryview(raw)
        header, data, pos = None, buf[:0], 0
        try:
            while pos < len(buf):
                key, pos = _read_varint(buf, pos)
                field, kind = key >> 3, key & 7
                if not 0 < field < 1 << 29:
                    raise ValueError(f"field number {field} is outside protobuf's range")
                if kind == 2:
                    size, pos = _read_varint(buf, pos)
                    end = pos + size
                    if end > len(buf):
                        raise ValueError(f"field {field} runs past the end of the message")
                    if field == 1:
                        header = header or header_type()
                        header.MergeFromString(buf[pos:end])
                    elif field == 2:
                        data = buf[pos:end]
                    pos = end
                elif field in (1, 2):
                    raise ValueError(f"field {field} has wire type {kind}, not length-delimited")
                elif kind == 0:
                    _, pos = _read_varint(buf, pos)
                elif kind in (1, 5):
                    pos += 8 if kind == 1 else 4
                else:
                    raise ValueError(f"unsupported wire type {kind}")
            if pos > len(buf):
                raise ValueError("the last field runs past the end of the message")
        except (ValueError, DecodeError) as exc:
            return Chunk(None, buf[:0], f"malformed {header_type.__name__.removesuffix('Header')}Chunk: {exc}")
        return Chunk(header, data)

    return parse


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while shift < 64:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise ValueError("varint longer than 10 bytes")


def _serialised(message: Any) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def framed(head: bytes, number: int, *data: bytes | memoryview) -> bytes:
    """A serialised message `head` (without field `number`) followed by the concatenation of
    `data` as that bytes field, each byte copied once (setting it and serialising would copy it
    three times: a fragment of a 1e9-parameter model is 44 MB per publish, the model 4 GB per
    Join). A protobuf parser takes concatenated encodings as one message, so one head serialised
    once frames every chunk."""
    return b"".join((head, _varint(number << 3 | 2), _varint(sum(len(d) for d in data)), *data))


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def chunks(blob: bytes | memoryview, size: int = CHUNK_BYTES) -> Iterator[memoryview]:
    view = memoryview(blob)
    for start in range(0, len(view), size):
        yield view[start : start + size]
    if not view:
        yield view


def push_header(push: Push, *, learner: str, region: str, session: int, secret: bytes) -> pb.PushHeader:
    """The one conversion of a learner's push record (diloco/core/ledger.py `Push`) into its wire
    shape, the `PushHeader` that goes ahead of `push.blob`; the sender's identity (learner id,
    region, process, session secret) comes from its Join. The syncer turns the header into its
    own merge input in one place too (syncer/round.py `contribution`)."""
    return pb.PushHeader(
        learner=learner, region=region, incarnation=push.incarnation, fragment=push.fragment,
        base_version=push.base_version, steps=push.steps, tokens=push.tokens, step_seconds=push.step_seconds,
        total_bytes=len(push.blob), loss=push.loss, session=session, push_id=push.push_id, slot=push.slot,
        session_tokens=push.session_tokens, session_secret=secret,
    )


def push_chunks(header: pb.PushHeader, blob: bytes | memoryview) -> Iterator[pb.PushChunk]:
    """A push's messages: the header with the first chunk of the bundle, then the rest."""
    for i, part in enumerate(chunks(blob)):
        yield pb.PushChunk(header=header if i == 0 else None, data=bytes(part))


def push(stub: Any, header: pb.PushHeader, blob: bytes | memoryview, metadata: Any, *, timeout: float,
         unary: bool = True) -> pb.PushReply:
    """One push: `PushOne` when the bundle fits one chunk (gRPC's Python client starts a thread
    for every client stream, and spends about twice the CPU: bench/push_rpc.py), `Push`
    otherwise or with `unary=False` (a syncer from before PushOne)."""
    if unary and len(blob) <= CHUNK_BYTES:  # protobuf takes only `bytes`: the one copy (an encoder's blob is a view)
        return stub.PushOne(pb.PushChunk(header=header, data=bytes(blob)), metadata=metadata, timeout=timeout)
    return stub.Push(push_chunks(header, blob), metadata=metadata, timeout=timeout)


# -- seeding: the first learner hands an unseeded syncer Θ₀ (syncer/joins/seeding.py) ---------------

UNSEEDED = "unseeded shard"  # the Join refusal's prefix, which the learner's client recognises


def unseeded_message(shard: int, shards: int) -> str:
    return f"{UNSEEDED} {shard} of {shards}: send Θ₀ (Seed) and join again"


def parse_unseeded(details: str) -> tuple[int, int] | None:
    """(shard, shards) from a Join refusal of an unseeded syncer, else None."""
    if not details.startswith(UNSEEDED):
        return None
    try:
        shard, _, shards = details.removeprefix(UNSEEDED).split(":")[0].split()
        return int(shard), int(shards)
    except ValueError:
        return None


def seed_chunks(learner: str, shapes: Mapping[str, Sequence[int]], tensors: Mapping[str, np.ndarray]
                ) -> Iterator[pb.SeedChunk]:
    """A Seed RPC's stream: every tensor's shape (the plan), then `tensors` (what the syncer
    holds) as an fp32 bundle in chunks."""
    blob = encode_tensors(dict(tensors), "fp32")
    header = pb.SeedHeader(learner=learner, tensors=[pb.TensorShape(name=n, shape=list(s)) for n, s in shapes.items()],
                           total_bytes=len(blob), init_hash=seed_hash(tensors))
    for i, part in enumerate(chunks(blob)):
        yield pb.SeedChunk(header=header if i == 0 else None, data=bytes(part))


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((TOKEN_HEADER, f"Bearer {token}"),)


def token_matches(metadata: object, token: str) -> bool:
    """Constant-time comparison of the caller's bearer token with the job's."""
    presented = ""
    for key, value in metadata or ():  # type: ignore[attr-defined]
        if key == TOKEN_HEADER and isinstance(value, str):
            presented = value.removeprefix("Bearer ")
    return hmac.compare_digest(presented.encode(), token.encode())


def authenticate(context: grpc.ServicerContext, token: str) -> None:
    """Abort the RPC unless it carries the job token (every syncer RPC starts with this)."""
    if not token_matches(context.invocation_metadata(), token):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong job token")


if __name__ == "__main__":
    _generate()
    print(f"generated gRPC stubs in {_PROTO_DIR}")
