"""Checkpoints in object storage (an S3 server on 127.0.0.1, moto's): committed by a manifest
written last, verified on read, torn or uncommitted objects skipped, old ones pruned, and a
compare-and-swap that a fenced writer loses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from diloco.checkpoint import CheckpointStore, FencedOut, deserialize
from diloco.checkpoint_objects import MANIFEST, ObjectCheckpointStore, open_store, shard_location
from tests.s3_server import Bucket, s3_bucket

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bucket() -> Iterator[Bucket]:
    with s3_bucket() as b:
        yield b


@pytest.fixture
def store(bucket: Bucket, request: pytest.FixtureRequest) -> ObjectCheckpointStore:
    s = open_store(f"{bucket.url}/{request.node.name}")
    assert isinstance(s, ObjectCheckpointStore)
    return s


def state(i: int) -> tuple[dict[str, np.ndarray], dict[str, object]]:
    return {"param/w": np.arange(64, dtype=np.float32) * i}, {"versions": [i, i]}


def objects(store: ObjectCheckpointStore) -> list[str]:
    return sorted(str(n).rsplit("/", 1)[-1] for n in store.fs.ls(store.root, detail=False, refresh=True))


def test_round_trip_and_pruning(store: ObjectCheckpointStore) -> None:
    assert store.load_latest() == (None, []) and store.newest() is None
    for i in range(1, 6):
        path = store.save(*state(i))
        assert path.name == f"ckpt-{i:012d}.ddck"
    # The newest three are kept, the manifest names exactly them, nothing else is left behind.
    assert objects(store) == [MANIFEST, *(f"ckpt-{i:012d}.ddck" for i in (3, 4, 5))]
    loaded, skipped = store.load_latest()
    assert loaded is not None and skipped == [] and loaded.sequence == 5 == store.newest()
    assert loaded.meta["versions"] == [5, 5] and np.array_equal(loaded.arrays["param/w"], state(5)[0]["param/w"])


def test_torn_newest_object_is_skipped(store: ObjectCheckpointStore) -> None:
    for i in (1, 2):
        store.save(*state(i))
    newest = f"{store.root}/ckpt-{2:012d}.ddck"
    data = bytes(store.fs.cat_file(newest))
    store.fs.pipe_file(newest, data[: len(data) // 2])  # half an object: a store without atomic uploads, a bad copy
    loaded, skipped = store.load_latest()
    assert loaded is not None and loaded.sequence == 1 and loaded.meta["versions"] == [1, 1]
    assert len(skipped) == 1 and "ckpt-000000000002.ddck" in skipped[0] and "checksum" in skipped[0]


def test_an_object_no_manifest_names_is_never_loaded(store: ObjectCheckpointStore) -> None:
    """A writer that died after its object and before its manifest: the object is debris (even a
    complete one), and the next save prunes it."""
    store.save(*state(1))
    from diloco.checkpoint import serialize

    store.fs.pipe_file(f"{store.root}/ckpt-{2:012d}.ddck", serialize(*state(2)))
    loaded, skipped = store.load_latest()
    assert loaded is not None and loaded.sequence == 1 and skipped == []
    assert store.save(*state(3)).name == "ckpt-000000000003.ddck"
    assert objects(store) == [MANIFEST, "ckpt-000000000001.ddck", "ckpt-000000000003.ddck"]


def test_an_unreadable_manifest_falls_back_to_listing(store: ObjectCheckpointStore) -> None:
    for i in (1, 2):
        store.save(*state(i))
    store.fs.pipe_file(f"{store.root}/{MANIFEST}", b'{"format": 1, "checkpoi')
    loaded, skipped = store.load_latest()
    assert loaded is not None and loaded.sequence == 2
    assert len(skipped) == 1 and MANIFEST in skipped[0] and "unreadable" in skipped[0]


def test_a_writer_whose_manifest_moved_fails_and_commits_nothing(store: ObjectCheckpointStore,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Another syncer committed between this one's read of the manifest and its write: the
    compare-and-swap refuses, the loser's object is removed, the winner's checkpoint stands."""
    store.save(*state(1))
    other = ObjectCheckpointStore(store.url)
    real = store._manifest

    def stale() -> tuple[object, str, str | None]:
        got = real()
        other.save(*state(7))  # lands after our read
        return got

    monkeypatch.setattr(store, "_manifest", stale)
    with pytest.raises(OSError, match="another syncer"):
        store.save(*state(2))
    monkeypatch.undo()
    loaded, _ = store.load_latest()
    assert loaded is not None and loaded.meta["versions"] == [7, 7]
    assert "ckpt-000000000003.ddck" not in objects(store)  # ours (seq 3) was taken back


def test_compare_and_swap(store: ObjectCheckpointStore) -> None:
    assert store.conditional
    assert store.read_versioned("lease") == (None, "")
    assert store.swap("lease", b"a", "") and not store.swap("lease", b"b", "")
    data, token = store.read_versioned("lease")
    assert data == b"a" and token
    assert store.swap("lease", b"c", token) and not store.swap("lease", b"d", token)
    assert store.read_versioned("lease")[0] == b"c"


def test_a_directory_has_the_same_compare_and_swap(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    assert store.swap("lease", b"a", "") and not store.swap("lease", b"b", "")
    data, token = store.read_versioned("lease")
    assert data == b"a" and store.swap("lease", b"c", token) and not store.swap("lease", b"d", token)


def test_a_directory_fenced_mid_save_commits_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory both syncers share: the old holder's save, frozen before its rename, fails
    once the standby fenced the directory, and leaves no file behind."""
    old, new = CheckpointStore(tmp_path), CheckpointStore(tmp_path)
    old.fence("old/1")
    old.save(*state(1))
    real = old._ours

    def fenced_before_the_rename() -> object:
        new.fence("new/2")
        return real()

    monkeypatch.setattr(old, "_ours", fenced_before_the_rename)
    with pytest.raises(FencedOut, match="new/2"):
        old.save(*state(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "WRITER", "ckpt-000000000001.ddck"]
    assert new.save(*state(3)).name == "ckpt-000000000002.ddck"


def test_any_fsspec_url_and_shards(tmp_path: Path) -> None:
    """memory:// stands in for any fsspec store (gs:// goes through the same calls with gcsfs)."""
    store = open_store("memory://diloco-test/ckpt")
    assert isinstance(store, ObjectCheckpointStore) and not store.conditional
    store.save(*state(1))
    loaded, _ = store.load_latest()
    assert loaded is not None and deserialize(bytes(store.fs.cat_file(str(loaded.path))))[1]["versions"] == [1, 1]
    assert isinstance(open_store(tmp_path), CheckpointStore) and isinstance(open_store(f"file://{tmp_path}"), CheckpointStore)
    assert shard_location("s3://b/j", 0, 1) == "s3://b/j" and shard_location("s3://b/j/", 2, 4) == "s3://b/j/shard-2"


def test_a_reader_that_listed_before_sees_what_another_process_wrote_since(bucket: Bucket) -> None:
    """A standby lists the prefix (no manifest yet), then follows the checkpoints another
    process writes: each new one is read, never taken for torn because a listing was cached."""
    import fsspec

    writer = ObjectCheckpointStore(f"{bucket.url}/followed")
    writer.fs = fsspec.filesystem("s3", skip_instance_cache=True)  # another process's client
    writer.fs.pipe_file(f"{writer.root}/syncer.lease", b"{}")  # the holder's lease, there before any checkpoint
    reader = open_store(f"{bucket.url}/followed")
    assert isinstance(reader, ObjectCheckpointStore)
    assert reader.newest() is None  # no manifest yet: lists the prefix (the lease alone)
    for i in range(1, 5):
        writer.save(*state(i))
    loaded, skipped = reader.load_latest()
    assert skipped == [] and loaded is not None and loaded.sequence == 4 == reader.newest()


def test_a_save_in_flight_when_the_standby_fences_the_store_commits_nothing(
        store: ObjectCheckpointStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The old holder is frozen mid-save (its object written, its manifest not yet); the standby
    takes the lease over, fences the store and checkpoints. Resumed, the old one's commit fails,
    its object is gone, the new holder's checkpoint stands, and its next save writes nothing."""
    store.fence("old/1")
    store.save(*state(1))
    new = ObjectCheckpointStore(store.url)
    real = store._create

    def frozen_after_writing(name: str, data: bytes) -> None:
        real(name, data)
        new.fence("new/2")
        new.save(*state(5))

    monkeypatch.setattr(store, "_create", frozen_after_writing)
    with pytest.raises(OSError, match="another syncer"):
        store.save(*state(2))
    monkeypatch.undo()
    loaded, skipped = store.load_latest()
    assert skipped == [] and loaded is not None and loaded.meta["versions"] == [5, 5]
    assert objects(store) == ["MANIFEST.json", "ckpt-000000000001.ddck", "ckpt-000000000003.ddck"]
    with pytest.raises(FencedOut, match="new/2 writes these checkpoints now"):
        store.save(*state(3))
    assert objects(store) == ["MANIFEST.json", "ckpt-000000000001.ddck", "ckpt-000000000003.ddck"]


def test_a_fenced_writer_never_overwrites_the_new_holders_object_of_the_same_name(
        store: ObjectCheckpointStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Frozen after it chose its object's name; the new holder writes that name first. The old
    one's write is refused (S3's If-None-Match), and it deletes nothing of the new holder's."""
    store.fence("old/1")
    store.save(*state(1))
    new = ObjectCheckpointStore(store.url)
    real = store._listed

    def frozen_after_listing() -> list[int]:
        listed = real()
        new.fence("new/2")
        new.save(*state(5))  # ckpt-2: the name the old one is about to write
        return listed

    monkeypatch.setattr(store, "_listed", frozen_after_listing)
    with pytest.raises(FileExistsError, match="another syncer"):
        store.save(*state(2))
    monkeypatch.undo()
    loaded, skipped = new.load_latest()
    assert skipped == [] and loaded is not None and loaded.sequence == 2 and loaded.meta["versions"] == [5, 5]


def test_fencing_a_store_without_a_readable_manifest_keeps_its_checkpoints(store: ObjectCheckpointStore) -> None:
    store.save(*state(1))
    store.save(*state(2))
    store.write_file(MANIFEST, b"{not json")
    store.fence("new/2")
    loaded, skipped = store.load_latest()
    assert skipped == [] and loaded is not None and loaded.meta["versions"] == [2, 2]
