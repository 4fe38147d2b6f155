"""Compiled inner loops of the codecs, the merge and the outer step.

The syncer decodes every contribution, merges rounds and steps the outer optimizer; learners
encode one fragment per step. numpy needs a temporary per operation and a pass per temporary
(int4 encode+decode ran at 0.07 of a memory copy); these loops make one pass each, into buffers
the caller owns, with the GIL released so gRPC threads decode in parallel. Why numba rather than
XLA on the CPU or a C extension: docs/BENCHMARKS.md §6 (measured; and the syncer needs no JAX).

Block-wise kernels are compiled per block size, which LLVM then sees as a constant: a 64-value
block becomes a few full-width vector operations instead of a loop with a remainder
(3.5x faster measured). Compiled code is cached on disk (`NUMBA_CACHE_DIR`, else beside
this file); where neither is writable, the kernels compile in memory at first use (about 1 s).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np

ABS_MASK = np.uint32(0x7FFFFFFF)  # clears the sign bit: |x| as bits, ordered like |x| (NaN above Inf)
EIGHT = np.float32(8.0)  # an int4 code's offset
OFFSET8 = np.float32(128.5)  # int8: truncating v + 128.5 rounds v half up, from 1 to 255, as int4's v + 8.5 does
GROUP = 32  # blocks an encoder takes at a time: 8 KiB of input at block 64, in L1 for its second read (measured best of 8-64)


def _jit(fastmath: bool = False) -> Callable[[Callable[..., Any]], Any]:
    """nopython, GIL released, numpy's error model (1/0 = inf, no exception); cached on disk
    where a cache directory is writable. (A kernel calls another only per group of blocks, never
    per block, whose call would cost more than the block; and never a closure, which numba
    cannot cache. The plain encoders keep their maxima inline: through `group_scales` they ran
    3x slower, measured, where the fused ones did not.)"""
    def wrap(fn: Callable[..., Any]) -> Any:
        for cache in (True, False):  # no cache where no cache directory is writable (a read-only install)
            try:
                return numba.njit(cache=cache, nogil=True, error_model="numpy", fastmath=fastmath)(fn)
            except RuntimeError:  # "cannot cache function ...: no locator available"
                continue
        raise AssertionError("unreachable: compiling without a cache cannot fail to find one")
    return wrap


@_jit()
def group_scales(bits: Any, lo: int, n: int, block: int, qmax: np.float32, top: Any, scales: Any, inv: Any) -> None:
    """scales[:n] = max |x| / qmax of the n blocks from bits[lo] (x's bits: NaN or Inf input gives a
    scale decode refuses), inv[:n] their reciprocals (0 for a zero block): an encoder's first
    two passes over a group of blocks (the fused encoders call it), the divisions in one vector
    pass instead of two per block."""
    absmax = top.view(np.float32)
    for k in range(n):
        m = np.uint32(0)
        for i in range(lo + k * block, lo + (k + 1) * block):
            m = max(m, np.uint32(bits[i] & ABS_MASK))
        top[k] = m
    for k in range(n):
        s = absmax[k] / qmax
        scales[k] = s
        inv[k] = np.float32(1.0) / s if s > 0 else np.float32(0.0)


@dataclass(frozen=True)
class BlockKernels:
    """The block-wise absmax codecs for one block size. int4 packs the block's first half in
    the low nibbles and its second half in the high ones (contiguous halves vectorise; value
    pairs would need shuffles); int8 stores one signed byte per value."""

    int4_encode: Any  # (x f32[nb*B], scales f32[nb], packed u8[nb*B/2]) -> None: whole blocks
    int4_encode_delta: Any  # (target, base, scales, packed, new, add_base) -> None: encode(target − base), new = [base +] decoded
    int4_decode: Any  # (scales, packed, out f32[n]) -> None
    int4_weighted_sum: Any  # (s0, q0, .., s3, q3, c f32[1..4], acc f32[n], init) -> None: acc [+]= Σ c_k * decode_k
    int4_sumsq: Any  # (scales, packed) -> float: ‖decode‖², from the packed bytes alone
    int8_encode: Any  # (x f32[nb*B], scales, q i8[nb*B]) -> None: whole blocks
    int8_encode_delta: Any  # (target, base, scales, q, new, add_base) -> None
    int8_decode: Any  # (scales, q, out) -> None
    int8_weighted_sum: Any  # the same for int8 codes
    int8_sumsq: Any  # (scales, q) -> float


@functools.cache
def block_kernels(block: int) -> BlockKernels:
    """Kernels specialised to `block` (even, >= 2; checked by the codec).

    Encoders take GROUP blocks at a time: their maxima, then all their scales and reciprocals
    in one vector pass (two scalar divisions per block had cost a third of the encode), then
    their codes. Decoders convert codes through int32 (numba widens integer arithmetic to
    int64, which halves the lanes of every vector operation): (q & 15) as a float minus 8 is
    exactly the float of q − 8, so the values are bit for bit those of the plain formula."""
    B, H = block, block // 2

    @_jit()
    def int4_encode(x: Any, scales: Any, packed: Any) -> None:
        """Whole blocks only (the caller pads a last, partial one)."""
        bits, nb = x.view(np.uint32), x.size // B
        top, inv = np.empty(GROUP, np.uint32), np.empty(GROUP, np.float32)
        absmax = top.view(np.float32)
        for g in range(-(-nb // GROUP)):
            g0, n = g * GROUP, min(GROUP, nb - g * GROUP)
            for k in range(n):  # max |x| from the bits: NaN or Inf input gives a scale decode refuses
                lo, m = (g0 + k) * B, np.uint32(0)
                for i in range(B):
                    m = max(m, np.uint32(bits[lo + i] & ABS_MASK))
                top[k] = m
            for k in range(n):
                s = absmax[k] / np.float32(7.0)
                scales[g0 + k] = s
                inv[k] = np.float32(1.0) / s if s > 0 else np.float32(0.0)
            for k in range(n):  # floor(v + 8.5) rounds to nibbles 1..15; 0 (= -8) is never written
                lo, iv, out = (g0 + k) * B, inv[k], (g0 + k) * H
                for j in range(H):
                    lo_q = np.int32(x[lo + j] * iv + np.float32(8.5))
                    hi_q = np.int32(x[lo + H + j] * iv + np.float32(8.5))
                    packed[out + j] = np.uint8(lo_q | np.int32(hi_q << np.int32(4)))

    @_jit()
    def int4_encode_delta(target: Any, base: Any, scales: Any, packed: Any, new: Any, add_base: bool) -> None:
        """int4_encode(target − base), and new = base + its decoded values (what a subscriber
        computes from the bytes, bit for bit), or with `add_base` false the decoded values
        alone (what the syncer decodes from a learner's push), in one pass. Whole blocks only."""
        d, nb = np.empty(GROUP * B, np.float32), target.size // B
        top, inv = np.empty(GROUP, np.uint32), np.empty(GROUP, np.float32)
        for g in range(-(-nb // GROUP)):
            g0, n = g * GROUP, min(GROUP, nb - g * GROUP)
            for i in range(n * B):
                d[i] = target[g0 * B + i] - base[g0 * B + i]
            group_scales(d.view(np.uint32), 0, n, B, np.float32(7.0), top, scales[g0:], inv)
            for k in range(n):
                lo, iv, s = (g0 + k) * B, inv[k], scales[g0 + k]
                for j in range(H):
                    lo_q = np.int32(d[k * B + j] * iv + np.float32(8.5))
                    hi_q = np.int32(d[k * B + H + j] * iv + np.float32(8.5))
                    packed[(g0 + k) * H + j] = np.uint8(lo_q | np.int32(hi_q << np.int32(4)))
                    lo_d = (np.float32(np.int32(lo_q & np.int32(15))) - EIGHT) * s
                    hi_d = (np.float32(np.int32(hi_q & np.int32(15))) - EIGHT) * s
                    if add_base:  # loop-invariant: LLVM unswitches it
                        lo_d, hi_d = base[lo + j] + lo_d, base[lo + H + j] + hi_d
                    new[lo + j], new[lo + H + j] = lo_d, hi_d

    @_jit()
    def int4_decode(scales: Any, packed: Any, out: Any) -> None:
        full = out.size // B
        for b in range(full):
            s, lo = scales[b], b * B
            for j in range(H):
                byte = np.int32(packed[b * H + j])
                out[lo + j] = (np.float32(np.int32(byte & np.int32(15))) - EIGHT) * s
                out[lo + H + j] = (np.float32(np.int32(byte >> np.int32(4))) - EIGHT) * s
        if full < scales.size:
            s, lo = scales[full], full * B
            for j in range(out.size - lo):
                byte = np.int32(packed[full * H + j % H])
                out[lo + j] = (np.float32(np.int32((byte >> 4) if j >= H else (byte & 15))) - EIGHT) * s

    @_jit()
    def int4_weighted_sum(s0: Any, q0: Any, s1: Any, q1: Any, s2: Any, q2: Any, s3: Any, q3: Any,
                          c: Any, acc: Any, init: bool) -> None:
        """acc ← [acc +] Σ c[k]·decode(s_k, q_k) over the first c.size (1 to 4) payloads, added in
        order: bit for bit one accumulating pass per payload, in one pass over acc."""
        m, full = c.size, acc.size // B
        c0, c1, c2, c3 = c[0], c[min(1, m - 1)], c[min(2, m - 1)], c[min(3, m - 1)]
        for b in range(full):
            f0, f1, f2, f3, lo, at = s0[b] * c0, s1[b] * c1, s2[b] * c2, s3[b] * c3, b * B, b * H
            for j in range(H):
                v0, v1 = np.int32(q0[at + j]), np.int32(q1[at + j])
                v2, v3 = np.int32(q2[at + j]), np.int32(q3[at + j])
                lo_v = np.float32(0.0) if init else acc[lo + j]
                hi_v = np.float32(0.0) if init else acc[lo + H + j]
                lo_v += (np.float32(np.int32(v0 & np.int32(15))) - EIGHT) * f0
                hi_v += (np.float32(np.int32(v0 >> np.int32(4))) - EIGHT) * f0
                if m > 1:
                    lo_v += (np.float32(np.int32(v1 & np.int32(15))) - EIGHT) * f1
                    hi_v += (np.float32(np.int32(v1 >> np.int32(4))) - EIGHT) * f1
                if m > 2:
                    lo_v += (np.float32(np.int32(v2 & np.int32(15))) - EIGHT) * f2
                    hi_v += (np.float32(np.int32(v2 >> np.int32(4))) - EIGHT) * f2
                if m > 3:
                    lo_v += (np.float32(np.int32(v3 & np.int32(15))) - EIGHT) * f3
                    hi_v += (np.float32(np.int32(v3 >> np.int32(4))) - EIGHT) * f3
                acc[lo + j], acc[lo + H + j] = lo_v, hi_v
        lo = full * B
        if init:
            acc[lo:] = 0.0
        for k in range(m if lo < acc.size else 0):  # the last, partial block: payload by payload
            s, q = (s0, q0) if k == 0 else (s1, q1) if k == 1 else (s2, q2) if k == 2 else (s3, q3)
            f = s[full] * c[k]
            for j in range(acc.size - lo):
                byte = np.int32(q[full * H + j % H])
                acc[lo + j] += (np.float32(np.int32((byte >> 4) if j >= H else (byte & 15))) - EIGHT) * f

    @_jit()
    def int4_sumsq(scales: Any, packed: Any) -> float:
        total = 0.0
        for b in range(scales.size):
            q2 = np.int64(0)
            for j in range(H):
                byte = np.int32(packed[b * H + j])
                lo_q, hi_q = (byte & 15) - 8, (byte >> 4) - 8
                q2 += lo_q * lo_q + hi_q * hi_q
            s = np.float64(scales[b])
            total += s * s * q2
        return total

    @_jit()
    def int8_encode(x: Any, scales: Any, q: Any) -> None:
        """Whole blocks only (the caller pads a last, partial one)."""
        bits, nb, codes = x.view(np.uint32), x.size // B, q.view(np.uint8)  # the int8 code c is the byte (c + 128) ^ 128
        top, inv = np.empty(GROUP, np.uint32), np.empty(GROUP, np.float32)
        absmax = top.view(np.float32)
        for g in range(-(-nb // GROUP)):
            g0, n = g * GROUP, min(GROUP, nb - g * GROUP)
            for k in range(n):
                lo, m = (g0 + k) * B, np.uint32(0)
                for i in range(B):
                    m = max(m, np.uint32(bits[lo + i] & ABS_MASK))
                top[k] = m
            for k in range(n):
                s = absmax[k] / np.float32(127.0)
                scales[g0 + k] = s
                inv[k] = np.float32(1.0) / s if s > 0 else np.float32(0.0)
            for k in range(n):  # floor(v + 128.5) is 1..255 (|v| <= 127): the code plus 128, no clamp needed
                lo, iv = (g0 + k) * B, inv[k]
                for j in range(B):
                    codes[lo + j] = np.uint8(np.int32(x[lo + j] * iv + OFFSET8) ^ np.int32(128))

    @_jit()
    def int8_encode_delta(target: Any, base: Any, scales: Any, q: Any, new: Any, add_base: bool) -> None:
        """int8_encode(target − base), and new = base + its decoded values (or, with `add_base`
        false, the decoded values alone), in one pass."""
        d, nb, codes = np.empty(GROUP * B, np.float32), target.size // B, q.view(np.uint8)
        top, inv = np.empty(GROUP, np.uint32), np.empty(GROUP, np.float32)
        for g in range(-(-nb // GROUP)):
            g0, n = g * GROUP, min(GROUP, nb - g * GROUP)
            for i in range(n * B):
                d[i] = target[g0 * B + i] - base[g0 * B + i]
            group_scales(d.view(np.uint32), 0, n, B, np.float32(127.0), top, scales[g0:], inv)
            for k in range(n):
                lo, iv, s = (g0 + k) * B, inv[k], scales[g0 + k]
                for j in range(B):  # as int8_encode; the float of the code is exact either way
                    biased = np.int32(d[k * B + j] * iv + OFFSET8)
                    codes[lo + j] = np.uint8(biased ^ np.int32(128))
                    d_j = (np.float32(biased) - np.float32(128.0)) * s
                    new[lo + j] = base[lo + j] + d_j if add_base else d_j

    @_jit()
    def int8_decode(scales: Any, q: Any, out: Any) -> None:
        for b in range(scales.size):
            s, lo = scales[b], b * B
            for j in range(min(B, out.size - lo)):
                out[lo + j] = np.float32(q[lo + j]) * s

    @_jit()
    def int8_weighted_sum(s0: Any, q0: Any, s1: Any, q1: Any, s2: Any, q2: Any, s3: Any, q3: Any,
                          c: Any, acc: Any, init: bool) -> None:
        """int4_weighted_sum for int8 codes."""
        m = c.size
        c0, c1, c2, c3 = c[0], c[min(1, m - 1)], c[min(2, m - 1)], c[min(3, m - 1)]
        for b in range(-(-acc.size // B)):
            f0, f1, f2, f3, lo = s0[b] * c0, s1[b] * c1, s2[b] * c2, s3[b] * c3, b * B
            for j in range(lo, min(lo + B, acc.size)):
                v = np.float32(0.0) if init else acc[j]
                v += np.float32(q0[j]) * f0
                if m > 1:
                    v += np.float32(q1[j]) * f1
                if m > 2:
                    v += np.float32(q2[j]) * f2
                if m > 3:
                    v += np.float32(q3[j]) * f3
                acc[j] = v

    @_jit()
    def int8_sumsq(scales: Any, q: Any) -> float:
        total = 0.0
        for b in range(scales.size):
            q2 = np.int64(0)
            for j in range(B):
                v = np.int32(q[b * B + j])
                q2 += v * v
            s = np.float64(scales[b])
            total += s * s * q2
        return total

    return BlockKernels(int4_encode, int4_encode_delta, int4_decode, int4_weighted_sum, int4_sumsq,
                        int8_encode, int8_encode_delta, int8_decode, int8_weighted_sum, int8_sumsq)


@_jit()
def valid_scales(scales: Any) -> bool:
    """Every block scale finite and >= 0 (NaN fails both comparisons). One call instead of the
    three numpy passes and temporaries that cost more than decoding a small tensor."""
    ok = True
    for i in range(scales.size):
        ok &= (scales[i] >= 0) & (scales[i] < np.inf)
    return ok


SUMSQ_BLOCK = 4096  # values summed in fp32 before their sum joins the fp64 total: 1.4x the all-fp64 loop's speed, relative error ~1e-9 measured


@_jit(fastmath=True)  # reassociation lets the sums vectorise; the order of a sum is not a contract
def sumsq(x: Any) -> float:
    """Σ x²: fp32 within blocks of SUMSQ_BLOCK values (vector lanes of a few hundred terms
    each), fp64 across blocks, so the error does not grow with the tensor's size."""
    total, full = 0.0, x.size // SUMSQ_BLOCK
    for b in range(full):
        part = np.float32(0.0)
        for i in range(b * SUMSQ_BLOCK, (b + 1) * SUMSQ_BLOCK):
            part += x[i] * x[i]
        total += float(part)
    for i in range(full * SUMSQ_BLOCK, x.size):
        v = np.float64(x[i])
        total += v * v
    return total


@_jit(fastmath=True)  # as sumsq: the ten sums vectorise only when they may be reassociated
def gram(x0: Any, x1: Any, x2: Any, x3: Any, out: Any) -> None:
    """out[i, j] = <x_i, x_j> (4 x 4, fp64, symmetric) in one pass over the four arrays, blocked
    like `sumsq`: RDA of up to four fp32 contributions takes their norms and the merged
    direction's norm from it, so it reads each input twice (this pass, the weighted sum) and
    never re-reads its accumulator (merge.py). Pass an array twice when there are fewer."""
    n, full = x0.size, x0.size // SUMSQ_BLOCK
    t = np.zeros(10)
    for b in range(full):
        s00 = s01 = s02 = s03 = s11 = s12 = s13 = s22 = s23 = s33 = np.float32(0.0)
        for i in range(b * SUMSQ_BLOCK, (b + 1) * SUMSQ_BLOCK):
            a, c, d, e = x0[i], x1[i], x2[i], x3[i]
            s00 += a * a
            s01 += a * c
            s02 += a * d
            s03 += a * e
            s11 += c * c
            s12 += c * d
            s13 += c * e
            s22 += d * d
            s23 += d * e
            s33 += e * e
        for k, v in enumerate((s00, s01, s02, s03, s11, s12, s13, s22, s23, s33)):
            t[k] += float(v)
    for i in range(full * SUMSQ_BLOCK, n):
        a, c, d, e = np.float64(x0[i]), np.float64(x1[i]), np.float64(x2[i]), np.float64(x3[i])
        t[0] += a * a
        t[1] += a * c
        t[2] += a * d
        t[3] += a * e
        t[4] += c * c
        t[5] += c * d
        t[6] += c * e
        t[7] += d * d
        t[8] += d * e
        t[9] += e * e
    k = 0
    for i in range(4):
        for j in range(i, 4):
            out[i, j] = out[j, i] = t[k]
            k += 1


@_jit()
def weighted_sum(x0: Any, x1: Any, x2: Any, x3: Any, c: Any, acc: Any, init: bool) -> None:
    """acc ← [acc +] c[0]·x0 + c[1]·x1 + ...: the first c.size (1 to 4) of the x's, added in order
    (so bit for bit one pass per contribution, `acc[i] += x[i] * c`) in one pass over acc.
    The branches are loop-invariant: LLVM compiles a loop per case."""
    m = c.size
    c0, c1, c2, c3 = c[0], c[min(1, m - 1)], c[min(2, m - 1)], c[min(3, m - 1)]
    for i in range(acc.size):
        v = x0[i] * c0 if init else acc[i] + x0[i] * c0
        if m > 1:
            v += x1[i] * c1
        if m > 2:
            v += x2[i] * c2
        if m > 3:
            v += x3[i] * c3
        acc[i] = v


@_jit()
def scale_inplace(x: Any, c: np.float32) -> None:
    for i in range(x.size):
        x[i] *= c


@_jit()
def sgd_step(param: Any, delta: Any, lr: np.float32, out: Any) -> None:
    """out ← Θ − lr·Δ: the Nesterov step at μ = 0, bit for bit (Δ + 0·b = Δ for finite b)."""
    for i in range(param.size):
        out[i] = param[i] - lr * delta[i]


@_jit()
def nesterov_step(param: Any, buf: Any, delta: Any, c: np.float32, lr: np.float32, mu: np.float32, out: Any) -> None:
    """b ← μ·b + cΔ;  out ← Θ − lr·(cΔ + μ·b), in one pass (the same float ops as the numpy form)."""
    for i in range(param.size):
        d = delta[i] * c
        b = buf[i] * mu + d
        buf[i] = b
        out[i] = param[i] - lr * (d + mu * b)
