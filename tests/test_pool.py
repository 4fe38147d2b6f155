"""The fragment buffer pool: memory is reused only once nothing holds it."""

from __future__ import annotations

import numpy as np

from diloco.core.pool import Pool

SHAPES = {"a": (3, 4), "b": (5,)}


def test_a_replaced_fragment_s_memory_is_reused_when_nothing_holds_it() -> None:
    pool = Pool()
    first = pool.arrays(SHAPES)
    first["a"][:] = 1.0
    base = id(first["a"].base)  # not the buffer itself: holding it would keep it from reuse
    pool.replaced(first.values())
    del first
    second = pool.arrays(SHAPES)
    assert id(second["a"].base) == base and second["a"].shape == (3, 4) and second["b"].shape == (5,)
    assert not np.shares_memory(second["a"], second["b"])


def test_memory_a_reader_still_holds_is_never_handed_out() -> None:
    pool = Pool()
    first = pool.arrays(SHAPES)
    first["b"][:] = 7.0
    reader = first["b"].reshape(-1)[1:]  # a view, as a checkpoint writer or a snapshot might hold
    exported = memoryview(first["a"])  # a buffer export, as a file write or a hash takes
    pool.replaced(first.values())
    del first
    for _ in range(3):
        fresh = pool.arrays(SHAPES)
        fresh["b"][:] = -1.0
        assert not np.shares_memory(fresh["b"], reader)
    assert np.all(reader == 7.0)
    held = id(reader.base)
    del reader, exported
    assert id(pool.arrays(SHAPES)["a"].base) == held  # let go: now it is reused


def test_arrays_not_carved_by_the_pool_are_not_taken() -> None:
    pool = Pool()
    own = {"a": np.zeros((3, 4), np.float32), "b": np.zeros(5, np.float32)}
    pool.replaced(own.values())
    mixed = pool.arrays(SHAPES)
    pool.replaced([mixed["a"], np.zeros(5, np.float32)])  # two buffers: not one fragment's
    assert not np.shares_memory(pool.arrays(SHAPES)["a"], own["a"])


def test_a_larger_fragment_grows_the_buffers_and_a_smaller_one_fits_them() -> None:
    pool = Pool()
    small = pool.arrays({"b": (5,)})
    pool.replaced(small.values())
    del small
    big = pool.arrays(SHAPES)  # 17 values: the 5-value buffer is too small
    assert big["a"].base.size == 17
    pool.replaced(big.values())
    base = id(big["a"].base)
    del big
    assert id(pool.arrays({"b": (5,)})["b"].base) == base


def test_the_syncer_s_theta_a_reader_holds_is_never_overwritten_and_merges_are_exact() -> None:
    """Θ_p's new tensors come from the pool: a merge never writes into the Θ a checkpoint or a
    snapshot still reads, and reusing memory changes no value (each step is plain SGD here)."""
    from diloco.core.rounds import Closed, Contribution
    from diloco.spec import Syncer as SyncerSpec
    from diloco.syncer.state import GlobalModel

    shapes = {"embed": (16, 4), "w1": (4, 4), "w2": (4, 8), "head": (8, 16)}
    start = {n: np.full(s, 1.0, np.float32) for n, s in shapes.items()}
    model = GlobalModel.fresh(SyncerSpec(fragments=2, outer_learning_rate=1.0, merge="average"), start)
    want = {n: v.copy() for n, v in start.items()}
    held: list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = []
    seen: set[int] = set()  # the buffers Θ's fragments were written into
    for i, p in enumerate([0, 1] * 6):
        if i % 3 == 0:  # a reader keeps this Θ_p (and a copy of what it was) across later merges
            held.append((model.fragment(p), {n: v.copy() for n, v in model.fragment(p).items()}))
        delta = {n: np.full(s, 0.01 * (i + 1), np.float32) for n, s in model.shapes(p).items()}
        model.apply(Closed(p, model.versions[p], [Contribution("a-0", p, model.versions[p], 4, 2048, delta)],
                           [1.0], 0.0))
        for n in delta:
            want[n] = want[n] - np.float32(0.01 * (i + 1))
        seen.add(id(model.params[next(iter(delta))].base))
    for n in shapes:
        np.testing.assert_array_equal(model.params[n], want[n])
    for arrays, copies in held:
        for n in arrays:
            np.testing.assert_array_equal(arrays[n], copies[n])
    assert len(seen) < 12  # memory was reused: 12 merges did not need 12 buffers
