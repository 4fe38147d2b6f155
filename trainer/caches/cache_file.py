"""Files a learner keeps beside JAX's compilation cache (Θ₀, trainer/caches/theta0.py; the lowered
train step, trainer/caches/step_cache.py): named arrays in one `.npz`, with a SHA-256 of their bytes,
written atomically. A torn, altered or foreign file reads as missing, so the caller recomputes
what it holds; a cache that cannot be written is logged, never fatal."""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("diloco.learner")
DIGEST = "__sha256__"


def digest(arrays: dict[str, np.ndarray]) -> bytes:
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.data)
    return h.digest()


def read(path: Path, what: str) -> dict[str, np.ndarray] | None:
    """The arrays at `path`, or None when there are none or they fail their checksum."""
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {n: f[n] for n in f.files}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:  # torn or foreign: recompute
        log.warning("ignoring the cached %s at %s (%s); computing it", what, path, exc)
        return None
    stored = arrays.pop(DIGEST, None)
    if stored is None or stored.tobytes() != digest(arrays):
        log.warning("ignoring the cached %s at %s: its checksum does not match; computing it", what, path)
        return None
    return arrays


def write(path: Path, arrays: dict[str, np.ndarray], what: str) -> None:
    """Atomically, and never fatally: a learner that cannot write the cache still trains.
    Standard dtypes only (np.load without pickles reads nothing else)."""
    if any(v.dtype.kind not in "fiub" or v.dtype.itemsize not in (1, 2, 4, 8) for v in arrays.values()):
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".npz")
        try:
            with os.fdopen(fd, "wb") as f:
                entries: dict[str, Any] = {**arrays, DIGEST: np.frombuffer(digest(arrays), np.uint8)}
                np.savez(f, **entries)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        log.warning("could not cache the %s at %s (%s); restarts will compute it", what, path, exc)


def source_digest(*modules: Any) -> str:
    """Of the modules' source files: edited code names another cache file."""
    h = hashlib.sha256()
    for module in modules:
        h.update(Path(str(module.__file__)).read_bytes())
    return h.hexdigest()
