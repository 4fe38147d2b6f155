"""nf4: 4-bit NormalFloat blocks, the compiled loops (the codec itself is diloco/core/codecs.py).

Same bytes as int4 (an fp32 scale per block, two 4-bit codes per byte, the block's first half
in the low nibbles), but the 16 levels are not evenly spaced: they are the quantiles of a
normal distribution scaled to [-1, 1] (QLoRA's NormalFloat, Dettmers et al. 2023), and a
block's scale is its absmax. Updates are bell-shaped with heavy tails, so most values sit near
zero, where nf4 puts most of its levels: on Gaussian, Laplace and Student-t(3) values its mean
squared error is 0.73, 0.54 and 0.47 of int4's at the same 4.5 bits a value (BENCHMARKS §14).
The syncer → learner broadcast is where that matters: its error is what every learner starts
its next inner phase from.

Encoding picks the nearest level by counting the midpoints below the value (15 compares, no
branch, so it vectorises); zero is a level, so a zero block or a zero value encodes exactly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from diloco.core.kernels import GROUP, _jit, group_scales

# QLoRA's NF4 levels (bitsandbytes' table): index 7 is exactly 0, 0 and 15 are -1 and 1.
LEVELS = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0], np.float32)
MIDPOINTS = ((LEVELS[1:] + LEVELS[:-1]) / 2).astype(np.float32)  # a value above k of them gets code k
SQUARES = (LEVELS.astype(np.float64) ** 2)


@dataclass(frozen=True)
class Nf4Kernels:
    """The loops for one block size, with int4's signatures (BlockKernels), scales being absmax."""

    encode: Any  # (x f32[nb*B], scales f32[nb], packed u8[nb*B/2]) -> None: whole blocks
    encode_delta: Any  # (target, base, scales, packed, new, add_base) -> None
    decode: Any  # (scales, packed, out f32[n]) -> None
    weighted_sum: Any  # (s0, q0, .., s3, q3, c f32[1..4], acc f32[n], init) -> None
    sumsq: Any  # (scales, packed) -> float


@functools.cache
def block_kernels(block: int) -> Nf4Kernels:
    """nf4's loops specialised to `block` (even, >= 2; checked by the codec)."""
    B, H = block, block // 2
    levels, mids, squares = LEVELS, MIDPOINTS, SQUARES

    @_jit()
    def encode_delta(target: Any, base: Any, scales: Any, packed: Any, new: Any, add_base: bool) -> None:
        """Encode target − base, and new = [base +] its decoded values, what a receiver computes
        from the bytes, bit for bit. Whole blocks only."""
        d, nb = np.empty(GROUP * B, np.float32), target.size // B
        top, inv = np.empty(GROUP, np.uint32), np.empty(GROUP, np.float32)
        for g in range(-(-nb // GROUP)):
            g0, n = g * GROUP, min(GROUP, nb - g * GROUP)
            for i in range(n * B):
                d[i] = target[g0 * B + i] - base[g0 * B + i]
            group_scales(d.view(np.uint32), 0, n, B, np.float32(1.0), top, scales[g0:], inv)  # scale = absmax
            for k in range(n):
                lo, iv, s = (g0 + k) * B, inv[k], scales[g0 + k]
                for j in range(H):
                    lo_y, hi_y = d[k * B + j] * iv, d[k * B + H + j] * iv
                    lo_q, hi_q = np.int32(0), np.int32(0)
                    for i in range(15):  # the nearest level: how many midpoints lie below
                        lo_q += np.int32(lo_y > mids[i])
                        hi_q += np.int32(hi_y > mids[i])
                    packed[(g0 + k) * H + j] = np.uint8(lo_q | (hi_q << np.int32(4)))
                    lo_d, hi_d = levels[lo_q] * s, levels[hi_q] * s
                    if add_base:
                        lo_d, hi_d = base[lo + j] + lo_d, base[lo + H + j] + hi_d
                    new[lo + j], new[lo + H + j] = lo_d, hi_d

    def encode(x: Any, scales: Any, packed: Any) -> None:
        """Whole blocks only (the caller pads a last, partial one)."""
        encode_delta(x, np.zeros_like(x), scales, packed, np.empty_like(x), False)

    @_jit()
    def decode(scales: Any, packed: Any, out: Any) -> None:
        for b in range(scales.size):
            s, lo = scales[b], b * B
            for j in range(min(B, out.size - lo)):
                byte = np.int32(packed[b * H + j % H])
                out[lo + j] = levels[(byte >> 4) if j >= H else (byte & 15)] * s

    @_jit()
    def weighted_sum(s0: Any, q0: Any, s1: Any, q1: Any, s2: Any, q2: Any, s3: Any, q3: Any,
                     c: Any, acc: Any, init: bool) -> None:
        """acc ← [acc +] Σ c[k]·decode(s_k, q_k) over the first c.size (1 to 4) payloads, added
        in order: bit for bit one accumulating pass per payload."""
        m = c.size
        for b in range(s0.size):
            lo = b * B
            f0, f1 = s0[b] * c[0], s1[b] * c[min(1, m - 1)]
            f2, f3 = s2[b] * c[min(2, m - 1)], s3[b] * c[min(3, m - 1)]
            for j in range(min(B, acc.size - lo)):
                at, shift = b * H + j % H, np.int32(4) if j >= H else np.int32(0)
                v = np.float32(0.0) if init else acc[lo + j]
                v += levels[(np.int32(q0[at]) >> shift) & 15] * f0
                if m > 1:
                    v += levels[(np.int32(q1[at]) >> shift) & 15] * f1
                if m > 2:
                    v += levels[(np.int32(q2[at]) >> shift) & 15] * f2
                if m > 3:
                    v += levels[(np.int32(q3[at]) >> shift) & 15] * f3
                acc[lo + j] = v

    @_jit()
    def sumsq(scales: Any, packed: Any) -> float:
        total = 0.0
        for b in range(scales.size):
            q2 = 0.0
            for j in range(H):
                byte = np.int32(packed[b * H + j])
                q2 += squares[byte & 15] + squares[byte >> 4]
            s = np.float64(scales[b])
            total += s * s * q2
        return total

    return Nf4Kernels(encode, encode_delta, decode, weighted_sum, sumsq)
