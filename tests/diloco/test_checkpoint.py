"""Checkpoints: atomic, checksummed, newest valid one wins, corrupt ones are skipped."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.checkpoint import CheckpointError, CheckpointStore, deserialize, serialize, state_bytes
from diloco.core.rounds import Closed, Contribution
from diloco.spec import Syncer as SyncerSpec
from diloco.syncer.global_model import GlobalModel
from tests import syncer_harness
from tests.helpers import policy
from tests.syncer_harness import SHAPES, params


def trained_model() -> GlobalModel:
    model = GlobalModel.fresh(SyncerSpec(fragments=2), params())
    for p in (0, 1, 0):
        delta = {n: np.full(s, 0.1, np.float32) for n, s in model.shapes(p).items()}
        c = Contribution(learner="a-0", fragment=p, base_version=model.versions[p], steps=4, tokens=2048, payload=delta)
        model.apply(Closed(p, model.versions[p], [c], [1.0], 0.0))
    return model


def test_state_round_trip_bit_for_bit(tmp_path: Path) -> None:
    model = trained_model()
    store = CheckpointStore(tmp_path)
    store.save(*model.state())
    loaded, skipped = store.load_latest()
    assert loaded is not None and skipped == []
    restored = GlobalModel.from_state(model.spec, loaded.arrays, loaded.meta, expect=SHAPES)
    assert restored.versions == [2, 1] and restored.tokens_merged == model.tokens_merged
    assert restored.publish_key == model.publish_key  # its predecessors' tags still verify
    for n in SHAPES:
        assert np.array_equal(restored.params[n], model.params[n])
    # The momentum survived too: the next outer step is identical.
    delta = {n: np.full(s, -0.2, np.float32) for n, s in model.shapes(0).items()}
    for m in (model, restored):
        c = Contribution(learner="b", fragment=0, base_version=m.versions[0], steps=2, tokens=100, payload=delta)
        m.apply(Closed(0, m.versions[0], [c], [1.0], 0.0))
    for n in SHAPES:
        assert np.array_equal(restored.params[n], model.params[n])


def test_corrupt_newest_falls_back_to_previous(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    model = trained_model()
    first = store.save(*model.state())
    newest = store.save(*trained_model().state())
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    loaded, skipped = store.load_latest()
    assert loaded is not None and loaded.path == first
    assert len(skipped) == 1 and "checksum" in skipped[0]
    truncated = store.save(*model.state())
    truncated.write_bytes(truncated.read_bytes()[:100])
    loaded, skipped = store.load_latest()
    assert loaded is not None and loaded.path == first and len(skipped) == 2


def test_mismatched_checkpoint_refused(tmp_path: Path) -> None:
    model = trained_model()
    arrays, meta = model.state()
    with pytest.raises(ValueError, match="do not match"):
        GlobalModel.from_state(model.spec, arrays, meta, expect={"other": (1,)})
    with pytest.raises(ValueError, match="plan"):
        GlobalModel.from_state(SyncerSpec(fragments=3), arrays, meta, expect=SHAPES)


def test_full_disk_keeps_previous_and_leaves_no_debris(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = CheckpointStore(tmp_path)
    first = store.save(*trained_model().state())

    def disk_full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space"):
        store.save(*trained_model().state())
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == [first.name]
    assert store.load_latest()[0].path == first  # type: ignore[union-attr]


def test_unwritable_directory_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with pytest.raises(OSError):
        CheckpointStore(blocker / "ckpt").save(*trained_model().state())


def test_a_directory_swapped_mid_save_takes_the_whole_save_or_none(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The path turns into a regular file while a save is in flight (a volume gone bad): that
    save lands whole in the directory it started in, and reports it, and the next one fails."""
    volume, blocker, path = tmp_path / "volume", tmp_path / "not-a-dir", tmp_path / "ckpt"
    volume.mkdir()
    blocker.write_text("x")
    path.symlink_to(volume)
    store = CheckpointStore(path)
    store.save(*trained_model().state())
    real_fsync = os.fsync

    def swap_then_fsync(fd: int) -> None:
        swap = tmp_path / "swap"
        swap.symlink_to(blocker)
        os.replace(swap, path)
        monkeypatch.setattr(os, "fsync", real_fsync)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", swap_then_fsync)
    second = store.save(*trained_model().state())
    assert second.name == "ckpt-000000000002.ddck"
    assert sorted(p.name for p in volume.iterdir()) == ["ckpt-000000000001.ddck", "ckpt-000000000002.ddck"]
    with pytest.raises(OSError):
        store.save(*trained_model().state())
    assert CheckpointStore(volume).load_latest()[0].sequence == 2  # type: ignore[union-attr]



def test_the_syncer_survives_its_directory_swapped_just_after_a_save(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The swap lands between the save and the log line (CI once saw the syncer's main loop die
    there, on a stat through the new path): the save counts, the next one fails cleanly."""
    volume, blocker, path = tmp_path / "volume", tmp_path / "not-a-dir", tmp_path / "ckpt"
    volume.mkdir()
    blocker.write_text("x")
    path.symlink_to(volume)
    h = syncer_harness.start(checkpoint_dir=str(path))
    try:
        real_save = CheckpointStore.save

        def save_then_swap(store: CheckpointStore, *args: object) -> Path:
            saved = real_save(store, *args)  # type: ignore[arg-type]
            swap = tmp_path / "swap"
            swap.symlink_to(blocker)
            os.replace(swap, path)
            return saved

        monkeypatch.setattr(CheckpointStore, "save", save_then_swap)
        assert h.core.checkpoint()
        monkeypatch.setattr(CheckpointStore, "save", real_save)
        assert not h.core.checkpoint()
        assert h.core.metrics.checkpoint_errors._value.get() == 1
    finally:
        h.close()
    assert CheckpointStore(volume).load_latest()[0] is not None

def test_keeps_the_newest_three(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    for _ in range(5):
        store.save(*trained_model().state())
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"ckpt-{i:012d}.ddck" for i in (3, 4, 5)]


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=400), st.integers(0, 399))
def test_loader_never_crashes_on_garbage(noise: bytes, cut: int) -> None:
    good = serialize({"param/x": np.ones(3, np.float32)}, {"versions": [1]})
    for data in (noise, good[:cut], good[:cut] + noise):
        try:
            deserialize(data)
        except CheckpointError:
            pass


def test_torn_temporary_files_are_swept(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    torn = tmp_path / ".ckpt-000000000001.ddck.tmp-999999"
    torn.write_bytes(b"half a checkpoint")
    store.save(*trained_model().state())
    assert not torn.exists()


def test_momentum_and_counters_are_checked(tmp_path: Path) -> None:
    model = trained_model()
    arrays, meta = model.state()
    bad = dict(arrays, **{"momentum/0/head/kernel": np.zeros((1, 1), np.float32)})
    with pytest.raises(ValueError, match="momentum"):
        GlobalModel.from_state(model.spec, bad, meta, expect=SHAPES)
    with pytest.raises(ValueError, match="tokens_merged"):
        GlobalModel.from_state(model.spec, arrays, dict(meta, tokens_merged=None), expect=SHAPES)


def test_participation_scaling_moves_theta_by_the_share_of_active_learners() -> None:
    spec = SyncerSpec(fragments=2, outer_learning_rate=1.0, outer_momentum=0.0, merge="average")
    delta = {n: np.full(s, 0.3, np.float32) for n, s in GlobalModel.fresh(spec, params()).shapes(0).items()}
    moved = []
    for scaling in (True, False):
        model = GlobalModel.fresh(spec.model_copy(update={"participation_scaling": scaling}), params())
        before = {n: model.params[n].copy() for n in delta}
        c = Contribution(learner="a-0", fragment=0, base_version=0, steps=4, tokens=2048, payload=delta)
        model.apply(Closed(0, 0, [c], [1.0], 0.0), active=3)
        moved.append(float(np.mean([np.abs(model.params[n] - before[n]).mean() for n in delta])))
    assert moved[0] == pytest.approx(0.1, rel=1e-5) and moved[1] == pytest.approx(0.3, rel=1e-5)


def test_token_credits_and_schedule_survive_a_restart(tmp_path: Path) -> None:
    """A restarted syncer neither credits a learner's tokens again nor loses the schedule."""
    from diloco.core.rounds import RoundBook

    model = GlobalModel.fresh(SyncerSpec(fragments=2), params())
    delta = {n: np.full(s, 0.1, np.float32) for n, s in model.shapes(0).items()}
    push = Contribution(learner="a-0", fragment=0, base_version=0, steps=4, tokens=4096, payload=delta, session=9,
                        push_id=1, slot=6, session_tokens=4096)
    model.apply(Closed(0, 0, [push], [1.0], 0.0, slot=6))
    book: RoundBook[object] = RoundBook(2, policy(2))
    book.closed_slot, book.next_slot = [6, -1], 7
    model.schedule = book.schedule_state()
    store = CheckpointStore(tmp_path)
    store.save(*model.state())
    loaded, _ = store.load_latest()
    assert loaded is not None
    restored = GlobalModel.from_state(model.spec, loaded.arrays, loaded.meta, expect=SHAPES)
    assert restored.tokens_merged == 4096 and restored.schedule == {"next_slot": 7, "closed_slot": [6, -1]}
    later = Contribution(learner="a-0", fragment=1, base_version=0, steps=4, tokens=4096,
                         payload={n: np.full(s, 0.1, np.float32) for n, s in model.shapes(1).items()},
                         session=9, push_id=2, slot=7, session_tokens=6144)
    assert restored.apply(Closed(1, 0, [later], [1.0], 0.0)).tokens_merged == 2048  # only what is new
    bad = dict(loaded.meta, credited={"a-0/9": -1})
    with pytest.raises(ValueError, match="credited"):
        GlobalModel.from_state(model.spec, loaded.arrays, bad, expect=SHAPES)
    with pytest.raises(ValueError, match="schedule"):
        GlobalModel.from_state(model.spec, loaded.arrays, dict(loaded.meta, schedule={"next_slot": "x"}), expect=SHAPES)


def test_state_bytes_is_what_a_checkpoint_of_a_trained_model_holds(tmp_path: Path) -> None:
    """The operator sizes the checkpoint volume with diloco.checkpoint.state_bytes: it must cover the
    arrays a checkpoint really holds (the header adds only metadata)."""
    model = trained_model()
    arrays, _ = model.state()
    held = state_bytes(SHAPES, momentum=model.spec.outer_momentum > 0)
    assert sum(a.nbytes for a in arrays.values()) == held
    path = CheckpointStore(tmp_path).save(*model.state())
    assert held < path.stat().st_size < held + (64 << 10)
    assert state_bytes(SHAPES) >= held  # the volume is sized for momentum turned on later


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a-0/1", "a-0/2", "b-0/1"]), st.integers(0, 5), st.booleans()),
                min_size=1, max_size=12))
def test_the_jobs_trained_tokens_are_merged_plus_what_pushes_report_beyond_their_credit(
        events: list[tuple[str, int, bool]]) -> None:
    """`job_tokens` keeps a running total; it must equal the formula over every process,
    whatever order reports and merges come in (a merge credits a push it holds, and a stale
    report never lowers a process's count)."""
    model = GlobalModel.fresh(SyncerSpec(fragments=2), params())
    newest: dict[str, int] = {}
    for key, thousands, merge in events:
        tokens = 1000 * thousands
        model.credits.report(key, tokens)
        newest[key] = max(newest.get(key, 0), tokens)
        if merge:
            learner, _, session = key.partition("/")
            delta = {n: np.full(s, 0.01, np.float32) for n, s in model.shapes(0).items()}
            c = Contribution(learner=learner, fragment=0, base_version=model.versions[0], steps=4, tokens=1000,
                             payload=delta, session=int(session), session_tokens=tokens)
            model.apply(Closed(0, model.versions[0], [c], [1.0], 0.0))
        expected = model.tokens_merged + sum(max(0, t - model.credits.credited.get(k, 0)) for k, t in newest.items())
        assert model.job_tokens() == expected
