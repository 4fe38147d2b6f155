"""The publish lease: a restarted syncer adopts no recovery offer above what its lineage published."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from diloco.spec import Syncer as SyncerSpec
from diloco.syncer.durable.lease import AHEAD, FILE, PublishLease
from diloco.syncer.global_model import GlobalModel
from tests import syncer_harness as sh
from tests.syncer.test_servicer import code_of, recover


def test_the_ceiling_is_written_before_a_version_passes_it_and_survives_a_restart(tmp_path: Path) -> None:
    h = sh.start(SyncerSpec(fragments=2), checkpoint_dir=str(tmp_path))
    try:
        assert not (tmp_path / FILE).exists()  # nothing published yet
        for _ in range(3):
            assert h.push(0, h.fragment_tensors(0)).accepted
            h.clock.now += 10
            assert h.core.merge_ready() == [0]
        assert h.core.model.versions == [3, 0]
        assert h.core.persistence.lease.ceilings == [AHEAD + 1, 0]  # one write, at the first publish
        h.core.checkpoint()
    finally:
        h.close()
    again = PublishLease.open(tmp_path, [3, 0])
    assert again.ceilings == [AHEAD + 1, 0]
    assert again.allows(0, AHEAD + 1) and not again.allows(0, AHEAD + 2) and not again.allows(1, 1)
    assert PublishLease.open(tmp_path, [200, 5]).ceilings == [200, 5]  # never below the checkpoint


def test_a_restarted_syncer_adopts_published_versions_and_refuses_any_above_the_lease(tmp_path: Path) -> None:
    """Even with the key (a leaked checkpoint copy), a tag for a version the syncer never reached
    is refused, and Θ stays bit for bit as it was."""
    first = sh.start(SyncerSpec(fragments=2), checkpoint_dir=str(tmp_path))
    try:
        first.core.checkpoint()  # the fresh job's checkpoint at versions [0, 0], holding the key
        assert first.push(0, first.fragment_tensors(0)).accepted
        first.clock.now += 10
        assert first.core.merge_ready() == [0]
        published = first.core.model.fragment(0)
        genuine = first.core.model.tag(0, 1, published)
    finally:
        first.close()
    loaded, _ = first.core.persistence.store.load_latest()  # type: ignore[union-attr]
    assert loaded is not None
    model = GlobalModel.from_state(SyncerSpec(fragments=2), loaded.arrays, loaded.meta, expect=sh.SHAPES)
    second = sh.start(SyncerSpec(fragments=2), checkpoint_dir=str(tmp_path), model=model)
    try:
        before = {n: v.copy() for n, v in second.core.model.params.items()}
        assert second.core.model.versions == [0, 0]
        leaked = second.core.model.tag(0, 10 ** 9, published)  # a valid tag made with the key
        code, details = code_of(lambda: recover(second, [0], [10 ** 9], published, tags=[leaked]))
        assert code.name == "PERMISSION_DENIED" and "publish lease" in details
        assert all(np.array_equal(before[n], v) for n, v in second.core.model.params.items())
        assert second.core.model.versions == [0, 0]
        assert list(recover(second, [0], [1], published, tags=[genuine]).adopted) == [0]
        assert second.core.model.versions == [1, 0]
    finally:
        second.close()


@pytest.mark.parametrize("contents", ["{", '{"ceilings": [1]}', '{"ceilings": [-1, 2]}', '{"c": 1}'])
def test_an_unreadable_lease_leaves_the_tags_as_the_bound(tmp_path: Path, contents: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / FILE).write_text(contents)
    with caplog.at_level(logging.ERROR, "diloco.syncer"):
        lease = PublishLease.open(tmp_path, [4, 4])
    assert lease.ceilings is None and lease.allows(0, 10 ** 9) and "publish lease" in caplog.text
    lease.reserve(0, 5, [4, 4])  # the next publish writes a sound one again
    assert PublishLease.open(tmp_path, [5, 4]).ceilings == [5 + AHEAD, 4]


def test_an_unwritable_lease_does_not_stop_publishing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    lease = PublishLease.open(blocked, [0, 0])
    with caplog.at_level(logging.ERROR, "diloco.syncer"):
        lease.reserve(0, 1, [0, 0])
    assert "cannot write the publish lease" in caplog.text and lease.ceilings == [0, 0]
