"""Merging learners' outer gradients for one fragment (docs/ALGORITHM.md, "The syncer": Merge).

Radial-directional averaging (RDA) averages norms and directions separately:
Δ = (Σ w‖Δ_m‖ / Σ w) · φ(Σ w φ(Δ_m) / Σ w), φ(x) = x/‖x‖, φ(0) = 0.
A plain average of M nearly orthogonal updates shrinks like 1/√M; RDA keeps the
typical update norm, so the outer learning rate need not change with M.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np

MergeMethod = Literal["rda", "average"]


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


def _stacked(deltas: Sequence[np.ndarray] | np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    """(M, n) fp32 matrix of the contributions: one BLAS call then does each weighted sum."""
    if isinstance(deltas, np.ndarray):
        if deltas.ndim < 1:
            raise ValueError("need a stack of contributions")
        shape = deltas.shape[1:]
        return np.ascontiguousarray(deltas, dtype=np.float32).reshape(deltas.shape[0], -1), shape
    shape = np.shape(deltas[0])
    if any(np.shape(d) != shape for d in deltas):
        raise ValueError("contributions to one tensor must share its shape")
    return np.stack([np.asarray(d, dtype=np.float32).reshape(-1) for d in deltas]), shape


def weighted_average(deltas: Sequence[np.ndarray] | np.ndarray, weights: Sequence[float]) -> np.ndarray:
    """Σ w_m Δ_m / Σ w_m."""
    stack, shape = _stacked(deltas)
    w = _normalised(weights, stack.shape[0]).astype(np.float32)
    return (w @ stack).reshape(shape)


def rda(deltas: Sequence[np.ndarray] | np.ndarray, weights: Sequence[float]) -> np.ndarray:
    """Radial-directional average of one tensor's outer gradients (a stack or a list)."""
    stack, shape = _stacked(deltas)
    w = _normalised(weights, stack.shape[0])
    norms = np.sqrt(np.array([float(np.dot(row, row)) for row in stack]))
    radius = float(np.dot(w, norms))
    coeffs = np.divide(w, norms, out=np.zeros_like(w), where=norms > 0).astype(np.float32)
    direction = coeffs @ stack
    # The mean of unit vectors has norm in [0, 1]; below fp32 round-off the directions
    # cancel (or every input is zero) and φ(0) = 0 means no update.
    dnorm = float(np.sqrt(np.dot(direction, direction)))
    if dnorm < 1e-6:
        return np.zeros(shape, dtype=np.float32)
    direction *= np.float32(radius / dnorm)
    return direction.reshape(shape)


def merge_fragment(
    contributions: Sequence[Mapping[str, np.ndarray]],
    weights: Sequence[float],
    method: MergeMethod = "rda",
    plain_average: frozenset[str] | set[str] = frozenset(),
) -> dict[str, np.ndarray]:
    """Merge per tensor; tensors in `plain_average` (embeddings) always use the weighted average."""
    if not contributions:
        raise ValueError("nothing to merge")
    names = set(contributions[0])
    for c in contributions[1:]:
        if set(c) != names:
            raise ValueError("contributions disagree on the fragment's tensors")
    merged: dict[str, np.ndarray] = {}
    for name in sorted(names):
        deltas = [c[name] for c in contributions]
        if method == "rda" and name not in plain_average:
            merged[name] = rda(deltas, weights)
        else:
            merged[name] = weighted_average(deltas, weights)
    return merged
