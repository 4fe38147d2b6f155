"""Self-describing byte payloads for outer gradients and global fragments.

A payload is a fixed header (magic, codec, element count, block size, shape) and a
body. Decoding checks every field against the body length before touching the data,
so a truncated, oversized or mismatched payload is refused with a `CodecError` that
says what is wrong, and never crashes the receiver or yields garbage.

int4 and int8 are block-wise absmax: each block of `block_size` values shares one
fp32 scale; int4 writes values in [-7, 7] (symmetric, so zero is exact) and packs two
per byte. A decoded -8 nibble is harmless (|value| <= 8/7 of the block's absmax),
so the decoder accepts the full nibble range rather than spend a pass checking it.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np

Codec = Literal["fp32", "bf16", "int8", "int4"]
CODECS: tuple[Codec, ...] = ("fp32", "bf16", "int8", "int4")
MAGIC = b"DDC1"
_HEADER = struct.Struct("<4sBBIQ")  # magic, codec id, ndim, block size, element count
MAX_NDIM = 8


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
    count = int(np.prod(shape, dtype=np.int64))
    return _HEADER.size + 8 * len(shape) + _body_bytes(codec, count, block_size)


def encode(x: np.ndarray, codec: Codec, block_size: int = 64) -> bytes:
    """Encode a float array; the result carries everything `decode` needs."""
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}; use one of {', '.join(CODECS)}")
    if codec in ("int4", "int8") and (block_size < 2 or block_size % 2):
        raise CodecError(f"block size must be an even number >= 2, got {block_size}")
    arr = np.ascontiguousarray(x, dtype=np.float32)
    if arr.ndim > MAX_NDIM:
        raise CodecError(f"at most {MAX_NDIM} dimensions, got {arr.ndim}")
    header = _HEADER.pack(MAGIC, CODECS.index(codec), arr.ndim, block_size, arr.size)
    header += struct.pack(f"<{arr.ndim}Q", *arr.shape)
    flat = arr.reshape(-1)
    if codec == "fp32":
        body = flat.tobytes()
    elif codec == "bf16":
        body = _to_bf16(flat).tobytes()
    else:
        body = _quantize(flat, block_size, 7 if codec == "int4" else 127, codec == "int4")
    return header + body


def decode(payload: bytes | memoryview, expect_shape: Sequence[int] | None = None) -> np.ndarray:
    """Decode a payload to fp32, optionally checking its shape; raise CodecError on anything off."""
    buf = memoryview(payload)
    if len(buf) < _HEADER.size:
        raise CodecError(f"payload is {len(buf)} bytes, shorter than the {_HEADER.size}-byte header")
    magic, codec_id, ndim, block, count = _HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise CodecError("payload does not start with the codec magic; not an outer-gradient payload")
    if codec_id >= len(CODECS):
        raise CodecError(f"unknown codec id {codec_id}")
    if ndim > MAX_NDIM:
        raise CodecError(f"payload claims {ndim} dimensions; at most {MAX_NDIM}")
    codec = CODECS[codec_id]
    if codec in ("int4", "int8") and (block < 2 or block % 2):
        raise CodecError(f"payload has invalid block size {block}")
    offset = _HEADER.size + 8 * ndim
    if len(buf) < offset:
        raise CodecError("payload is truncated inside its shape")
    shape = struct.unpack_from(f"<{ndim}Q", buf, _HEADER.size)
    if int(np.prod(shape, dtype=np.float64)) != count:
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
    if codec == "fp32":
        out = np.frombuffer(body, dtype=np.float32).copy()
    elif codec == "bf16":
        out = _from_bf16(np.frombuffer(body, dtype=np.uint16))
    else:
        out = _dequantize(body, count, block, codec == "int4")
    return out.reshape(shape)


def _to_bf16(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even truncation of fp32 to its upper 16 bits."""
    bits = x.view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))
    return (rounded >> 16).astype(np.uint16)


def _from_bf16(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


# int4 nibble pairs decoded by table look-up: byte b -> (low nibble - 8, high nibble - 8),
# each pair viewed as one float64 so `np.take` gathers 8 bytes at a time (10x fancy indexing).
_INT4_LUT = (((np.arange(256)[:, None] >> np.array([0, 4])) & 0x0F) - 8).astype(np.float32)
_INT4_PAIRS = np.ascontiguousarray(_INT4_LUT).view(np.float64).reshape(-1)


def _block_absmax(blocks: np.ndarray) -> np.ndarray:
    """Per-row max |x|, by halving the rows with np.maximum (faster than a short-axis reduce)."""
    a = np.abs(blocks)
    width = a.shape[1]
    while width > 1 and width % 2 == 0:
        half = width // 2
        a = np.maximum(a[:, :half], a[:, half:width])
        width = half
    return a[:, 0] if width == 1 else a.max(axis=1)


def _quantize(flat: np.ndarray, block: int, qmax: int, pack4: bool) -> bytes:
    pad = (-flat.size) % block
    blocks = np.pad(flat, (0, pad)).reshape(-1, block) if pad else flat.reshape(-1, block)
    scale = (_block_absmax(blocks) / np.float32(qmax)).astype(np.float32)
    inv = np.divide(np.float32(1.0), scale, out=np.zeros_like(scale), where=scale > 0)
    q = blocks * inv[:, None]  # in [-qmax, qmax] up to rounding; NaN input gives a NaN scale
    if pack4:
        q += np.float32(8.5)  # floor(v + 8.5) rounds to nibbles 1..15; 0 (= -8) is never written
        with np.errstate(invalid="ignore"):  # NaN input: the NaN scale already marks it bad
            u = q.astype(np.uint8).reshape(-1, 2)
        packed = u[:, 1] << 4
        packed |= u[:, 0]
        return scale.tobytes() + packed.tobytes()
    np.rint(q, out=q)
    np.clip(q, -qmax, qmax, out=q)
    return scale.tobytes() + q.astype(np.int8).tobytes()


def _dequantize(body: memoryview, count: int, block: int, pack4: bool) -> np.ndarray:
    nblocks = -(-count // block) if count else 0
    scale = np.frombuffer(body[: 4 * nblocks], dtype=np.float32)
    if not np.all(np.isfinite(scale)) or np.any(scale < 0):
        raise CodecError("payload carries a negative or non-finite block scale")
    if pack4:
        data = np.frombuffer(body[4 * nblocks :], dtype=np.uint8)
        values = np.take(_INT4_PAIRS, data).view(np.float32).reshape(nblocks, block)
    else:
        values = np.frombuffer(body[4 * nblocks :], dtype=np.int8).reshape(nblocks, block).astype(np.float32)
    values *= scale[:, None]
    return values.reshape(-1)[:count]


def encode_tensors(tensors: Mapping[str, np.ndarray], codec: Codec, block_size: int = 64) -> bytes:
    """Bundle named tensors: count, then (name length, name, payload length, payload) each."""
    parts = [struct.pack("<4sI", b"DDB1", len(tensors))]
    for name in sorted(tensors):
        raw = name.encode()
        payload = encode(tensors[name], codec, block_size)
        parts.append(struct.pack("<H", len(raw)) + raw + struct.pack("<Q", len(payload)))
        parts.append(payload)
    return b"".join(parts)


def decode_tensors(
    blob: bytes | memoryview, expect: Mapping[str, Sequence[int]] | None = None
) -> dict[str, np.ndarray]:
    """Inverse of `encode_tensors`; with `expect`, names and shapes must match it exactly."""
    buf = memoryview(blob)
    if len(buf) < 8:
        raise CodecError("bundle is shorter than its 8-byte header")
    magic, count = struct.unpack_from("<4sI", buf)
    if magic != b"DDB1":
        raise CodecError("bundle does not start with the bundle magic")
    if expect is not None and count != len(expect):
        raise CodecError(f"bundle has {count} tensors, expected {len(expect)}")
    out: dict[str, np.ndarray] = {}
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
            out[name] = decode(buf[start : start + plen], shape)
        except CodecError as exc:
            raise CodecError(f"tensor {name!r}: {exc}") from None
        pos = start + plen
    if pos != len(buf):
        raise CodecError(f"bundle has {len(buf) - pos} trailing bytes (oversized)")
    return out
