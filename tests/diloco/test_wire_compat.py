"""A learner of the last release and a syncer of this one (and the reverse) read each other's
messages: renamed proto fields kept their numbers and types (issue 60).

`fixtures/diloco_e9e7f92.proto` is diloco/proto/diloco.proto as released at git commit e9e7f92,
before the token counts were renamed, with only its `package` line changed (diloco.v1 ->
diloco.release_e9e7f92), so both schemas load into one process's descriptor pool; proto3's binary
encoding carries field numbers only, never the package or a field's name. The test compiles it
with grpc_tools.protoc, as diloco/wire.py compiles the current one, and checks every message of
the old schema field by field against the new, in both directions: a renumbering, a type change
or a rename missing from RENAMED fails here.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from diloco.wire import chunk_parser, pb

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "diloco_e9e7f92.proto"

# (message, name at e9e7f92) -> name now. Every other field kept its name.
RENAMED = {
    ("JoinHeader", "resume_tokens"): "tokens_merged",  # 12: the learner id's tokens that merges credited
    ("PushHeader", "trained_tokens"): "session_tokens",  # 14: the process's trained tokens in all
    ("LearnerStatus", "tokens"): "tokens_merged",  # 5: the learner's tokens that merges credited
}


@pytest.fixture(scope="module")
def old(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """The e9e7f92 schema's generated messages, compiled into a temporary folder."""
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("release_e9e7f92")
    include = Path(protoc.__file__).resolve().parent / "_proto"
    rc = protoc.main(["protoc", f"-I{FIXTURE.parent}", f"-I{include}", f"--python_out={out}", FIXTURE.name])
    assert rc == 0, f"protoc failed on {FIXTURE}"
    spec = importlib.util.spec_from_file_location("diloco_e9e7f92_pb2", out / "diloco_e9e7f92_pb2.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def new_name(message: str, old_name: str) -> str:
    return RENAMED.get((message, old_name), old_name)


def messages(descriptor: Any) -> Iterator[Any]:
    """Every message type of a file descriptor, nested ones (a map's entries) included."""
    todo = list(descriptor.message_types_by_name.values())
    while todo:
        m = todo.pop(0)
        todo.extend(m.nested_types)
        yield m


def relative(m: Any) -> str:
    """A message type's name within its package: `StatusReply.RefusedByOutcomeEntry`."""
    return m.full_name.removeprefix(m.file.package + ".")


def test_the_fixture_is_the_release_with_only_its_package_renamed() -> None:
    lines = FIXTURE.read_text().splitlines()
    assert [line for line in lines if line.startswith("package ")] == ["package diloco.release_e9e7f92;"]
    assert "uint64 trained_tokens = 14;" in FIXTURE.read_text()  # the release's names, not today's


def test_every_field_keeps_its_number_and_type(old: ModuleType) -> None:
    new_types = {relative(m): m for m in messages(pb.DESCRIPTOR)}
    renamed_seen = set()
    for m in messages(old.DESCRIPTOR):
        name = relative(m)
        assert name in new_types, f"message {name} is gone"
        now = {f.number: f for f in new_types[name].fields}
        for f in m.fields:
            assert f.number in now, f"{name}.{f.name} = {f.number} is gone (retire a number with `reserved`)"
            g = now[f.number]
            assert g.name == new_name(name, f.name), f"{name} field {f.number}: {f.name} became {g.name} " \
                "(a rename must be listed in RENAMED)"
            assert (g.type, g.is_repeated) == (f.type, f.is_repeated), f"{name}.{g.name} = {f.number} changed type"
            if f.message_type is not None:
                assert relative(g.message_type) == relative(f.message_type), f"{name}.{g.name} changed type"
            if (name, f.name) in RENAMED:
                renamed_seen.add((name, f.name))
        # No field of today may take a number the release used for another field.
        assert {f.number for f in m.fields} <= set(now)
    assert renamed_seen == set(RENAMED)  # the table names renames that really happened
    old_rpcs = {r.name: (relative(r.input_type), relative(r.output_type), r.client_streaming, r.server_streaming)
                for r in old.DESCRIPTOR.services_by_name["Syncer"].methods}
    new_rpcs = {r.name: (relative(r.input_type), relative(r.output_type), r.client_streaming, r.server_streaming)
                for r in pb.DESCRIPTOR.services_by_name["Syncer"].methods}
    assert old_rpcs.items() <= new_rpcs.items()


def fill(message: Any, counter: Iterator[int], depth: int = 0) -> Any:
    """`message` with every field set to a value distinct from every other field's and from its
    default (bools: true): a field read under the wrong number shows."""
    for f in message.DESCRIPTOR.fields:
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            key, value = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
            assert value.message_type is None, "fill a map of messages here"
            getattr(message, f.name)[scalar(key, next(counter))] = scalar(value, next(counter))
        elif f.message_type is not None:
            if depth < 3:
                child = getattr(message, f.name).add() if f.is_repeated else getattr(message, f.name)
                fill(child, counter, depth + 1)
        elif f.is_repeated:
            getattr(message, f.name).extend([scalar(f, next(counter)), scalar(f, next(counter))])
        else:
            setattr(message, f.name, scalar(f, next(counter)))
    return message


def scalar(f: Any, n: int) -> Any:
    if f.type in (f.TYPE_UINT64, f.TYPE_UINT32):
        return 1000 + n
    if f.type == f.TYPE_DOUBLE:
        return n + 0.5
    if f.type == f.TYPE_STRING:
        return f"{f.name}-{n}"
    if f.type == f.TYPE_BYTES:
        return f"{f.name}-{n}".encode()
    if f.type == f.TYPE_BOOL:
        return True
    raise AssertionError(f"fill a field of type {f.type} ({f.full_name}) here")


def by_number(message: Any) -> dict[int, Any]:
    """A message's values keyed by field number (names differ across the releases)."""
    out: dict[int, Any] = {}
    for f in message.DESCRIPTOR.fields:
        value = getattr(message, f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            out[f.number] = dict(value)
        elif f.message_type is not None and f.is_repeated:
            out[f.number] = [by_number(v) for v in value]
        elif f.message_type is not None:
            out[f.number] = by_number(value) if message.HasField(f.name) else None
        else:
            out[f.number] = list(value) if f.is_repeated else value
    return out


@pytest.mark.parametrize("name", [relative(m) for m in pb.DESCRIPTOR.message_types_by_name.values()])
def test_an_old_message_reads_the_same_under_the_new_names(old: ModuleType, name: str) -> None:
    """What a learner (or syncer) of the release sends, the new stubs parse to the same values."""
    sent = fill(getattr(old, name)(), itertools.count(1))
    got = getattr(pb, name).FromString(sent.SerializeToString())
    assert by_number(got) == by_number(sent)  # same numbers, same values: no field left unknown
    for (message, was), now in RENAMED.items():
        if message == name:
            assert getattr(got, now) == getattr(sent, was) != 0


@pytest.mark.parametrize("name", [relative(m) for m in pb.DESCRIPTOR.message_types_by_name.values()])
def test_a_new_message_reads_the_same_under_the_old_names(old: ModuleType, name: str) -> None:
    """What this release sends, a peer of the last release parses to the same values."""
    sent = fill(getattr(pb, name)(), itertools.count(1))
    got = getattr(old, name).FromString(sent.SerializeToString())
    known = {f.number for f in got.DESCRIPTOR.fields}
    assert by_number(got) == {k: v for k, v in by_number(sent).items() if k in known}
    for (message, was), now in RENAMED.items():
        if message == name:
            assert getattr(got, was) == getattr(sent, now) != 0


def test_the_syncers_own_parser_takes_an_old_learners_push(old: ModuleType) -> None:
    """The syncer parses push chunks by hand (diloco.wire.chunk_parser): a release learner's push
    arrives with its process's trained tokens as `session_tokens`."""
    header = fill(old.PushHeader(), itertools.count(1))
    raw = old.PushChunk(header=header, data=b"bundle").SerializeToString()
    chunk = chunk_parser(pb.PushHeader)(raw)
    assert chunk.error == "" and bytes(chunk.data) == b"bundle" and chunk.header is not None
    assert chunk.header.session_tokens == header.trained_tokens != 0
    assert (chunk.header.tokens, chunk.header.steps, chunk.header.push_id) == (header.tokens, header.steps,
                                                                               header.push_id)
