"""`diloco prepare-tokens`' output: shards of a fixed number of ids, the run's state (each finished
shard and each piece's id count, rewritten atomically as each shard completes, so an interrupted
run resumes at its first unfinished shard), and the manifest written last.

A shard is written as NAME.partial and renamed when whole (after an fsync), then recorded with its
SHA-256: a shard on disk under its own name is finished, a .partial is redone. The state names what
the run reads (inputs with sizes and stamps, tokenizer hash, shard size, held-out fraction); a
resume over anything else is refused, so shards of two different corpora are never mixed.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import numpy as np

STATE: Final = "prepare-state.json"
MANIFEST: Final = "manifest.json"
SPOOL: Final = ".prepare-spool"
DIGITS: Final = 5  # shard numbers: names sort in order up to 100,000 shards


def shard_name(split: str, k: int) -> str:
    return f"{split}-{k:0{DIGITS}d}.bin"


def write_json(path: Path, value: dict[str, Any]) -> None:
    """Atomically: a crash leaves the old file or the new one, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        raise ValueError(f"--out: {path} is not JSON prepare-tokens wrote; remove it or rerun with --restart") from None
    return value if isinstance(value, dict) else None


def difference(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """What changed between two runs' identities, in words (None: the same run)."""
    if old == new:
        return None
    before = {i["url"]: i for i in old.get("inputs", [])}
    for item in new["inputs"]:
        was = before.pop(item["url"], None)
        if was is None:
            return f"{item['url']} is new"
        if was["size"] != item["size"]:
            return f"{item['url']} was {was['size']} bytes, now {item['size']}"
        if was["stamp"] != item["stamp"]:
            return f"{item['url']} was modified ({was['stamp']} -> {item['stamp']})"
    if before:
        return f"{next(iter(before))} is gone"
    for key in sorted(new):
        if key != "inputs" and old.get(key) != new[key]:
            return f"{key} was {old.get(key)!r}, now {new[key]!r}"
    return "the run's settings changed"


def remove_outputs(out: Path) -> None:
    """--restart: this command's files in OUT, and nothing else."""
    for pattern in ("train-*.bin", "val-*.bin", "train-*.bin.partial", "val-*.bin.partial", STATE, MANIFEST,
                    STATE + ".tmp", MANIFEST + ".tmp"):
        for p in out.glob(pattern):
            p.unlink()
    clear_spool(out)


def clear_spool(out: Path) -> None:
    spool = out / SPOOL
    if spool.is_dir():
        for p in spool.iterdir():
            p.unlink()
        spool.rmdir()


class State:
    """The run's record in OUT/prepare-state.json: per split, its finished shards, the id count of
    each piece read so far (where a resume starts), and whether it is complete."""

    def __init__(self, out: Path, identity: dict[str, Any], stored: dict[str, Any] | None) -> None:
        self.path, self.identity = out / STATE, identity
        self.splits: dict[str, dict[str, Any]] = (stored or {}).get("splits") or {
            s: {"shards": [], "counts": [], "complete": False} for s in ("train", "val")}
        self.skipped: int = (stored or {}).get("skipped", 0)  # records skipped as not UTF-8, in every attempt

    def save(self) -> None:
        write_json(self.path, {"identity": self.identity, "splits": self.splits, "skipped": self.skipped})

    def resume_point(self, split: str, shard_size: int, out: Path) -> tuple[int, int, int]:
        """(finished shards, first piece to read, ids of it to skip). Shards recorded but missing
        or of the wrong size on disk are dropped from the record, with every one after them."""
        s = self.splits[split]
        itemsize = np.dtype(self.identity["dtype"]).itemsize
        good = 0
        for shard in s["shards"]:
            p = out / shard["name"]
            if not p.is_file() or p.stat().st_size != shard["tokens"] * itemsize:
                break
            good += 1
        if good < len(s["shards"]):
            s["shards"], s["complete"] = s["shards"][:good], False
        if s["complete"]:
            return good, len(s["counts"]), 0
        position, seen = good * shard_size, 0
        for i, n in enumerate(s["counts"]):
            if seen + n > position:
                s["counts"] = s["counts"][: i + 1]
                return good, i, position - seen
            seen += n
        if seen != position:  # the counts do not reach the shards' end: start the split over
            s["shards"], s["counts"] = [], []
            return 0, 0, 0
        return good, len(s["counts"]), 0


class Shards:
    """Writes one split's ids into shards of `size` ids, recording each as it completes."""

    def __init__(self, out: Path, split: str, size: int, dtype: str, first: int,
                 finished: Callable[[dict[str, Any]], None]) -> None:
        self.out, self.split, self.size, self.dtype, self.index = out, split, size, np.dtype(dtype), first
        self.finished = finished
        self._f: Any = None
        self._n = 0
        self._hash = hashlib.sha256()

    def write(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype, copy=False)
        while len(ids):
            if self._f is None:
                self._f = open(self._partial(), "wb")  # noqa: SIM115 (open across calls, closed by _close)
            take = min(len(ids), self.size - self._n)
            part = np.ascontiguousarray(ids[:take])
            self._f.write(part.data)
            self._hash.update(part.data)
            self._n += take
            ids = ids[take:]
            if self._n == self.size:
                self._close()

    def finish(self) -> None:
        """The split's last shard, however short."""
        if self._n:
            self._close()

    def abandon(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def _partial(self) -> Path:
        return self.out / (shard_name(self.split, self.index) + ".partial")

    def _close(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        name = shard_name(self.split, self.index)
        os.replace(self._partial(), self.out / name)
        self.finished({"name": name, "tokens": self._n, "sha256": self._hash.hexdigest()})
        self._f, self._n, self._hash, self.index = None, 0, hashlib.sha256(), self.index + 1
