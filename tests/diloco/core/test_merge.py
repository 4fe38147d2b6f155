"""RDA and weighted-average invariants, token weights and the Nesterov outer step."""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from diloco.core.merge import merge_fragment, rda, token_weights, weighted_average
from diloco.core.outer import NesterovSGD

cases = st.tuples(st.integers(1, 8), st.integers(1, 50), st.integers(0, 2**32 - 1))


def make(m: int, n: int, seed: int):
    rng = np.random.default_rng(seed)
    deltas = [rng.standard_normal(n).astype(np.float32) * rng.uniform(0.1, 3.0) for _ in range(m)]
    weights = rng.uniform(0.1, 5.0, m)
    return deltas, weights


@settings(max_examples=80, deadline=None)
@given(cases)
def test_rda_norm_is_weighted_mean_norm(case) -> None:
    deltas, w = make(*case)
    out = rda(deltas, w)
    expected = np.dot(w, [np.linalg.norm(d) for d in deltas]) / w.sum()
    assert np.linalg.norm(out) == pytest.approx(expected, rel=1e-4)


@settings(max_examples=60, deadline=None)
@given(cases)
def test_rda_permutation_invariant_and_scale_equivariant(case) -> None:
    deltas, w = make(*case)
    perm = np.random.default_rng(case[2]).permutation(len(deltas))
    base = rda(deltas, w)
    np.testing.assert_allclose(rda([deltas[i] for i in perm], w[perm]), base, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(rda([3.5 * d for d in deltas], w), 3.5 * base, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(rda(deltas, 7.0 * w), base, rtol=1e-4, atol=1e-5)  # weights scale-free


@settings(max_examples=40, deadline=None)
@given(cases)
def test_identical_inputs_give_that_input(case) -> None:
    m, n, seed = case
    d = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    w = np.random.default_rng(seed + 1).uniform(0.1, 2.0, m)
    np.testing.assert_allclose(rda([d] * m, w), d, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(weighted_average([d] * m, w), d, rtol=1e-5, atol=1e-6)


@given(m=st.integers(1, 4), n=st.integers(1, 9000), seed=st.integers(0, 2**16), opposite=st.booleans())
@example(m=2, n=598, seed=598, opposite=True)  # nearly cancelling: failed the old tolerance at 1.2e-4
@settings(max_examples=40, deadline=None)
def test_rda_of_up_to_four_fp32_arrays_from_their_gram_matrix_is_the_formula(m: int, n: int, seed: int,
                                                                            opposite: bool) -> None:
    """Up to four fp32 contributions take their norms and the direction's from one Gram pass
    (the formula in fp64, to fp32 round-off, opposite directions cancelling to zero); int8
    payloads take the general path and agree with RDA of their decoded values."""
    from diloco.core.codecs import encode, parse
    from diloco.core.merge import merge_updates

    rng = np.random.default_rng(seed)
    deltas = [rng.standard_normal(n).astype(np.float32) for _ in range(m)]
    if opposite and m > 1:
        deltas[1] = -deltas[0]
    w = rng.uniform(0.1, 2.0, m)
    d64 = [d.astype(np.float64) for d in deltas]
    norms = np.array([np.linalg.norm(d) for d in d64])
    direction = sum(wi / nr * d for wi, nr, d in zip(w / w.sum(), norms, d64, strict=True))
    dn = np.linalg.norm(direction)
    want = direction * (np.dot(w / w.sum(), norms) / dn) if dn >= 1e-6 else np.zeros(n)
    got = merge_updates([{"x": d} for d in deltas], w)["x"]
    # The direction is summed in fp32: where contributions nearly cancel (dn small) its relative
    # error grows as fp32's epsilon over dn, whatever the accumulation (measured over 2,000 seeds of
    # the opposite case: error x dn stayed under 8e-8, against the 4.8e-7 allowed here).
    rel = 1e-5 + 4 * float(np.finfo(np.float32).eps) / max(dn, 1e-12)
    tol = rel * np.abs(want).max() + 1e-6 if dn >= 1e-6 else 1e-5
    np.testing.assert_allclose(got.values * got.factor, want, atol=tol)
    # sumsq is the formula's (from the Gram matrix); the fp32 values carry the same cancellation error, twice squared.
    assert got.factor == 1.0 and np.isclose(got.sumsq, float(np.vdot(got.values, got.values)), rtol=1e-4 + 2 * rel,
                                            atol=1e-9)
    int8 = merge_updates([{"x": parse(encode(d, "int8"))} for d in deltas], w)["x"]
    ref = rda([parse(encode(d, "int8")).decode() for d in deltas], w)  # the same values, decoded first
    np.testing.assert_allclose(int8.values * int8.factor, ref, atol=rel * max(np.abs(ref).max(), 1e-3))


def test_rda_keeps_norm_where_average_shrinks() -> None:
    rng = np.random.default_rng(0)
    deltas = [rng.standard_normal(10_000).astype(np.float32) for _ in range(16)]  # ~orthogonal
    w = np.ones(16)
    avg, merged = weighted_average(deltas, w), rda(deltas, w)
    mean_norm = np.mean([np.linalg.norm(d) for d in deltas])
    assert np.linalg.norm(avg) == pytest.approx(mean_norm / 4, rel=0.05)  # 1/sqrt(16)
    assert np.linalg.norm(merged) == pytest.approx(mean_norm, rel=1e-4)
    cos = np.dot(avg, merged) / np.linalg.norm(avg) / np.linalg.norm(merged)
    assert cos > 0.999  # norms are alike here, so nearly the same direction: RDA fixes the radius


def test_zero_vectors_and_single_contributor() -> None:
    z = np.zeros(5, np.float32)
    assert np.array_equal(rda([z, z], [1, 1]), z)
    d = np.arange(5, dtype=np.float32)
    np.testing.assert_allclose(rda([d, z], [1, 1]), d / 2 * 1.0 * 1, rtol=1e-6)  # radius halves
    np.testing.assert_allclose(rda([d], [3.0]), d, rtol=1e-6)
    np.testing.assert_allclose(rda([d, -d], [1, 1]), z)  # opposite directions cancel


def test_token_weights() -> None:
    w = token_weights([1000, 1000, 500, 0], [10, 5, 5, 0])
    assert list(w) == [100_000, 200_000, 50_000, 0]  # bigger batches count more
    assert list(token_weights([1000, 0], [10, 0], enabled=False)) == [1, 0]
    with pytest.raises(ValueError):
        rda([np.ones(2)], [0.0])


def test_merge_fragment_uses_plain_average_for_embeddings() -> None:
    a = {"embed/embedding": np.array([1.0, 0.0], np.float32), "h/kernel": np.array([1.0, 0.0], np.float32)}
    b = {"embed/embedding": np.array([0.0, 1.0], np.float32), "h/kernel": np.array([0.0, 1.0], np.float32)}
    out = merge_fragment([a, b], [1, 1], "rda", plain_average={"embed/embedding"})
    np.testing.assert_allclose(out["embed/embedding"], [0.5, 0.5])
    np.testing.assert_allclose(out["h/kernel"], [np.sqrt(0.5), np.sqrt(0.5)], rtol=1e-6)
    with pytest.raises(ValueError, match="disagree"):
        merge_fragment([a, {"h/kernel": a["h/kernel"]}], [1, 1])


def test_nesterov_matches_formula_and_round_trips_state() -> None:
    opt = NesterovSGD(0.7, 0.9)
    theta = {"w": np.array([1.0, 2.0], np.float32)}
    d1, d2 = np.array([0.1, -0.2], np.float32), np.array([0.3, 0.0], np.float32)
    t1 = opt.step(theta, {"w": d1})
    np.testing.assert_allclose(t1["w"], theta["w"] - 0.7 * (d1 + 0.9 * d1), rtol=1e-6)
    clone = NesterovSGD(0.7, 0.9)
    clone.load_state_dict(opt.state_dict())
    t2, t2c = opt.step(t1, {"w": d2}), clone.step(t1, {"w": d2})
    b = 0.9 * d1 + d2
    np.testing.assert_allclose(t2["w"], t1["w"] - 0.7 * (d2 + 0.9 * b), rtol=1e-6)
    np.testing.assert_array_equal(t2["w"], t2c["w"])


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 5), n=st.integers(1, 3000), codec=st.sampled_from(["fp32", "bf16", "int8", "int4"]),
       seed=st.integers(0, 2**32 - 1))
def test_merging_encoded_contributions_equals_merging_their_values(m, n, codec, seed) -> None:
    """The syncer merges payloads without decoding them first (straight into the accumulator,
    chunk by chunk): the result is the merge of the decoded values, up to fp32 rounding."""
    from diloco.core import merge
    from diloco.core.codecs import decode, encode, parse

    deltas, w = make(m, n, seed)
    payloads = [encode(d, codec, 64) for d in deltas]  # type: ignore[arg-type]
    packed, decoded = [parse(p) for p in payloads], [decode(p) for p in payloads]
    scales = np.random.default_rng(seed).uniform(0.0, 1.0, m)
    old_chunk, merge.CHUNK = merge.CHUNK, 128  # many chunks, and partial ones, on small tensors
    try:
        for fn in (rda, weighted_average):
            np.testing.assert_allclose(fn(packed, w, scales), fn(decoded, w, scales), rtol=2e-5, atol=2e-6)
            np.testing.assert_allclose(fn(decoded, w, scales), fn([d * s for d, s in zip(decoded, scales)], w),
                                       rtol=2e-5, atol=2e-6)  # a scale is a factor on the contribution
    finally:
        merge.CHUNK = old_chunk


def _term(src, c: float, n: int) -> np.ndarray:
    """c · one contribution's values, computed as the kernels must: code · (scale · c) for int codecs."""
    from diloco.core.codecs import Packed

    c32 = np.float32(c)
    if not isinstance(src, Packed):
        return src * c32
    if src.codec in ("fp32", "bf16"):
        values = src.values if src.codec == "fp32" else (src.values.astype(np.uint32) << 16).view(np.float32)
        return values * c32
    codes = src.values.astype(np.int32)
    if src.codec == "int4":
        half = src.block // 2
        codes = np.concatenate([(codes & 15).reshape(-1, half), (codes >> 4).reshape(-1, half)], axis=1) - 8
    return codes.reshape(-1)[:n].astype(np.float32) * (src.scales * c32).repeat(src.block)[:n]


@settings(max_examples=60, deadline=None)
@given(kinds=st.lists(st.sampled_from(["array", "fp32", "bf16", "int8", "int4"]), min_size=1, max_size=9),
       n=st.integers(1, 700), chunk=st.sampled_from([64, 128, 1 << 16]), seed=st.integers(0, 2**32 - 1))
def test_the_weighted_sum_adds_every_kind_in_order_bit_for_bit(kinds, n, chunk, seed) -> None:
    """Up to four contributions of one kind add in one kernel pass, chunk by chunk: the result is
    the plain sequence acc = c₀x₀, acc += c₁x₁, ... of numpy, bit for bit, whatever the mix."""
    from diloco.core import merge
    from diloco.core.codecs import encode, parse

    rng = np.random.default_rng(seed)
    sources = [x if kind == "array" else parse(encode(x, kind, 64))
               for kind in kinds for x in [rng.standard_normal(n).astype(np.float32)]]
    coeffs = [0.0 if i == 1 and len(kinds) > 2 else float(rng.uniform(0.1, 2.0)) for i in range(len(kinds))]
    want = None
    for src, c in zip(sources, coeffs):
        if c != 0.0:
            want = _term(src, c, n) if want is None else want + _term(src, c, n)
    old_chunk, merge.CHUNK = merge.CHUNK, chunk
    try:
        got, sumsq = merge._weighted_sum(sources, coeffs, n)
    finally:
        merge.CHUNK = old_chunk
    assert np.array_equal(got, want)
    assert sumsq == pytest.approx(float(np.sum(want.astype(np.float64) ** 2)), rel=1e-6)


def test_the_fused_nesterov_step_is_the_numpy_formula_bit_for_bit() -> None:
    rng = np.random.default_rng(3)
    theta = {"w": rng.standard_normal((7, 9)).astype(np.float32)}
    opt, buf = NesterovSGD(0.7, 0.9), np.zeros((7, 9), np.float32)
    lr, mu = np.float32(0.7), np.float32(0.9)
    for _ in range(3):
        d = rng.standard_normal((7, 9)).astype(np.float32)
        buf = buf * mu + d
        want = theta["w"] - lr * (d + mu * buf)
        theta = opt.step(theta, {"w": d})
        assert np.array_equal(theta["w"], want) and np.array_equal(opt.buffers["w"], buf)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("codec", ["int8", None], ids=["payloads", "fp32 arrays"])
def test_a_merge_left_as_factor_times_accumulator_steps_like_the_scaled_array(momentum: float, codec: str | None) -> None:
    """The syncer applies RDA's scale and participation's share inside the outer step's pass
    (`merge_updates` + `factors`): the same Θ as stepping on the materialised merge, and the
    update's norm from the merge's own sum of squares. RDA of encoded payloads leaves its scale
    as the factor; RDA of up to four fp32 contributions knows it before summing and folds it in."""
    from diloco.core.codecs import encode, parse
    from diloco.core.merge import merge_updates

    rng = np.random.default_rng(5)
    contributions = [{"w": rng.standard_normal((33, 7)).astype(np.float32),
                      "embed": rng.standard_normal(50).astype(np.float32)} for _ in range(3)]
    if codec is not None:
        contributions = [{n: parse(encode(v, codec)) for n, v in c.items()} for c in contributions]  # type: ignore[misc]
    theta = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in contributions[0].items()}
    w, share = [1.0, 2.0, 0.5], 0.75
    arrays = merge_fragment(contributions, w, "rda", plain_average={"embed"})
    updates = merge_updates(contributions, w, "rda", plain_average={"embed"})
    assert (updates["w"].factor != 1.0) == (codec is not None) and updates["embed"].factor == 1.0
    factors = {n: share * u.factor for n, u in updates.items()}
    norm = np.sqrt(sum(f**2 * updates[n].sumsq for n, f in factors.items()))
    np.testing.assert_allclose(norm, np.sqrt(sum(float(np.vdot(share * v, share * v)) for v in arrays.values())), rtol=1e-5)
    want = NesterovSGD(0.8, momentum).step(theta, {n: share * v for n, v in arrays.items()})
    got = NesterovSGD(0.8, momentum).step(theta, {n: u.values for n, u in updates.items()}, factors)
    for n in theta:
        np.testing.assert_allclose(got[n], want[n], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("method", ["rda", "average"])
def test_a_lent_accumulator_holding_an_earlier_round_merges_bit_for_bit(method: str) -> None:
    """The syncer lends the same memory to every round (`out`): whatever an earlier round left
    in it, the merge is the one a fresh accumulator gives, encoded and fp32 sources alike."""
    from diloco.core.codecs import encode, parse
    from diloco.core.merge import merge_updates

    rng = np.random.default_rng(8)
    fp32 = [{"w": rng.standard_normal(300).astype(np.float32)} for _ in range(2)]
    packed = [{"w": parse(encode(rng.standard_normal(300).astype(np.float32), "int4"))} for _ in range(2)]
    for contributions in (fp32, packed, [fp32[0], packed[0]]):
        fresh = merge_updates(contributions, [1.0, 3.0], method)  # type: ignore[arg-type]
        lent = {"w": np.full(300, np.nan, np.float32)}
        got = merge_updates(contributions, [1.0, 3.0], method, out=lent)  # type: ignore[arg-type]
        assert np.shares_memory(got["w"].values, lent["w"])
        assert np.array_equal(got["w"].values, fresh["w"].values)
        assert (got["w"].factor, got["w"].sumsq) == (fresh["w"].factor, fresh["w"].sumsq)


def test_plain_sgd_keeps_no_momentum_state() -> None:
    """At momentum 0 (the default) a buffer would be a model-sized array of zeros, in memory and
    in every checkpoint (4 GB of them for a 1e9-parameter model): none is kept."""
    theta = {"w": np.ones(8, np.float32)}
    opt = NesterovSGD(0.8, 0.0)
    out = opt.step(theta, {"w": np.full(8, 0.5, np.float32)})
    np.testing.assert_allclose(out["w"], 1.0 - 0.8 * 0.5)
    assert opt.buffers == {} and opt.state_dict() == {}
