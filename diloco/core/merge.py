"""Merging learners' outer gradients for one fragment (docs/ALGORITHM.md, "The syncer": Merge).

Radial-directional averaging (RDA) averages norms and directions separately:
Δ = (Σ w‖Δ_m‖ / Σ w) · φ(Σ w φ(Δ_m) / Σ w), φ(x) = x/‖x‖, φ(0) = 0.
A plain average of M nearly orthogonal updates shrinks like 1/√M; RDA keeps the
typical update norm, so the outer learning rate need not change with M.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from diloco.core import kernels
from diloco.core.choices import MergeMethod
from diloco.core.codecs import BLOCKWISE, Packed, weighted_sum_into


def token_weights(tokens: Sequence[float], steps: Sequence[float], enabled: bool = True) -> np.ndarray:
    """w = tokens · (tokens / steps): favours learners that did more work at a larger batch."""
    t = np.asarray(tokens, dtype=np.float64)
    s = np.asarray(steps, dtype=np.float64)
    if np.any(t < 0) or np.any(s < 0):
        raise ValueError("tokens and steps must be non-negative")
    if not enabled:
        return (s > 0).astype(np.float64)
    return np.divide(t * t, s, out=np.zeros_like(t), where=s > 0)


def _normalised(w: Sequence[float], m: int) -> np.ndarray:
    weights = np.asarray(w, dtype=np.float64)
    if weights.shape != (m,):
        raise ValueError(f"need one weight per contribution: {m} contributions, {weights.size} weights")
    if np.any(weights < 0) or not np.all(np.isfinite(weights)):
        raise ValueError("weights must be finite and non-negative")
    total = weights.sum()
    if total <= 0:
        raise ValueError("at least one contribution needs a positive weight")
    return weights / total


Source = np.ndarray | Packed  # one contribution to one tensor: fp32 values, or still encoded


def values_of(src: Source) -> np.ndarray:
    """A source's fp32 values (decoded if it is still encoded)."""
    return src.decode() if isinstance(src, Packed) else src


def _flat(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).reshape(-1)


def _shape_of(sources: Sequence[Source]) -> tuple[int, ...]:
    if not len(sources):
        raise ValueError("need at least one contribution")
    shape = tuple(np.shape(sources[0]) if isinstance(sources[0], np.ndarray) else sources[0].shape)
    if any(tuple(src.shape if isinstance(src, Packed) else np.shape(src)) != shape for src in sources):
        raise ValueError("contributions to one tensor must share its shape")
    return shape


def _sumsq(src: Source) -> float:
    return src.sumsq() if isinstance(src, Packed) else float(kernels.sumsq(_flat(src)))


CHUNK = 1 << 16  # values per pass: 256 KiB of accumulator stays in L2 while every contribution adds into it


def _kind(src: Source) -> tuple[str, int]:
    """Contributions of one kind add together in one kernel pass."""
    return (src.codec, src.block) if isinstance(src, Packed) else ("array", 0)


def _weighted_sum(sources: Sequence[Source], coeffs: Sequence[float], n: int,
                  acc: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """Σ c_m · src_m in one fp32 accumulator (`acc`, n values, when the caller lends one), and its
    squared norm. Chunk by chunk, so each contribution streams through once and the accumulator
    never leaves the cache; encoded sources decode straight into it, and up to four in a row of
    one kind (fp32 arrays, or payloads of one codec and block) add in one pass, in order."""
    acc = np.empty(n, np.float32) if acc is None else acc
    live = [(src if isinstance(src, Packed) else _flat(src), c) for src, c in zip(sources, coeffs, strict=True) if c != 0.0]
    if not live:
        acc[:] = 0.0
        return acc, 0.0
    blocks = [src.block for src, _ in live if isinstance(src, Packed) and src.codec in BLOCKWISE]
    step = CHUNK if not blocks else max(1, CHUNK // math.lcm(*blocks)) * math.lcm(*blocks)
    runs: list[tuple[list[Source], list[float]]] = []  # up to four contributions of one kind in a row
    for src, c in live:
        if runs and len(runs[-1][0]) < 4 and _kind(runs[-1][0][0]) == _kind(src):
            runs[-1][0].append(src)
            runs[-1][1].append(c)
        else:
            runs.append(([src], [c]))
    factors = [np.array(cs, np.float32) for _, cs in runs]
    if len(runs) == 1 and n <= 4 * CHUNK:  # one pass over a small accumulator: chunks would only add calls
        step = n
    total = 0.0
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        part = acc[lo:hi]
        for k, ((srcs, _), f) in enumerate(zip(runs, factors)):
            if isinstance(srcs[0], Packed):
                weighted_sum_into(cast(list[Packed], srcs), f, part, lo, init=k == 0)
            else:
                xs = [x[lo:hi] for x in cast(list[np.ndarray], srcs)]
                kernels.weighted_sum(*xs, *xs[:1] * (4 - len(xs)), f, part, k == 0)
        total += float(kernels.sumsq(part))  # while the chunk is still in cache
    return acc, total


@dataclass(frozen=True)
class Update:
    """One tensor's merged outer gradient as `factor · values`. The syncer's outer step applies
    the factor in its own pass over the tensor, so the merge never makes a second pass to scale
    its accumulator, and the norm comes from the sum of squares the merge already took."""

    values: np.ndarray  # the accumulator, in the tensor's shape
    factor: float
    sumsq: float  # Σ values², so ‖factor · values‖² = factor² · sumsq

    def array(self) -> np.ndarray:
        """factor · values as one array (scales the accumulator in place: call it once)."""
        if self.factor != 1.0:
            kernels.scale_inplace(self.values.reshape(-1), np.float32(self.factor))
        return self.values


def _average(deltas: Sequence[Source], weights: Sequence[float], scales: Sequence[float] | None,
             out: np.ndarray | None = None) -> Update:
    shape = _shape_of(deltas)
    w = _normalised(weights, len(deltas)) * (np.ones(len(deltas)) if scales is None else np.asarray(scales, np.float64))
    acc, total = _weighted_sum(deltas, [float(c) for c in w], math.prod(shape), out)
    return Update(acc.reshape(shape), 1.0, total)


def _fp32_values(deltas: Sequence[Source]) -> list[np.ndarray] | None:
    """Every contribution's flat fp32 values without decoding (arrays, fp32 payloads), else None."""
    if not all(isinstance(d, np.ndarray) or d.codec == "fp32" for d in deltas):
        return None
    return [_flat(d) if isinstance(d, np.ndarray) else d.values for d in deltas]


def _rda_gram(xs: list[np.ndarray], w: np.ndarray, s: np.ndarray, shape: tuple[int, ...],
              out: np.ndarray | None) -> Update:
    """RDA of one to four fp32 contributions in two passes: their Gram matrix (every norm, and
    the merged direction's norm as cᵀGc), then the weighted sum with the final factor folded
    into its coefficients, so nothing scales or re-reads the accumulator afterwards. cᵀGc loses
    relative accuracy only where the directions nearly cancel (fp32 sums of opposite terms);
    there the merged direction is noise either way. The small algebra runs on Python floats:
    numpy's per-call cost on 4-vectors was a fifth of a 4 MiB merge."""
    m = len(xs)
    g = np.empty((4, 4))
    kernels.gram(*xs, *xs[:1] * (4 - m), g)
    gram = g.tolist()
    norms = [math.sqrt(gram[i][i]) * float(s[i]) for i in range(m)]
    coeffs = [float(w[i] * s[i]) / norms[i] if norms[i] > 0 else 0.0 for i in range(m)]
    dsq = max(sum(coeffs[i] * coeffs[j] * gram[i][j] for i in range(m) for j in range(m)), 0.0)
    factor = sum(float(w[i]) * norms[i] for i in range(m)) / math.sqrt(dsq) if dsq >= 1e-12 else 0.0
    acc = np.empty(math.prod(shape), np.float32) if out is None else out
    if factor == 0.0:  # no direction (every input zero, or they cancel): no update, as φ(0) = 0
        acc[:] = 0.0
    else:
        kernels.weighted_sum(*xs, *xs[:1] * (4 - m), np.array(coeffs, np.float32) * np.float32(factor), acc, True)
    return Update(acc.reshape(shape), 1.0, dsq * factor * factor)


def _rda(deltas: Sequence[Source], weights: Sequence[float], scales: Sequence[float] | None,
         out: np.ndarray | None = None) -> Update:
    shape = _shape_of(deltas)
    w = _normalised(weights, len(deltas))
    s = np.ones(len(deltas)) if scales is None else np.asarray(scales, np.float64)
    xs = _fp32_values(deltas) if len(deltas) <= 4 else None
    if xs is not None:
        return _rda_gram(xs, w, s, shape, out)
    norms = np.sqrt([_sumsq(d) for d in deltas]) * s
    radius = float(np.dot(w, norms))
    coeffs = np.divide(w * s, norms, out=np.zeros_like(w), where=norms > 0)  # w / ‖Δ‖ on the raw Δ
    direction, dsq = _weighted_sum(deltas, [float(c) for c in coeffs], math.prod(shape), out)
    # The mean of unit vectors has norm in [0, 1]; below fp32 round-off the directions
    # cancel (or every input is zero) and φ(0) = 0 means no update.
    dnorm = float(np.sqrt(dsq))
    return Update(direction.reshape(shape), radius / dnorm if dnorm >= 1e-6 else 0.0, dsq)


def weighted_average(deltas: Sequence[Source], weights: Sequence[float], scales: Sequence[float] | None = None) -> np.ndarray:
    """Σ w_m s_m Δ_m / Σ w_m (s_m: a per-contribution factor such as a staleness discount, 1 by default)."""
    return _average(deltas, weights, scales).array()


def rda(deltas: Sequence[Source], weights: Sequence[float], scales: Sequence[float] | None = None) -> np.ndarray:
    """Radial-directional average of one tensor's outer gradients s_m Δ_m (s_m ≥ 0 scales a
    contribution's norm, not its direction). Two passes over each input: its norm, then its
    share of the direction, decoded straight into the accumulator."""
    return _rda(deltas, weights, scales).array()


def merge_updates(
    contributions: Sequence[Mapping[str, Source]],
    weights: Sequence[float],
    method: MergeMethod = "rda",
    *,
    plain_average: frozenset[str] | set[str] = frozenset(),
    scales: Sequence[float] | None = None,
    out: Mapping[str, np.ndarray] | None = None,
) -> dict[str, Update]:
    """Merge per tensor; tensors in `plain_average` (embeddings) always use the weighted
    average. `scales`: per-contribution factors (staleness discounts), folded into the merge.
    `out`: flat fp32 accumulators to merge into, one per tensor (the syncer lends the same
    memory every round: bench/publish_profile.py, rda_round against rda_round_fresh)."""
    if not contributions:
        raise ValueError("nothing to merge")
    names = set(contributions[0])
    for c in contributions[1:]:
        if set(c) != names:
            raise ValueError("contributions disagree on the fragment's tensors")
    merged: dict[str, Update] = {}
    for name in sorted(names):
        deltas = [c[name] for c in contributions]
        rule = _rda if method == "rda" and name not in plain_average else _average
        merged[name] = rule(deltas, weights, scales, None if out is None else out[name])
    return merged


def merge_fragment(
    contributions: Sequence[Mapping[str, Source]],
    weights: Sequence[float],
    method: MergeMethod = "rda",
    *,
    plain_average: frozenset[str] | set[str] = frozenset(),
    scales: Sequence[float] | None = None,
) -> dict[str, np.ndarray]:
    """`merge_updates` as plain arrays."""
    return {n: u.array() for n, u in merge_updates(contributions, weights, method, plain_average=plain_average,
                                                             scales=scales).items()}
