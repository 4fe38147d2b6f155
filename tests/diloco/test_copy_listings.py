"""Data near its learners (diloco/spec/copy_listings.py, diloco/copy_listings.py): a learner group reads its own
copy of the data (`learnerGroups[].data.path` or `{region}` in spec.data.source.path), every copy
must hold the same files and sizes, and a mismatch is refused by `diloco validate --inputs`,
`diloco run` and the syncer at Join (which keeps the first admitted listing in its checkpoint)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import yaml

from diloco import copy_listings
from diloco.contract import Exit
from diloco.spec import SpecError, parse_job
from diloco.syncer.acceptance import Refused
from diloco.syncer.global_model import GlobalModel
from diloco.syncer.joins.readmission import check_data
from diloco.trainer import data
from diloco.trainer.sync.client import SyncerClient
from diloco.wire import pb
from tests import syncer_harness as sh
from tests.helpers import TINY_MODEL, diloco_run
from tests.syncer.joins.test_seeding import SPEC, initial, unseeded  # noqa: F401 (the fixture)
from tests.trainer.data.test_streams import CountingFS, jsonl, small_units, write  # noqa: F401 (the fixture)


def job(source: dict[str, Any], groups: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "copies"},
            "spec": {"learnerGroups": groups, "data": {"source": source}, **spec}}


def problems(manifest: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_job(manifest)
    return info.value.problems


def test_region_placeholder_and_group_paths_resolve_per_group() -> None:
    spec = parse_job(job({"kind": "parquet", "path": "gs://corpus-{region}/train/*.parquet",
                          "heldOutPath": "gs://corpus-{region}/val/*.parquet"},
                         [{"name": "us", "region": "us-east1"}, {"name": "eu", "region": "europe-west4"},
                          {"name": "lab", "region": "onprem",
                           "data": {"path": "/mnt/corpus/train/*.parquet", "heldOutPath": "/mnt/corpus/val/*.parquet"}},
                          {"name": "ap", "region": "asia", "data": {"path": "s3://ap/{region}/*.parquet"}}])).spec
    got = {g.name: (spec.data_for(g.name).source.path, spec.data_for(g.name).source.held_out_path)
           for g in spec.learner_groups}
    assert got == {"us": ("gs://corpus-us-east1/train/*.parquet", "gs://corpus-us-east1/val/*.parquet"),
                   "eu": ("gs://corpus-europe-west4/train/*.parquet", "gs://corpus-europe-west4/val/*.parquet"),
                   "lab": ("/mnt/corpus/train/*.parquet", "/mnt/corpus/val/*.parquet"),
                   "ap": ("s3://ap/asia/*.parquet", "gs://corpus-asia/val/*.parquet")}  # the job's heldOutPath, filled
    assert spec.data.source.path == "gs://corpus-{region}/train/*.parquet"  # the job's own stays as written
    assert spec.data_for("us").source.kind == "parquet" and spec.data_for("us").seed == spec.data.seed
    plain = parse_job(job({"kind": "text", "path": "/d/*.txt"}, [{"name": "a"}])).spec
    assert plain.data_for("a") is plain.data  # no copies: the job's data itself


def test_the_spec_names_the_field_and_the_fix() -> None:
    bad = problems(job({"kind": "text", "path": "/d/{zone}/*.txt", "heldOutPath": "/v/{region}-{n}.txt"},
                       [{"name": "a", "region": "us/east"}]))
    assert bad == [
        "spec.data.source.path: placeholder {zone} is not known; only {region} (each learner group's region) is filled in",
        "spec.data.source.heldOutPath: placeholder {n} is not known; only {region} (each learner group's region) is filled in",
        "spec.learnerGroups[0].region: 'us/east' fills {region} in a data path; use letters, digits, '-', '_' and '.' "
        "(no '/' or glob characters), at most 63"]
    assert problems(job({"kind": "builtin"}, [{"name": "a"}, {"name": "b", "data": {"path": "/d/*.txt"}}])) == [
        "spec.learnerGroups[1].data.path: the builtin corpus reads no files, so there is no copy to read; set "
        "spec.data.source.kind and path, or remove the group's data"]
    assert problems(job({"kind": "text", "path": "/d/*.txt"}, [{"name": "a", "data": {"heldOutPath": "/v.txt"}}]))[0] \
        .startswith("spec.learnerGroups[0].data.heldOutPath: spec.data.source.heldOutPath is unset")
    assert problems(job({"kind": "text", "path": "/d/*.txt"}, [{"name": "a", "data": {"path": "/e/{x}.txt"}}])) == [
        "spec.learnerGroups[0].data.path: placeholder {x} is not known; only {region} (each learner group's region) "
        "is filled in"]
    assert problems(job({"kind": "text", "path": "/d/*.txt"}, [{"name": "a", "data": {"paths": "/e"}}])) == [
        "spec.learnerGroups[0].data.paths: unknown field; check its spelling (fields are camelCase)"]


def test_a_learner_reads_only_its_own_region_s_copy(small_units: None) -> None:  # noqa: F811
    """Two copies in fsspec (counted://us-east/, counted://eu-west/), {region} in the path: the
    eu learner's load and batches read bytes of the eu copy only, the us learner's of the us copy."""
    docs = [f"document {i} " + "lorem ipsum " * (i % 7 + 3) for i in range(400)]
    for region in ("us-east", "eu-west"):
        write(f"counted://{region}/train/a.jsonl", jsonl(docs[:200]))
        write(f"counted://{region}/train/b.jsonl", jsonl(docs[200:]))
    spec = parse_job(job({"kind": "jsonl", "path": "counted://{region}/train/*.jsonl"},
                         [{"name": "us", "region": "us-east"}, {"name": "eu", "region": "eu-west"}])).spec
    for group, index in (("eu", 0), ("us", 0)):
        CountingFS.read.clear()
        shard, count = spec.shard_of(group, index)
        corpus = data.load(spec.data_for(group), 256, 17, shard=(shard, count))
        data.Batches(corpus.train, 4, 17, seed=0, shard_index=shard).batch(0)
        region = "eu-west" if group == "eu" else "us-east"
        assert CountingFS.read and all(p.startswith(f"/{region}/") for p in CountingFS.read), dict(CountingFS.read)


def two_copies(root: Path, *, eu_b: bytes | None = None) -> None:
    """The same text in root/us-east and root/eu-west (a: 40% of the bytes, b: 60%), and a held-out file."""
    plays = b"\n".join(data.corpus_plays())[:300_000]
    cut = len(plays) * 2 // 5
    for region in ("us-east", "eu-west"):
        (root / region / "val").mkdir(parents=True)
        (root / region / "train" / "shakespeare").mkdir(parents=True)
        (root / region / "train" / "shakespeare" / "a.txt").write_bytes(plays[:cut])
        (root / region / "train" / "shakespeare" / "b.txt").write_bytes(plays[cut:] if region == "us-east" or eu_b is None
                                                                        else eu_b)
        (root / region / "val" / "v.txt").write_bytes(plays[:20_000])


def test_listing_names_files_relative_to_the_glob_s_fixed_prefix(tmp_path: Path) -> None:
    two_copies(tmp_path)
    src = parse_job(job({"kind": "text", "path": f"{tmp_path}/{{region}}/train/*/*.txt",
                         "heldOutPath": f"{tmp_path}/{{region}}/val/v.txt"}, [{"name": "eu", "region": "eu-west"}]))
    listing = copy_listings.list_copy(src.spec.data_for("eu").source)
    assert listing is not None and listing.root == f"{tmp_path}/eu-west/train/"
    sizes = [os.path.getsize(tmp_path / "eu-west" / "train" / "shakespeare" / n) for n in ("a.txt", "b.txt")]
    assert listing.files == ((False, "shakespeare/a.txt", sizes[0]), (False, "shakespeare/b.txt", sizes[1]),
                             (True, "v.txt", 20_000))
    assert listing.count == 3 and listing.total_bytes == sum(sizes) + 20_000
    assert listing.name(listing.files[2]) == f"{tmp_path}/eu-west/val/v.txt"
    assert copy_listings.fixed_prefix("gs://b/x/y-*.parquet") == "gs://b/x/" and copy_listings.fixed_prefix("/d/one.txt") == "/d/"


def validate(path: Path, capsys: pytest.CaptureFixture[str], inputs: bool = True) -> tuple[int, str]:
    """`diloco validate [--inputs]`: its exit code and stderr (stdout in VALID[0])."""
    from diloco.apps.commands import cmd_validate

    rc = cmd_validate(argparse.Namespace(file=str(path), gateway_api=False, inputs=inputs, no_kueue=False))
    got = capsys.readouterr()
    VALID[:] = [got.out]
    return rc, got.err


VALID = [""]


def test_copies_that_differ_in_one_file_s_size_are_refused_before_the_job_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`diloco validate --inputs` and `diloco run`'s own check (launch.load_config with inputs):
    exit 2 and one line naming the field, the file and both sizes."""
    from diloco.launch import load_config

    two_copies(tmp_path / "same")
    manifest = job({"kind": "text", "path": f"{tmp_path}/same/{{region}}/train/*/*.txt"},
                   [{"name": "us", "region": "us-east"}, {"name": "eu", "region": "eu-west", "replicas": 2}])
    (tmp_path / "same.yaml").write_text(yaml.safe_dump(manifest))
    assert validate(tmp_path / "same.yaml", capsys) == (0, "")
    total = sum(p.stat().st_size for p in (tmp_path / "same" / "us-east" / "train").rglob("*.txt"))
    assert VALID[0].splitlines()[1:] == [
        f"  spec.learnerGroups[{i}] ({r}) reads {tmp_path}/same/{r}/train/: 2 files, {total:,} bytes: the same files "
        "and sizes" for i, r in enumerate(("us-east", "eu-west"))]
    assert validate(tmp_path / "same.yaml", capsys, inputs=False) == (0, "")  # reads no files: says how to compare
    assert "compare their files and sizes with --inputs" in VALID[0]
    size = (tmp_path / "same" / "us-east" / "train" / "shakespeare" / "b.txt").stat().st_size
    two_copies(tmp_path / "differ", eu_b=b"x" * (size - 576))
    manifest["spec"]["data"]["source"]["path"] = f"{tmp_path}/differ/{{region}}/train/*/*.txt"
    (tmp_path / "differ.yaml").write_text(yaml.safe_dump(manifest))
    line = (f"spec.data.source.path ({{region}} = 'eu-west', spec.learnerGroups[1]): "
            f"{tmp_path}/differ/eu-west/train/shakespeare/b.txt is {size - 576:,} bytes, "
            f"{tmp_path}/differ/us-east/train/shakespeare/b.txt (spec.learnerGroups[0]) is {size:,}: "
            "every copy must hold the same files\n")
    assert validate(tmp_path / "differ.yaml", capsys) == (2, line)
    with pytest.raises(SystemExit) as info:
        load_config(str(tmp_path / "differ.yaml"), inputs=True)
    assert info.value.code == Exit.CONFIG and capsys.readouterr().err == line
    # A group's own path, a file missing from it: named by that field.
    manifest["spec"]["learnerGroups"][1]["data"] = {"path": f"{tmp_path}/same/eu-west/train/*/a.txt"}
    manifest["spec"]["data"]["source"]["path"] = f"{tmp_path}/same/{{region}}/train/*/*.txt"
    (tmp_path / "group.yaml").write_text(yaml.safe_dump(manifest))
    rc, err = validate(tmp_path / "group.yaml", capsys)
    assert rc == 2 and err == (f"spec.learnerGroups[1].data.path: {tmp_path}/same/eu-west/train/shakespeare/b.txt is "
                               f"missing, {tmp_path}/same/us-east/train/shakespeare/b.txt (spec.learnerGroups[0]) is "
                               f"{size:,} bytes: every copy must hold the same files\n")
    # The held-out files are compared too, and named by the held-out field.
    (tmp_path / "same" / "eu-west" / "val2").mkdir()
    (tmp_path / "same" / "eu-west" / "val2" / "v.txt").write_bytes(b"y" * 19_999)
    manifest["spec"]["learnerGroups"][1]["data"] = {"heldOutPath": f"{tmp_path}/same/eu-west/val2/v.txt"}
    manifest["spec"]["data"]["source"]["heldOutPath"] = f"{tmp_path}/same/us-east/val/v.txt"
    (tmp_path / "held.yaml").write_text(yaml.safe_dump(manifest))
    rc, err = validate(tmp_path / "held.yaml", capsys)
    assert rc == 2 and err == (f"spec.learnerGroups[1].data.heldOutPath: {tmp_path}/same/eu-west/val2/v.txt is "
                               f"19,999 bytes, {tmp_path}/same/us-east/val/v.txt (spec.learnerGroups[0]) is 20,000: "
                               "every copy must hold the same files\n")


def listing(sizes: dict[str, int], root: str = "gs://us/train/") -> copy_listings.Listing:
    return copy_listings.make(root, "", [(False, n, s) for n, s in sizes.items()])


def join_request(learner: str, got: copy_listings.Listing) -> pb.JoinRequest:
    return pb.JoinRequest(learner=learner, data=copy_listings.to_pb(got))


def model() -> GlobalModel:
    return GlobalModel(SPEC, sh.params(0), [0] * SPEC.plan_size)


def test_the_syncer_keeps_the_first_listing_and_refuses_another() -> None:
    m = model()
    us = listing({"000.parquet": 1_048_000, "001.parquet": 7})
    check_data(m, join_request("us-0", us))
    assert m.data_listing == (us, "learner us-0")
    check_data(m, join_request("us-1", listing({"000.parquet": 1_048_000, "001.parquet": 7}, "gs://eu/train/")))
    check_data(m, pb.JoinRequest(learner="old-0"))  # no listing (builtin data, an older learner): not checked
    with pytest.raises(Refused) as info:
        check_data(m, join_request("eu-0", listing({"000.parquet": 1_048_576, "001.parquet": 7}, "gs://eu/train/")))
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.reason == ("learner eu-0's data: gs://eu/train/000.parquet is 1,048,576 bytes, "
                                 "gs://us/train/000.parquet (learner us-0) is 1,048,000: every copy must hold the "
                                 "same files (spec.data.source.path, learnerGroups[].data)")
    assert m.data_listing == (us, "learner us-0")  # the first one stays
    # The checkpoint keeps it: a restarted syncer goes on refusing.
    arrays, meta = m.state()
    restored = GlobalModel.from_state(SPEC, arrays, json.loads(json.dumps(meta)))
    assert restored.data_listing == m.data_listing
    with pytest.raises(Refused, match=r"001\.parquet is missing"):
        check_data(restored, join_request("eu-1", listing({"000.parquet": 1_048_000}, "gs://eu/train/")))
    bad = dict(json.loads(json.dumps(meta)), data_listing={"root": "x", "files": "nope"})
    with pytest.raises(ValueError, match="checkpoint data_listing is malformed"):
        GlobalModel.from_state(SPEC, arrays, bad)


def malformed(**change: Any) -> pb.DataListing:
    good = copy_listings.to_pb(listing({"a": 1, "b": 2}))
    msg = pb.DataListing()
    msg.CopyFrom(good)
    for key, value in change.items():
        if key == "files":
            del msg.files[:]
            msg.files.extend(value)
        else:
            setattr(msg, key, value)
    return msg


@pytest.mark.parametrize(("change", "words"), [
    ({"digest": b"short"}, "a digest of 5 bytes, expected 32"),
    ({"count": 3}, "2 files named for a count of 3"),
    ({"count": copy_listings.MAX_FILES + 1}, "at most 10,000,000 are allowed"),
    ({"total_bytes": 4}, "the total size is not the sum"),
    ({"files": [pb.DataFile(name="b", size=2), pb.DataFile(name="a", size=1)]}, "out of order or repeated at 'a'"),
    ({"files": [pb.DataFile(name="a", size=1), pb.DataFile(name="a", size=2)], "total_bytes": 3},
     "out of order or repeated at 'a'"),
    ({"files": [pb.DataFile(name="", size=1), pb.DataFile(name="b", size=2)]}, "file 0's name is empty"),
    ({"files": [pb.DataFile(name="a", size=1), pb.DataFile(name="c", size=2)]}, "the digest does not match"),
    ({"root": "r" * 5000}, "a root of more than 4096 characters"),
])
def test_a_malformed_listing_is_refused_and_changes_nothing(change: dict[str, Any], words: str) -> None:
    m = model()
    with pytest.raises(Refused) as info:
        check_data(m, pb.JoinRequest(learner="x-0", data=malformed(**change)))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.reason, info.value.reason
    assert m.data_listing is None
    check_data(m, pb.JoinRequest(learner="x-1", data=malformed()))  # the well-formed one is then the first
    assert m.data_listing is not None and m.data_listing[1] == "learner x-1"


def test_a_listing_of_many_files_stays_small_on_the_wire() -> None:
    """10,000 FineWeb-style names go by name (about half a megabyte); past the cap only the count,
    total and digest go, and a mismatch is still refused, by count and size."""
    names = {f"CC-MAIN-2024-10/{i:06d}_00000.parquet": 2_000_000_000 + i for i in range(copy_listings.MAX_LISTED)}
    full = listing(names)
    wire = copy_listings.to_pb(full).ByteSize()
    assert len(full.files) == copy_listings.MAX_LISTED and wire < 600_000, wire
    assert copy_listings.from_pb(copy_listings.to_pb(full)) == full
    more = listing({**names, "CC-MAIN-2024-10/zzz.parquet": 5})
    assert more.files == () and copy_listings.to_pb(more).ByteSize() < 100
    m = model()
    check_data(m, join_request("us-0", more))
    smaller = listing({**names, "CC-MAIN-2024-10/zzz.parquet": 4}, "gs://eu/train/")
    with pytest.raises(Refused) as info:
        check_data(m, join_request("eu-0", smaller))
    assert ("gs://eu/train/ holds 10,001 files of 20,000,049,995,004 bytes, gs://us/train/ (learner us-0) holds "
            "10,001 files of 20,000,049,995,005 bytes") in info.value.reason


def test_the_learner_refused_for_its_copy_exits_config_with_the_line(unseeded) -> None:  # noqa: F811
    """Over gRPC, through the learner's own join (trainer/bringup.py join): the first learner's
    copy is admitted, one whose file differs in size gets Exit.CONFIG and a fatal event naming
    the file and both sizes (the operator reads Exit.CONFIG as a permanent ConfigError)."""
    from diloco.trainer.bringup import EndsEarly, join

    address, _, _ = unseeded
    m = SimpleNamespace(shapes=dict(sh.SHAPES), theta0=sh.params(0), plan=SimpleNamespace(fragments=initial().fragments))
    us = SyncerClient(address, sh.TOKEN, "us-0", "us-east", data=copy_listings.to_pb(listing({"000.parquet": 1_048_000})))
    join(us, m)  # type: ignore[arg-type]
    eu = SyncerClient(address, sh.TOKEN, "eu-0", "eu-west",
                      data=copy_listings.to_pb(listing({"000.parquet": 1_048_576}, "gs://eu/train/")))
    with pytest.raises(EndsEarly) as info:
        join(eu, m)  # type: ignore[arg-type]
    assert info.value.code == Exit.CONFIG and info.value.fatal
    assert info.value.reason == ("syncer refused to admit this learner: learner eu-0's data: gs://eu/train/000.parquet "
                                 "is 1,048,576 bytes, gs://us/train/000.parquet (learner us-0) is 1,048,000: every "
                                 "copy must hold the same files (spec.data.source.path, learnerGroups[].data)")
    for c in (us, eu):
        c.close()


def _age(root: Path) -> None:
    """Every file's access time a day before its change: the next read sets it (relatime)."""
    for p in root.rglob("*.txt"):
        st = p.stat()
        os.utime(p, (st.st_mtime - 86_400, st.st_mtime))


def _read(path: Path) -> bool:
    st = path.stat()
    return st.st_atime > st.st_mtime


@pytest.mark.e2e
def test_a_two_region_job_trains_each_group_on_its_own_copy(tmp_path: Path) -> None:
    """`diloco run`: groups in two regions, `{region}` in the path, each on its region's copy.
    Text shards are byte ranges, so the us learner (shard 0) reads a.txt and the eu learner
    (shard 1) only b.txt of their own copies: the files' access times show that eu-west/a.txt
    was never read while us-east/a.txt was, and each copy's b.txt was. The syncer's checkpoint
    holds the first learner's listing, which it compared the other's Join with."""
    from diloco.checkpoint import CheckpointStore

    two_copies(tmp_path)
    probe = tmp_path / "probe.txt"
    probe.write_text("x")
    _age(tmp_path)
    probe.read_text()
    atimes = _read(probe)  # False on a noatime mount: the access pattern is then not asserted
    manifest = job({"kind": "text", "path": f"{tmp_path}/{{region}}/train/*/*.txt"},
                   [{"name": "us", "region": "us-east"}, {"name": "eu", "region": "eu-west"}],
                   syncer={"fragments": 2}, model=dict(TINY_MODEL),
                   training={"batchSize": 8, "learningRate": 0.006, "warmupSteps": 5, "steps": 20,
                             "evalIntervalSteps": 10, "durationSeconds": 200})
    events = diloco_run(manifest, tmp_path)
    out = tmp_path / "out"
    exits = {e["source"]: e["reason"] for e in events if e["event"] == "exit"}
    assert exits == {"us-0": "finished", "eu-0": "finished"}, exits
    loaded, _ = CheckpointStore(out / "checkpoints").load_latest()
    assert loaded is not None
    kept, by = copy_listings.from_dict(loaded.meta["data_listing"])
    assert by in ("learner us-0", "learner eu-0") and kept.count == 2
    assert kept.root == f"{tmp_path}/{'us-east' if by.endswith('us-0') else 'eu-west'}/train/"
    read = {f"{r}/{n}": _read(tmp_path / r / "train" / "shakespeare" / n)
            for r in ("us-east", "eu-west") for n in ("a.txt", "b.txt")}
    if atimes:
        assert read == {"us-east/a.txt": True, "us-east/b.txt": True, "eu-west/a.txt": False,
                        "eu-west/b.txt": True}, read
