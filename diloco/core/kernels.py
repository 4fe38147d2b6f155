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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numba
import numpy as np

if TYPE_CHECKING:
    from diloco.core.codecs import Codec

ABS_MASK = np.uint32(0x7FFFFFFF)  # clears the sign bit: |x| as bits, ordered like |x| (NaN above Inf)
RINT = np.float32(12582912.0)  # 1.5 * 2^23: x + RINT - RINT is x rounded half to even for |x| < 2^22


def _jit(fastmath: bool = False) -> Callable[[Callable[..., Any]], Any]:
    """nopython, GIL released, numpy's error model (1/0 = inf, no exception); cached on disk
    where a cache directory is writable. (No kernel calls another: a call per block would cost
    more than the block, and numba cannot cache a closure that calls a closure.)"""
    def wrap(fn: Callable[..., Any]) -> Any:
        for cache in (True, False):  # no cache where no cache directory is writable (a read-only install)
            try:
                return numba.njit(cache=cache, nogil=True, error_model="numpy", fastmath=fastmath)(fn)
            except RuntimeError:  # "cannot cache function ...: no locator available"
                continue
        raise AssertionError("unreachable: compiling without a cache cannot fail to find one")
    return wrap


@dataclass(frozen=True)
class BlockKernels:
    """The block-wise absmax codecs for one block size. int4 packs the block's first half in
    the low nibbles and its second half in the high ones (contiguous halves vectorise; value
    pairs would need shuffles); int8 stores one signed byte per value."""

    int4_encode: Any  # (x f32[nb*B], scales f32[nb], packed u8[nb*B/2]) -> None: whole blocks
    int4_encode_delta: Any  # (target, base, scales, packed, new, add_base) -> None: encode(target − base), new = [base +] decoded
    int4_decode: Any  # (scales, packed, out f32[n]) -> None
    int4_accumulate: Any  # (scales, packed, c f32, acc f32[n]) -> None: acc += c * decode
    int4_sumsq: Any  # (scales, packed) -> float: ‖decode‖², from the packed bytes alone
    int8_encode: Any  # (x f32[nb*B], scales, q i8[nb*B]) -> None: whole blocks
    int8_encode_delta: Any  # (target, base, scales, q, new, add_base) -> None
    int8_decode: Any  # (scales, q, out) -> None
    int8_accumulate: Any  # (scales, q, c, acc) -> None
    int8_sumsq: Any  # (scales, q) -> float


@functools.cache
def block_kernels(block: int) -> BlockKernels:
    """Kernels specialised to `block` (even, >= 2; checked by the codec)."""
    B, H = block, block // 2

    @_jit()
    def int4_encode(x: Any, scales: Any, packed: Any) -> None:
        """Whole blocks only (the caller pads a last, partial one)."""
        bits, tmp = x.view(np.uint32), np.empty(1, np.uint32)
        absmax = tmp.view(np.float32)
        for b in range(x.size // B):
            lo, m = b * B, np.uint32(0)
            for i in range(B):  # max |x| from the bits: NaN or Inf input gives a scale decode refuses
                m = max(m, bits[lo + i] & ABS_MASK)
            tmp[0] = m
            s = absmax[0] / np.float32(7.0)
            scales[b] = s
            inv = np.float32(1.0) / s if s > 0 else np.float32(0.0)
            for j in range(H):  # floor(v + 8.5) rounds to nibbles 1..15; 0 (= -8) is never written
                lo_q = np.int32(x[lo + j] * inv + np.float32(8.5))
                hi_q = np.int32(x[lo + H + j] * inv + np.float32(8.5))
                packed[b * H + j] = np.uint8(lo_q | (hi_q << 4))

    @_jit()
    def int4_encode_delta(target: Any, base: Any, scales: Any, packed: Any, new: Any, add_base: bool) -> None:
        """int4_encode(target − base), and new = base + its decoded values (what a subscriber
        computes from the bytes, bit for bit), or with `add_base` false the decoded values
        alone (what the syncer decodes from a learner's push), in one pass. Whole blocks only."""
        d, tmp = np.empty(B, np.float32), np.empty(1, np.uint32)
        bits, absmax = d.view(np.uint32), tmp.view(np.float32)
        for b in range(target.size // B):
            lo, m = b * B, np.uint32(0)
            for i in range(B):
                d[i] = target[lo + i] - base[lo + i]
            for i in range(B):
                m = max(m, bits[i] & ABS_MASK)
            tmp[0] = m
            s = absmax[0] / np.float32(7.0)
            scales[b] = s
            inv = np.float32(1.0) / s if s > 0 else np.float32(0.0)
            for j in range(H):
                lo_q = np.int32(d[j] * inv + np.float32(8.5))
                hi_q = np.int32(d[H + j] * inv + np.float32(8.5))
                packed[b * H + j] = np.uint8(lo_q | (hi_q << 4))
                lo_d, hi_d = np.float32((lo_q & 15) - 8) * s, np.float32((hi_q & 15) - 8) * s
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
                out[lo + j] = np.float32((byte & 15) - 8) * s
                out[lo + H + j] = np.float32((byte >> 4) - 8) * s
        if full < scales.size:
            s, lo = scales[full], full * B
            for j in range(out.size - lo):
                byte = np.int32(packed[full * H + j % H])
                out[lo + j] = np.float32(((byte >> 4) if j >= H else (byte & 15)) - 8) * s

    @_jit()
    def int4_accumulate(scales: Any, packed: Any, c: np.float32, acc: Any) -> None:
        full = acc.size // B
        for b in range(full):
            s, lo = scales[b] * c, b * B
            for j in range(H):
                byte = np.int32(packed[b * H + j])
                acc[lo + j] += np.float32((byte & 15) - 8) * s
                acc[lo + H + j] += np.float32((byte >> 4) - 8) * s
        if full < scales.size:
            s, lo = scales[full] * c, full * B
            for j in range(acc.size - lo):
                byte = np.int32(packed[full * H + j % H])
                acc[lo + j] += np.float32(((byte >> 4) if j >= H else (byte & 15)) - 8) * s

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
        bits, tmp = x.view(np.uint32), np.empty(1, np.uint32)
        absmax = tmp.view(np.float32)
        for b in range(x.size // B):
            lo, m = b * B, np.uint32(0)
            for i in range(B):
                m = max(m, bits[lo + i] & ABS_MASK)
            tmp[0] = m
            s = absmax[0] / np.float32(127.0)
            scales[b] = s
            inv = np.float32(1.0) / s if s > 0 else np.float32(0.0)
            for j in range(B):  # adding and subtracting 1.5 * 2^23 rounds half to even, as np.rint does
                v = (x[lo + j] * inv + RINT) - RINT
                q[lo + j] = np.int8(np.int32(min(max(v, np.float32(-127.0)), np.float32(127.0))))

    @_jit()
    def int8_encode_delta(target: Any, base: Any, scales: Any, q: Any, new: Any, add_base: bool) -> None:
        """int8_encode(target − base), and new = base + its decoded values (or, with `add_base`
        false, the decoded values alone), in one pass."""
        d, tmp = np.empty(B, np.float32), np.empty(1, np.uint32)
        bits, absmax = d.view(np.uint32), tmp.view(np.float32)
        for b in range(target.size // B):
            lo, m = b * B, np.uint32(0)
            for i in range(B):
                d[i] = target[lo + i] - base[lo + i]
            for i in range(B):
                m = max(m, bits[i] & ABS_MASK)
            tmp[0] = m
            s = absmax[0] / np.float32(127.0)
            scales[b] = s
            inv = np.float32(1.0) / s if s > 0 else np.float32(0.0)
            for j in range(B):
                v = (d[j] * inv + RINT) - RINT
                code = np.int32(min(max(v, np.float32(-127.0)), np.float32(127.0)))
                q[lo + j] = np.int8(code)
                d_j = np.float32(code) * s
                new[lo + j] = base[lo + j] + d_j if add_base else d_j

    @_jit()
    def int8_decode(scales: Any, q: Any, out: Any) -> None:
        for b in range(scales.size):
            s, lo = scales[b], b * B
            for j in range(min(B, out.size - lo)):
                out[lo + j] = np.float32(q[lo + j]) * s

    @_jit()
    def int8_accumulate(scales: Any, q: Any, c: np.float32, acc: Any) -> None:
        for b in range(scales.size):
            s, lo = scales[b] * c, b * B
            for j in range(min(B, acc.size - lo)):
                acc[lo + j] += np.float32(q[lo + j]) * s

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

    return BlockKernels(int4_encode, int4_encode_delta, int4_decode, int4_accumulate, int4_sumsq,
                        int8_encode, int8_encode_delta, int8_decode, int8_accumulate, int8_sumsq)


@_jit()
def valid_scales(scales: Any) -> bool:
    """Every block scale finite and >= 0 (NaN fails both comparisons). One call instead of the
    three numpy passes and temporaries that cost more than decoding a small tensor."""
    ok = True
    for i in range(scales.size):
        ok &= (scales[i] >= 0) & (scales[i] < np.inf)
    return ok


@_jit(fastmath=True)  # reassociation lets the fp64 sum vectorise; the order of a sum is not a contract
def sumsq(x: Any) -> float:
    """Σ x², accumulated in fp64."""
    total = 0.0
    for i in range(x.size):
        v = np.float64(x[i])
        total += v * v
    return total


@_jit()
def scale_into(x: Any, c: np.float32, out: Any) -> None:
    """out = c · x (the first contribution of a merge, written without zeroing first)."""
    for i in range(x.size):
        out[i] = x[i] * c


@_jit()
def accumulate(x: Any, c: np.float32, acc: Any) -> None:
    """acc += c · x."""
    for i in range(x.size):
        acc[i] += x[i] * c


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


def warm_codecs(codecs: Iterable[Codec], block: int = 64) -> None:
    """Compile (or load from the cache) the encode and decode kernels of `codecs`: a learner
    runs this in the background while JAX starts, so its first push and adoption after a
    (re)join are not held up by loading them (about 0.3 s cached, seconds cold)."""
    from diloco.core.codecs import decode_tensors, encode_tensors

    x = {"w": np.linspace(-1.0, 1.0, 3 * block + 5, dtype=np.float32)}
    for codec in codecs:
        decode_tensors(encode_tensors(x, codec, block))


def warm(block: int = 64) -> None:
    """Compile (or load from the cache) every kernel a syncer and a learner use, through the
    same calls they make: an image runs this at build time, so pods start with compiled code."""
    from diloco.core.codecs import CODECS, encode_tensors, parse_tensors
    from diloco.core.merge import merge_fragment, merge_updates
    from diloco.core.outer import NesterovSGD

    warm_codecs(CODECS, block)
    x = {"w": np.linspace(-1.0, 1.0, 3 * block + 5, dtype=np.float32)}
    for codec in CODECS:
        packed = parse_tensors(encode_tensors(x, codec, block))
        merged = merge_updates([packed, x], [1.0, 2.0], "rda", scales=[1.0, 0.5])
        merge_fragment([packed, packed], [1.0, 1.0], "average")
        for mu in (0.0, 0.9):
            NesterovSGD(0.7, mu).step(x, {n: u.values for n, u in merged.items()}, {n: u.factor for n, u in merged.items()})


if __name__ == "__main__":  # python -m diloco.core.kernels: compile ahead (the Dockerfiles do)
    warm()
