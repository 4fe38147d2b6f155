"""The job's checkpoint format: durable syncer checkpoints, one file each, written atomically,
verified by SHA-256. The syncer writes them; export, sample and the local report read them, so
the format and its keys live here, below all three.

Layout: magic `DDCK1\\n`, an 8-byte header length, a JSON header (metadata plus name,
dtype, shape and offset of every array), the raw little-endian arrays, and the
SHA-256 of everything before it. A file is written to a temporary name, fsynced,
renamed into place and the directory fsynced, so a crash leaves either the old set
or the new file complete. Loading walks from the newest file back and takes the
first whose checksum and structure verify, so a torn or corrupted newest checkpoint
costs one interval, never the job.

Checkpoints in object storage, committed by a manifest: diloco/checkpoint_objects.py.

Why not orbax-checkpoint: see docs/CHECKPOINTS.md (measured import and save costs;
the syncer holds numpy arrays and needs a checksum orbax does not write).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Protocol

import numpy as np

MAGIC = b"DDCK1\n"
FILE_NAME = re.compile(r"^ckpt-(\d{12})\.ddck$")
_TORN = re.compile(r"^\.ckpt-\d{12}\.ddck\.tmp-\d+$")
MAX_HEADER = 64 << 20
DTYPES = {"float32", "float64", "int64", "int32", "uint8"}


class CheckpointError(ValueError):
    """A checkpoint that fails verification; the message says how."""


@dataclass(frozen=True)
class Loaded:
    path: PurePath  # a file's path, or an object's bucket/key (`.name` is the checkpoint's either way)
    sequence: int
    arrays: dict[str, np.ndarray]
    meta: dict[str, object]


def write_into(directory: int, name: str, data: bytes,
               commit: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext) -> None:
    """Write `data` to a temporary name in the open `directory`, fsync, rename it over `name`,
    fsync the directory: after a crash `name` holds either its old contents or all of `data`.
    Every step names the directory by its descriptor, so a path swapped mid-write (a volume
    remounted or replaced) cannot split one write over two directories. The rename happens
    inside `commit()`, which may refuse it by raising (a fenced writer: `CheckpointStore.fence`)."""
    tmp = f".{name}.tmp-{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=directory)
        with open(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        with commit():
            os.replace(tmp, name, src_dir_fd=directory, dst_dir_fd=directory)
        os.fsync(directory)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=directory)
        raise


@contextlib.contextmanager
def opened(directory: Path) -> Iterator[int]:
    """The directory as a descriptor, closed on exit (ENOTDIR when the path is no directory)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield fd
    finally:
        os.close(fd)


def write_atomically(final: Path, data: bytes) -> None:
    """`write_into` the directory that holds `final`."""
    with opened(final.parent) as directory:
        write_into(directory, final.name, data)


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


# Keys of a checkpoint's arrays: Θ under PARAM, each fragment's outer momentum under MOMENTUM.
PARAM = "param/"
MOMENTUM = "momentum/"


def momentum_key(fragment: int, name: str) -> str:
    return f"{MOMENTUM}{fragment}/{name}"


def params_of(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Θ from a checkpoint's arrays, as fp32."""
    return {k.removeprefix(PARAM): np.array(v, np.float32) for k, v in arrays.items() if k.startswith(PARAM)}


def process_key(learner: str, session: int | str) -> str:
    """One learner process (its session): the key of the tokens credited to it in the metadata."""
    return f"{learner}/{session}"


def state_bytes(shapes: Mapping[str, tuple[int, ...]], momentum: bool = True) -> int:
    """Bytes of a checkpoint's arrays: each parameter and, with outer momentum, its buffer, in fp32."""
    return (2 if momentum else 1) * 4 * sum(math.prod(s) for s in shapes.values())


KEEP = 3  # newest checkpoints kept: two older ones survive a corrupt newest, and disk stays bounded


def disk_bytes(state_bytes: int, keep: int = KEEP) -> int:
    """The most a store holds: `keep` checkpoints plus the one being written."""
    return state_bytes * (keep + 1)


WRITER = "WRITER"  # who may write checkpoints here now, where a standby shares the store (`fence`)


class FencedOut(OSError):
    """Another syncer fenced this store (it took the lease over): this one writes nothing more."""


class CheckpointStore:
    """A directory of numbered checkpoints; keeps the newest `keep`."""

    def __init__(self, directory: str | Path, keep: int = KEEP):
        self.dir = Path(directory)
        self.keep = keep
        self.writer: str | None = None  # set by `fence`: then a save commits only while it is ours

    def fence(self, writer: str) -> None:
        """Make `writer` the only one whose saves commit here from now on: a save of the syncer
        that held the lease before, still in flight when it was frozen, fails at its commit."""
        with self._locked():
            write_atomically(self.dir / WRITER, writer.encode())
        self.writer = writer

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The directory's `.lock`, exclusively: what `swap` and a fenced commit hold."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / ".lock", "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            yield

    @contextlib.contextmanager
    def _ours(self) -> Iterator[None]:
        """Hold the lock and check we still write here (a no-op without a standby)."""
        if self.writer is None:
            yield
            return
        with self._locked():
            now = self.read_file(WRITER)
            if now is not None and now.decode(errors="replace") != self.writer:
                raise FencedOut(f"{self.dir}: syncer {now.decode(errors='replace')} writes these checkpoints "
                                "now (it took the lease over); this one commits nothing more")
            yield

    @property
    def location(self) -> str:
        return str(self.dir)

    def newest(self) -> int | None:
        """The newest checkpoint's sequence number (verified or not), None when there is none."""
        files = self._files()
        return files[0][0] if files else None

    def read_file(self, name: str) -> bytes | None:
        """A small file beside the checkpoints (the publish lease), None when there is none."""
        try:
            return (self.dir / name).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def write_file(self, name: str, data: bytes) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_atomically(self.dir / name, data)

    def swap(self, name: str, data: bytes, expect: str) -> str | None:
        """Replace `name` with `data` only if it still holds what `read_versioned` said (`expect`;
        "" for absent): a compare-and-swap under an exclusive lock on the directory's `.lock`,
        which every syncer sharing the directory (one host, or a filesystem with working locks)
        takes. Returns the new version token, None when refused."""
        with self._locked():
            if self.read_versioned(name)[1] != expect:
                return None
            write_atomically(self.dir / name, data)
            return hashlib.sha256(data).hexdigest()

    def read_versioned(self, name: str) -> tuple[bytes | None, str]:
        """A file's contents and a token `swap` compares ("" when absent)."""
        data = self.read_file(name)
        return data, "" if data is None else hashlib.sha256(data).hexdigest()

    def _files(self) -> list[tuple[int, Path]]:
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := FILE_NAME.match(p.name))]
        return sorted(found, reverse=True)

    def save(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, object]) -> Path:
        """Write the next checkpoint atomically; raise OSError (disk full, read-only) untouched,
        FencedOut when another syncer fenced the store since this one did.
        The directory is opened once, so a save lands whole in one directory or fails."""
        data = serialize(arrays, meta)
        self.dir.mkdir(parents=True, exist_ok=True)
        with opened(self.dir) as directory:
            names = os.listdir(directory)
            for tmp in names:  # temporary files of writers that died mid-write (one syncer writes here)
                if _TORN.match(tmp) and not tmp.endswith(f"-{os.getpid()}"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp, dir_fd=directory)
            seqs = sorted((int(m.group(1)) for n in names if (m := FILE_NAME.match(n))), reverse=True)
            name = f"ckpt-{(seqs[0] if seqs else 0) + 1:012d}.ddck"
            write_into(directory, name, data, self._ours)
            for seq in seqs[self.keep - 1 :]:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"ckpt-{seq:012d}.ddck", dir_fd=directory)
        return self.dir / name

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


class Store(Protocol):
    """What the syncer uses of a checkpoint store: a directory (`CheckpointStore`) or a prefix in
    object storage (`ObjectCheckpointStore`)."""

    keep: int

    @property
    def location(self) -> str: ...

    def save(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, object]) -> PurePath: ...

    def load_latest(self) -> tuple[Loaded | None, list[str]]: ...

    def newest(self) -> int | None: ...

    def read_file(self, name: str) -> bytes | None: ...

    def write_file(self, name: str, data: bytes) -> None: ...

    def read_versioned(self, name: str) -> tuple[bytes | None, str]: ...

    def swap(self, name: str, data: bytes, expect: str) -> str | None: ...

    def fence(self, writer: str) -> None: ...
