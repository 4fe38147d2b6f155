"""Durable syncer checkpoints: one file each, written atomically, verified by SHA-256.

Layout: magic `DDCK1\\n`, an 8-byte header length, a JSON header (metadata plus name,
dtype, shape and offset of every array), the raw little-endian arrays, and the
SHA-256 of everything before it. A file is written to a temporary name, fsynced,
renamed into place and the directory fsynced, so a crash leaves either the old set
or the new file complete. Loading walks from the newest file back and takes the
first whose checksum and structure verify, so a torn or corrupted newest checkpoint
costs one interval, never the job.

Why not orbax-checkpoint: see docs/CHECKPOINTS.md (measured import and save costs;
the syncer holds numpy arrays and needs a checksum orbax does not write).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"DDCK1\n"
_NAME = re.compile(r"^ckpt-(\d{12})\.ddck$")
MAX_HEADER = 64 << 20
DTYPES = {"float32", "float64", "int64", "int32", "uint8"}


class CheckpointError(ValueError):
    """A checkpoint that fails verification; the message says how."""


@dataclass(frozen=True)
class Loaded:
    path: Path
    sequence: int
    arrays: dict[str, np.ndarray]
    meta: dict[str, object]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(final: Path, data: bytes) -> None:
    """Write `data` to a temporary name, fsync, rename over `final`, fsync the directory:
    after a crash `final` holds either its old contents or all of `data`."""
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def serialize(arrays: Mapping[str, np.ndarray], meta: Mapping[str, object]) -> bytes:
    entries, blobs, offset = [], [], 0
    for name in sorted(arrays):
        arr = np.ascontiguousarray(arrays[name])
        if arr.dtype.name not in DTYPES:
            raise ValueError(f"cannot checkpoint dtype {arr.dtype} of {name!r}")
        raw = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        entries.append({"name": name, "dtype": arr.dtype.name, "shape": list(arr.shape), "offset": offset, "nbytes": len(raw)})
        blobs.append(raw)
        offset += len(raw)
    header = json.dumps({"meta": dict(meta), "arrays": entries}, sort_keys=True).encode()
    body = MAGIC + struct.pack("<Q", len(header)) + header + b"".join(blobs)
    return body + hashlib.sha256(body).digest()


def deserialize(data: bytes) -> tuple[dict[str, np.ndarray], dict[str, object]]:
    """Parse and verify; every inconsistency raises CheckpointError, nothing is trusted."""
    if len(data) < len(MAGIC) + 8 + 32 or not data.startswith(MAGIC):
        raise CheckpointError("not a checkpoint file (bad magic or too short)")
    body, digest = data[:-32], data[-32:]
    if hashlib.sha256(body).digest() != digest:
        raise CheckpointError("checksum mismatch: the file is corrupt or was torn mid-write")
    (hlen,) = struct.unpack_from("<Q", body, len(MAGIC))
    start = len(MAGIC) + 8
    if hlen > MAX_HEADER or start + hlen > len(body):
        raise CheckpointError("header length is out of range")
    try:
        header = json.loads(body[start : start + hlen])
        entries, meta = header["arrays"], header["meta"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"unreadable header: {exc}") from None
    payload = memoryview(body)[start + hlen :]
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise CheckpointError("unreadable header: arrays is not a list of entries")
    arrays: dict[str, np.ndarray] = {}
    for e in entries:
        if not isinstance(e.get("name"), str) or not isinstance(e.get("dtype"), str) or e["dtype"] not in DTYPES:
            raise CheckpointError(f"array entry {str(e.get('name'))[:80]!r} has no name or an invalid dtype")
        try:
            name, dtype, shape, off, nbytes = e["name"], np.dtype(e["dtype"]).newbyteorder("<"), tuple(e["shape"]), int(e["offset"]), int(e["nbytes"])
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise CheckpointError(f"bad array entry: {exc}") from None
        if any((not isinstance(d, int)) or d < 0 for d in shape):
            raise CheckpointError(f"array {name!r} has an invalid dtype or shape")
        # Exact integer arithmetic: numpy's int64 product would wrap or overflow on hostile shapes.
        if nbytes != math.prod(shape) * dtype.itemsize or off < 0 or off + nbytes > len(payload):
            raise CheckpointError(f"array {name!r} lies outside the file")
        arrays[name] = np.frombuffer(payload[off : off + nbytes], dtype=dtype).reshape(shape).copy()
    if not isinstance(meta, dict):
        raise CheckpointError("metadata is not a mapping")
    return arrays, meta


KEEP = 3  # newest checkpoints kept: two older ones survive a corrupt newest, and disk stays bounded


def disk_bytes(state_bytes: int, keep: int = KEEP) -> int:
    """The most a store holds: `keep` checkpoints plus the one being written."""
    return state_bytes * (keep + 1)


class CheckpointStore:
    """A directory of numbered checkpoints; keeps the newest `keep`."""

    def __init__(self, directory: str | Path, keep: int = KEEP):
        self.dir = Path(directory)
        self.keep = keep

    def _files(self) -> list[tuple[int, Path]]:
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := _NAME.match(p.name))]
        return sorted(found, reverse=True)

    def save(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, object]) -> Path:
        """Write the next checkpoint atomically; raise OSError (disk full, read-only) untouched."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._remove_torn()
        files = self._files()
        seq = files[0][0] + 1 if files else 1
        final = self.dir / f"ckpt-{seq:012d}.ddck"
        write_atomically(final, serialize(arrays, meta))
        for _, old in self._files()[self.keep :]:
            old.unlink(missing_ok=True)
        return final

    def _remove_torn(self) -> None:
        """Temporary files of writers that died mid-write (one syncer writes here at a time)."""
        for tmp in self.dir.glob(".ckpt-*.ddck.tmp-*"):
            pid = tmp.name.rsplit("-", 1)[-1]
            if not (pid.isdigit() and int(pid) == os.getpid()):
                tmp.unlink(missing_ok=True)

    def load_latest(self) -> tuple[Loaded | None, list[str]]:
        """The newest valid checkpoint (or None) and one line per corrupt file skipped."""
        skipped: list[str] = []
        for seq, path in self._files():
            try:
                arrays, meta = deserialize(path.read_bytes())
            except (CheckpointError, OSError) as exc:
                skipped.append(f"{path.name}: {exc}")
                continue
            return Loaded(path, seq, arrays, meta), skipped
        return None, skipped
