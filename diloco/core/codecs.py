"""Self-describing byte payloads for outer gradients and global fragments.

A payload is a fixed header (magic, codec, element count, block size, shape) and a
body. Decoding checks every field against the body length before touching the data,
so a truncated, oversized or mismatched payload is refused with a `CodecError` that
says what is wrong, and never crashes the receiver or yields garbage.

int4 and int8 are block-wise absmax: each block of `block_size` values shares one
fp32 scale; int4 writes values in [-7, 7] (symmetric, so zero is exact) and packs two
per byte, value j of a block with value j + block/2. A decoded -8 nibble is harmless
(|value| <= 8/7 of the block's absmax), so the decoder accepts the full nibble range
rather than spend a pass checking it. nf4 has int4's bytes with levels that follow a
normal distribution instead of a line (`diloco/core/nf4.py`), which is what the syncer's
broadcast wants. The loops are compiled (`diloco/core/kernels.py`, `nf4.py`).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from diloco.core.blockwise import BLOCKWISE, loops
from diloco.core.blockwise import for_codec as _blockwise
from diloco.core.choices import CODECS, Codec

MAGIC = b"DDC2"  # 2: int4 pairs value j with j + block/2 (was 2j with 2j+1), see loops
_HEADER = struct.Struct("<4sBBIQ")  # magic, codec id, ndim, block size, element count
MAX_NDIM = 8
BUNDLE_MAGIC = b"DDB1"


class CodecError(ValueError):
    """A payload that cannot be decoded; the message names the problem."""


def _body_bytes(codec: Codec, count: int, block: int) -> int:
    if codec == "fp32":
        return 4 * count
    if codec == "bf16":
        return 2 * count
    blocks = -(-count // block) if count else 0  # block >= 2 is checked for int codecs
    if codec == "int8":
        return 4 * blocks + blocks * block
    return 4 * blocks + blocks * block // 2


def encoded_size(shape: Sequence[int], codec: Codec, block_size: int = 64) -> int:
    count = math.prod(int(d) for d in shape)  # exact; np.prod costs 5 µs a call, on every push
    return _HEADER.size + 8 * len(shape) + _body_bytes(codec, count, block_size)


def bundle_size(shapes: Mapping[str, Sequence[int]], codec: Codec, block_size: int = 64) -> int:
    """The bytes of `encode_tensors` of tensors of these shapes (see `_bundle`'s layout)."""
    return 8 + sum(2 + len(n.encode()) + 8 + encoded_size(s, codec, block_size) for n, s in shapes.items())


Blob = memoryview  # an encoded payload or bundle: read-only bytes, written once in place (see `_sealed`)


def _sealed(out: np.ndarray) -> Blob:
    """The buffer an encoder wrote, read-only, without copying it into `bytes` (a copy of every
    byte: 15 µs of a 4 MiB int4 encode's 120). Where a protobuf field needs `bytes`, the caller
    copies; the syncer's publishes are framed by hand (`wire.framed`) and never do."""
    return out.data.toreadonly()


def encode(x: np.ndarray, codec: Codec, block_size: int = 64) -> Blob:
    """Encode a float array; the result carries everything `decode` needs."""
    arr = _checked_input(x, codec, block_size)
    out = np.empty(encoded_size(arr.shape, codec, block_size), np.uint8)  # every byte is written: no zero-fill
    _encode_into(arr, codec, block_size, out.data)
    return _sealed(out)


def _checked_input(x: np.ndarray, codec: Codec, block_size: int) -> np.ndarray:
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}; use one of {', '.join(CODECS)}")
    if codec in BLOCKWISE and (block_size < 2 or block_size % 2):
        raise CodecError(f"block size must be an even number >= 2, got {block_size}")
    arr = np.ascontiguousarray(x, dtype=np.float32)
    if arr.ndim > MAX_NDIM:
        raise CodecError(f"at most {MAX_NDIM} dimensions, got {arr.ndim}")
    return arr


def _payload_header(shape: tuple[int, ...], codec: Codec, block: int) -> bytes:
    """A payload's header: magic, codec, rank, block size, element count, then the shape."""
    return _HEADER.pack(MAGIC, CODECS.index(codec), len(shape), block, math.prod(shape)) + struct.pack(
        f"<{len(shape)}Q", *shape)


def _write_header(out: memoryview, shape: tuple[int, ...], codec: Codec, block: int) -> memoryview:
    """Write a payload's header at the start of `out`; returns the body's part of `out`."""
    head = _payload_header(shape, codec, block)
    out[: len(head)] = head
    return out[len(head) :]


def _entry_header(name: str, size: int) -> bytes:
    """A bundle entry's header: the name's length and bytes, then the payload's length."""
    raw = name.encode()
    return struct.pack(f"<H{len(raw)}sQ", len(raw), raw, size)


def _encode_into(arr: np.ndarray, codec: Codec, block: int, out: memoryview) -> None:
    """Write header and body into `out` (exactly `encoded_size` bytes): no temporaries but bf16's."""
    body, flat = _write_header(out, arr.shape, codec, block), arr.reshape(-1)
    if codec == "fp32":
        np.frombuffer(body, np.float32)[:] = flat
    elif codec == "bf16":
        np.frombuffer(body, np.uint16)[:] = _to_bf16(flat)
    else:
        nblocks, full = -(-flat.size // block), flat.size // block
        k = _blockwise(codec, block)
        scales = np.frombuffer(body[: 4 * nblocks], np.float32)
        codes = np.frombuffer(body[4 * nblocks :], k.dtype)
        encode_blocks, per_block = k.encode, k.per_block
        encode_blocks(flat[: full * block], scales[:full], codes[: full * per_block])
        if full < nblocks:  # the last, partial block, zero-padded (zero encodes exactly)
            padded = np.zeros(block, np.float32)
            padded[: flat.size - full * block] = flat[full * block :]
            encode_blocks(padded, scales[full:], codes[full * per_block :])


@dataclass(frozen=True)
class Packed:
    """One validated payload, still encoded: the syncer checks, measures and merges
    contributions in this form (decoding straight into the merge accumulator), holding a
    fraction of their fp32 bytes. `values` are the body's fp32 values, bf16 bits, or int codes."""

    codec: Codec
    shape: tuple[int, ...]
    block: int
    scales: np.ndarray  # per block (int codecs; empty otherwise)
    values: np.ndarray

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def decode(self, out: np.ndarray | None = None) -> np.ndarray:
        """The fp32 values, into `out` (a C-contiguous fp32 array of the shape) if given."""
        if out is None:
            out = np.empty(self.shape, np.float32)
        elif out.shape != self.shape or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"decode needs a C-contiguous float32 {self.shape} buffer")
        flat = out.reshape(-1)
        if self.codec == "fp32":
            flat[:] = self.values
        elif self.codec == "bf16":
            flat.view(np.uint32)[:] = self.values.astype(np.uint32) << 16
        else:
            _blockwise(self.codec, self.block).decode(self.scales, self.values, flat)
        return out

    def accumulate(self, c: float | np.floating, acc: np.ndarray, start: int = 0) -> None:
        """acc += c · values[start : start + acc.size], acc a flat fp32 array (`start` a multiple
        of the block size): no fp32 copy of the payload is made."""
        weighted_sum_into([self], np.array([c], np.float32), acc, start)

    def sumsq(self) -> float:
        """‖values‖², in fp64 (from the codes alone for int codecs: a pass over a few bytes).
        Remembered: admission measures a push's norm, and the merge needs it again."""
        known = self.__dict__.get("_sumsq")
        if known is None:
            if self.codec in BLOCKWISE:
                known = float(_blockwise(self.codec, self.block).sumsq(self.scales, self.values))
            else:
                known = float(loops.sumsq(self.values if self.codec == "fp32" else self.decode().reshape(-1)))
            self.__dict__["_sumsq"] = known  # a frozen dataclass: the cache bypasses __setattr__
        return known


def weighted_sum_into(sources: Sequence[Packed], coeffs: np.ndarray, acc: np.ndarray, start: int = 0,
                      init: bool = False) -> None:
    """acc ← [acc +] Σ coeffs[k] · sources[k].values[start : start + acc.size]: one to four payloads
    of one codec and block size (`start` a multiple of it), added in order in one pass over acc
    (bit for bit one pass per payload), each decoded straight into it."""
    first, end, c = sources[0], start + acc.size, coeffs.astype(np.float32, copy=False)
    if len(sources) > 4 or len(c) != len(sources) or any((p.codec, p.block) != (first.codec, first.block) for p in sources):
        raise ValueError("weighted_sum_into takes one to four payloads of one codec and block size, and a factor each")
    if first.codec in BLOCKWISE:
        b, k = first.block, _blockwise(first.codec, first.block)
        per = k.per_block
        spans = [a for p in sources for a in (p.scales[start // b : -(-end // b)], p.values[start // b * per : -(-end // b) * per])]
        k.weighted_sum(*spans, *spans[:2] * (4 - len(sources)), c, acc, init)
        return
    values = [p.values[start:end] if p.codec == "fp32" else (p.values[start:end].astype(np.uint32) << 16).view(np.float32)
              for p in sources]
    loops.weighted_sum(*values, *values[:1] * (4 - len(values)), c, acc, init)


def parse(payload: bytes | memoryview, expect_shape: Sequence[int] | None = None) -> Packed:
    """Validate a payload without decoding it; raise CodecError on anything off. The result
    views `payload`, which must outlive it (and not change)."""
    buf = memoryview(payload)
    if len(buf) < _HEADER.size:
        raise CodecError(f"payload is {len(buf)} bytes, shorter than the {_HEADER.size}-byte header")
    magic, codec_id, ndim, block, count = _HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise CodecError("payload does not start with the codec magic; not an outer-gradient payload "
                         "(or one from a release with another int4 layout)")
    if codec_id >= len(CODECS):
        raise CodecError(f"unknown codec id {codec_id}")
    if ndim > MAX_NDIM:
        raise CodecError(f"payload claims {ndim} dimensions; at most {MAX_NDIM}")
    codec = CODECS[codec_id]
    if codec in BLOCKWISE and (block < 2 or block % 2):
        raise CodecError(f"payload has invalid block size {block}")
    offset = _HEADER.size + 8 * ndim
    if len(buf) < offset:
        raise CodecError("payload is truncated inside its shape")
    shape = struct.unpack_from(f"<{ndim}Q", buf, _HEADER.size)
    if math.prod(shape) != count:  # exact: Python integers do not overflow
        raise CodecError(f"payload shape {shape} does not hold its {count} elements")
    if math.prod(d for d in shape if d) >= 1 << 60:  # an empty array cannot have such dimensions either
        raise CodecError(f"payload shape {shape} is impossibly large")
    if expect_shape is not None and tuple(shape) != tuple(expect_shape):
        raise CodecError(f"shape {tuple(shape)} does not match the expected {tuple(expect_shape)}")
    want = _body_bytes(codec, count, block)
    if len(buf) - offset != want:
        raise CodecError(
            f"{codec} payload body is {len(buf) - offset} bytes, expected {want} "
            f"for {count} values (truncated or oversized)"
        )
    body = buf[offset:]
    nblocks = -(-count // block) if count and codec in BLOCKWISE else 0
    scales = np.frombuffer(body[: 4 * nblocks], dtype=np.float32)
    if nblocks and not loops.valid_scales(scales):  # fp32 and bf16 carry none
        raise CodecError("payload carries a negative or non-finite block scale")
    dtype = {"fp32": np.float32, "bf16": np.uint16, "int8": np.int8, "int4": np.uint8, "nf4": np.uint8}[codec]
    return Packed(codec, tuple(shape), block, scales, np.frombuffer(body[4 * nblocks :], dtype=dtype))


def decode(payload: bytes | memoryview, expect_shape: Sequence[int] | None = None,
           out: np.ndarray | None = None) -> np.ndarray:
    """Decode a payload to fp32 (into `out` if given), optionally checking its shape; raise
    CodecError on anything off."""
    return parse(payload, expect_shape).decode(out)


def _to_bf16(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even truncation of fp32 to its upper 16 bits."""
    bits = x.view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))
    return (rounded >> 16).astype(np.uint16)


def _bundle(shapes: Mapping[str, tuple[int, ...]], codec: Codec, block: int,
            write: Callable[[str, memoryview], None]) -> Blob:
    """One buffer: count, then (name length, name, payload length, payload) per tensor in name
    order, each payload written in place by `write`."""
    sizes = {name: encoded_size(shapes[name], codec, block) for name in sorted(shapes)}
    out = np.empty(bundle_size(shapes, codec, block), np.uint8)
    view = out.data
    struct.pack_into("<4sI", view, 0, BUNDLE_MAGIC, len(sizes))
    pos = 8
    for name, size in sizes.items():
        head = _entry_header(name, size)
        view[pos : pos + len(head)] = head
        pos += len(head)
        write(name, view[pos : pos + size])
        pos += size
    return _sealed(out)


def encode_tensors(tensors: Mapping[str, np.ndarray], codec: Codec, block_size: int = 64) -> Blob:
    """Bundle named tensors (see `_bundle`), each encoded in place."""
    arrays = {name: _checked_input(t, codec, block_size) for name, t in tensors.items()}
    return _bundle({n: a.shape for n, a in arrays.items()}, codec, block_size,
                   lambda name, out: _encode_into(arrays[name], codec, block_size, out))


@dataclass(frozen=True)
class Pieces:
    """A bundle as the pieces it is made of, in order: what `encode_tensors` would write, without
    writing it. fp32 bodies are the arrays' own bytes, so sending a 1e9-parameter model to a
    joining learner takes 1 MiB chunks of it instead of a 4 GB copy (which first-touched 4 GB of
    fresh memory per Join: most of a Join's cost on the syncer, and one such buffer per learner
    re-joining at once)."""

    parts: tuple[memoryview, ...]

    @property
    def size(self) -> int:
        return sum(len(p) for p in self.parts)

    def spans(self, size: int) -> Iterator[list[memoryview]]:
        """The bundle's bytes in chunks of `size` (the last may be shorter; one empty chunk for an
        empty bundle), each as the views of the pieces it is made of: nothing is copied, so the
        caller copies each byte once, framing included (diloco.wire.framed)."""
        pending: list[memoryview] = []
        room = size
        for part in self.parts:
            while len(part):
                take = part[:room]
                pending.append(take)
                part, room = part[len(take):], room - len(take)
                if room == 0:
                    yield pending
                    pending, room = [], size
        if pending or self.size == 0:
            yield pending


def fp32_pieces(tensors: Mapping[str, np.ndarray]) -> Pieces:
    """`encode_tensors(tensors, "fp32")` as `Pieces`: the headers written, the bodies referenced.
    The arrays must not change while the pieces are read (the publisher's views never do)."""
    arrays = {name: _checked_input(tensors[name], "fp32", 64) for name in sorted(tensors)}
    parts = [memoryview(struct.pack("<4sI", BUNDLE_MAGIC, len(arrays)))]
    for name, arr in arrays.items():
        head = _entry_header(name, encoded_size(arr.shape, "fp32")) + _payload_header(arr.shape, "fp32", 64)
        parts += [memoryview(head), arr.reshape(-1).data.cast("B")]
    return Pieces(tuple(parts))


def encode_delta_tensors(target: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray], codec: Codec,
                         block_size: int = 64) -> tuple[Blob, dict[str, np.ndarray]]:
    """`encode_tensors({n: target[n] − base[n]})` and base + its decoded values, which is exactly
    what a receiver holding `base` computes from the bytes. For int codecs one fused pass per
    tensor: no difference, decoded or sum is materialised on the way (the broadcast's hot loop)."""
    return _encode_difference(target, base, codec, block_size, add_base=True)


def encode_difference(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray], codec: Codec,
                      block_size: int = 64) -> tuple[Blob, dict[str, np.ndarray]]:
    """`encode_tensors({n: a[n] − b[n]})` and its values as a receiver decodes them, in one
    fused pass per tensor for int codecs: a learner's push (Δ = A − θ) and the record it keeps
    of it for error feedback, without materialising Δ or parsing the bytes back."""
    return _encode_difference(a, b, codec, block_size, add_base=False)


def _encode_difference(target: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray], codec: Codec,
                       block_size: int, add_base: bool) -> tuple[Blob, dict[str, np.ndarray]]:
    if codec not in BLOCKWISE:
        blob = encode_tensors({n: target[n] - base[n] for n in target}, codec, block_size)
        decoded = decode_tensors(blob)
        return blob, ({n: base[n] + decoded[n] for n in target} if add_base else decoded)
    pairs = {n: (_checked_input(target[n], codec, block_size), _checked_input(base[n], codec, block_size)) for n in target}
    new = {n: np.empty_like(t) for n, (t, _) in pairs.items()}
    k = _blockwise(codec, block_size)
    fused, per_block = k.encode_delta, k.per_block

    def write(name: str, out: memoryview) -> None:
        t, b = (a.reshape(-1) for a in pairs[name])
        if t.shape != b.shape:
            raise CodecError(f"tensor {name!r}: target and base shapes differ")
        n = new[name].reshape(-1)
        body = _write_header(out, pairs[name][0].shape, codec, block_size)
        nblocks, full = -(-t.size // block_size), t.size // block_size
        scales = np.frombuffer(body[: 4 * nblocks], np.float32)
        codes = np.frombuffer(body[4 * nblocks :], k.dtype)
        cut = full * block_size
        fused(t[:cut], b[:cut], scales[:full], codes[: full * per_block], n[:cut], add_base)
        if full < nblocks:  # the last, partial block, zero-padded like `encode`
            padded = np.zeros((3, block_size), np.float32)
            padded[0, : t.size - cut], padded[1, : t.size - cut] = t[cut:], b[cut:]
            fused(padded[0], padded[1], scales[full:], codes[full * per_block :], padded[2], add_base)
            n[cut:] = padded[2, : t.size - cut]

    return _bundle({n: t.shape for n, (t, _) in pairs.items()}, codec, block_size, write), new


def parse_tensors(blob: bytes | memoryview, expect: Mapping[str, Sequence[int]] | None = None) -> dict[str, Packed]:
    """Validate a bundle (see `encode_tensors`) without decoding it; with `expect`, names and
    shapes must match it exactly."""
    buf = memoryview(blob)
    if len(buf) < 8:
        raise CodecError("bundle is shorter than its 8-byte header")
    magic, count = struct.unpack_from("<4sI", buf)
    if magic != BUNDLE_MAGIC:
        raise CodecError("bundle does not start with the bundle magic")
    if expect is not None and count != len(expect):
        raise CodecError(f"bundle has {count} tensors, expected {len(expect)}")
    out: dict[str, Packed] = {}
    pos = 8
    for _ in range(count):
        if pos + 2 > len(buf):
            raise CodecError("bundle is truncated")
        (nlen,) = struct.unpack_from("<H", buf, pos)
        if pos + 2 + nlen + 8 > len(buf):
            raise CodecError("bundle is truncated inside a tensor name")
        name = bytes(buf[pos + 2 : pos + 2 + nlen]).decode("utf-8", errors="replace")
        (plen,) = struct.unpack_from("<Q", buf, pos + 2 + nlen)
        start = pos + 2 + nlen + 8
        if start + plen > len(buf):
            raise CodecError(f"bundle is truncated inside tensor {name!r}")
        if name in out:
            raise CodecError(f"tensor {name!r} appears twice in the bundle")
        if expect is not None and name not in expect:
            raise CodecError(f"unknown tensor {name!r} for this fragment")
        shape = None if expect is None else expect[name]
        try:
            out[name] = parse(buf[start : start + plen], shape)
        except CodecError as exc:
            raise CodecError(f"tensor {name!r}: {exc}") from None
        pos = start + plen
    if pos != len(buf):
        raise CodecError(f"bundle has {len(buf) - pos} trailing bytes (oversized)")
    return out


def decode_tensors(
    blob: bytes | memoryview, expect: Mapping[str, Sequence[int]] | None = None
) -> dict[str, np.ndarray]:
    """Inverse of `encode_tensors`; with `expect`, names and shapes must match it exactly."""
    return {name: packed.decode() for name, packed in parse_tensors(blob, expect).items()}
