"""Checkpoints in object storage (`open_store` with an fsspec URL: s3://, gs://, any).

`ObjectCheckpointStore` writes the checkpoint files of diloco/checkpoint.py as objects, each in
one PUT (a finished object appears whole or not at all), then `MANIFEST.json` last, naming the
committed checkpoints with their sizes and SHA-256; readers take what the manifest names, newest
first, and verify each as on a volume. A torn object, or one no manifest names (a writer that
died before committing it), is never loaded. The standby's leader lease (syncer/durable/leader.py)
lives beside them, replaced by compare-and-swap (`swap`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

import numpy as np

from diloco.checkpoint import (
    FILE_NAME,
    KEEP,
    CheckpointError,
    CheckpointStore,
    FencedOut,
    Loaded,
    Store,
    deserialize,
    serialize,
)

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = 1


def is_url(location: str | Path) -> bool:
    """An fsspec URL (s3://, gs://, memory://, ...); a plain path or file:// is a directory."""
    text = str(location)
    return "://" in text and not text.startswith("file://")


def open_store(location: str | Path, keep: int = KEEP) -> Store:
    """The store at `location`: a directory, or objects under an fsspec URL."""
    if is_url(location):
        return ObjectCheckpointStore(str(location), keep)
    return CheckpointStore(str(location).removeprefix("file://"), keep)


def shard_location(location: str, shard: int, shards: int) -> str:
    """Where a shard of a sharded syncer keeps its checkpoints in a store shared by the shards
    (`<url>/shard-<i>`, the layout `diloco run` and export use); unsharded, the location itself."""
    return location if shards == 1 else f"{location.rstrip('/')}/shard-{shard}"


class StoreUnavailable(RuntimeError):
    """The URL's filesystem is not installed (gcsfs, s3fs: the `cloud` extra) or the URL is malformed."""


def _filesystem(url: str) -> tuple[Any, str]:
    import fsspec

    try:
        # No listings cache: a standby lists the prefix once, then reads objects another process
        # writes; s3fs answers a read of a key missing from a cached listing "not found" without
        # asking, so every checkpoint written since looked torn and none was ever restored.
        fs, root = fsspec.core.url_to_fs(url, use_listings_cache=False)
    except ImportError as exc:
        raise StoreUnavailable(f"checkpoints at {url}: {exc} (pip install 'decoupled-diloco[cloud]' for "
                               "s3:// and gs://)") from None
    except ValueError as exc:
        raise StoreUnavailable(f"checkpoints at {url}: {exc}") from None
    return fs, str(root).rstrip("/")


class ObjectFiles:
    """Small objects under an fsspec URL, a compare-and-swap over them (`swap`) and a create that
    never overwrites (`_create`): what the checkpoints' manifest and the leader lease stand on."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs, self.root = _filesystem(self.url)

    @property
    def location(self) -> str:
        return self.url

    def _key(self, name: str) -> str:
        return f"{self.root}/{name}"

    def read_file(self, name: str) -> bytes | None:
        try:
            return bytes(self.fs.cat_file(self._key(name)))
        except FileNotFoundError:
            return None

    def write_file(self, name: str, data: bytes) -> None:
        self.fs.pipe_file(self._key(name), data)

    def _s3(self) -> bool:
        return "s3" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))

    def read_versioned(self, name: str) -> tuple[bytes | None, str]:
        """An object's contents and the version token `swap` compares, read in one request (S3:
        its ETag); "" when absent. Stores without conditional writes: the content's SHA-256."""
        if not self._s3():
            data = self.read_file(name)
            return data, "" if data is None else hashlib.sha256(data).hexdigest()
        from fsspec.asyn import sync

        bucket, key, _ = self.fs.split_path(self._key(name))

        async def get() -> tuple[bytes | None, str]:
            try:
                out = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
            except FileNotFoundError:
                return None, ""
            body = out["Body"]
            try:
                return bytes(await body.read()), str(out["ETag"])
            finally:
                body.close()

        result: tuple[bytes | None, str] = sync(self.fs.loop, get)
        return result

    def swap(self, name: str, data: bytes, expect: str) -> str | None:
        """Replace `name` only if it is still at version `expect` ("" for absent); the new
        version token, or None when refused. S3: a conditional PUT (If-Match, If-None-Match),
        atomic in the store itself. Elsewhere a read-compare-write, which is not atomic: a
        standby needs s3:// or a shared directory (`conditional`)."""
        if not self._s3():
            if self.read_versioned(name)[1] != expect:
                return None
            self.write_file(name, data)
            return hashlib.sha256(data).hexdigest()
        try:
            if expect:
                out = self.fs.pipe_file(self._key(name), data, IfMatch=expect)
            else:
                out = self.fs.pipe_file(self._key(name), data, mode="create")
        except (OSError, ValueError) as exc:
            if _precondition_failed(exc):
                return None
            raise
        etag = out.get("ETag") if isinstance(out, dict) else None
        return str(etag) if etag else self.read_versioned(name)[1]

    @property
    def conditional(self) -> bool:
        """Whether `swap` is atomic in the store (a lease needs it)."""
        return self._s3()

    def _create(self, name: str, data: bytes) -> None:
        """Write a new object, never over an existing one (S3: If-None-Match), so an object is
        only ever its one writer's and a writer that fails may delete what it wrote."""
        if self._s3():
            try:
                self.fs.pipe_file(self._key(name), data, mode="create")
                return
            except (OSError, ValueError) as exc:
                if not _precondition_failed(exc):
                    raise
        elif not self.fs.exists(self._key(name)):
            self.fs.pipe_file(self._key(name), data)
            return
        raise FileExistsError(f"{self.url}/{name} exists already: another syncer writes this store")


class ObjectCheckpointStore(ObjectFiles):
    """Checkpoints as objects under an fsspec URL, committed by a manifest written last.

    Each checkpoint is one object written in one request (S3 and GCS make a finished upload
    visible whole or not at all); then `MANIFEST.json` is replaced, naming the newest `keep`
    with their sizes and SHA-256, and only then are older objects deleted. The manifest is
    replaced with a compare-and-swap where the store has one (S3's If-Match), so a writer that
    lost the store to another (a fenced syncer) fails instead of overwriting its successor's."""

    def __init__(self, url: str, keep: int = KEEP):
        super().__init__(url)
        self.keep = keep
        self.writer: str | None = None  # set by `fence`: then a save commits only while it is ours

    def _listed(self) -> list[int]:
        try:
            names = self.fs.ls(self.root, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted((int(m.group(1)) for n in names if (m := FILE_NAME.match(str(n).rsplit("/", 1)[-1]))), reverse=True)

    def _manifest(self) -> tuple[list[dict[str, Any]] | None, str, str | None, str | None]:
        """(the committed checkpoints, newest first; the manifest's version token; what is wrong
        with it; the syncer that fenced it). None when there is no manifest, or one that does
        not parse."""
        raw, token = self.read_versioned(MANIFEST)
        if raw is None:
            return None, token, None, None
        try:
            doc = json.loads(raw)
            entries, writer = doc["checkpoints"], doc.get("writer")
            if doc.get("format") != MANIFEST_FORMAT or not isinstance(entries, list) or not all(
                    isinstance(e, dict) and isinstance(e.get("name"), str) and FILE_NAME.match(e["name"])
                    and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str) for e in entries) or not (
                    writer is None or isinstance(writer, str)):
                raise ValueError("unexpected fields")
        except (ValueError, KeyError, TypeError) as exc:
            return None, token, f"{MANIFEST}: unreadable ({exc}); falling back to listing the checkpoints", None
        return entries, token, None, writer

    def _commit(self, entries: list[dict[str, Any]], writer: str | None, expect: str) -> str | None:
        """Swap in a manifest naming `entries` (and the syncer that writes here); None if refused."""
        doc = {"format": MANIFEST_FORMAT, "checkpoints": entries, **({"writer": writer} if writer else {})}
        return self.swap(MANIFEST, json.dumps(doc, sort_keys=True).encode(), expect)

    def fence(self, writer: str) -> None:
        """Make `writer` the only one whose saves commit here from now on. The manifest is
        rewritten naming it: a save of the syncer that held the lease before, still in flight
        when it was frozen, read the manifest before this and loses its compare-and-swap; one
        that reads it after sees another writer and stops."""
        while True:
            entries, token, _, _ = self._manifest()
            if self._commit(self._verified_listing() if entries is None else entries, writer, token) is not None:
                self.writer = writer
                return

    def _verified_listing(self) -> list[dict[str, Any]]:
        """Without a readable manifest: the listed objects that verify, as manifest entries (what
        `load_latest` would fall back to), so a fence written over no manifest loses none."""
        entries = []
        for seq in self._listed()[: self.keep]:
            name = f"ckpt-{seq:012d}.ddck"
            try:
                data = bytes(self.fs.cat_file(self._key(name)))
                deserialize(data)
            except (CheckpointError, OSError):
                continue
            entries.append({"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
        return entries

    def newest(self) -> int | None:
        entries, _, _, _ = self._manifest()
        if entries is None:
            listed = self._listed()
            return listed[0] if listed else None
        return int(FILE_NAME.match(entries[0]["name"]).group(1)) if entries else None  # type: ignore[union-attr]

    def save(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, object]) -> PurePath:
        """Write the next checkpoint object, then the manifest naming it (the commit), then prune.
        Raises OSError when the store refuses (or the manifest moved under us: another writer),
        FencedOut when another syncer fenced the store since this one did."""
        data = serialize(arrays, meta)
        entries, token, _, writer = self._manifest()
        if self.writer is not None and writer not in (None, self.writer):
            raise FencedOut(f"{self.url}: syncer {writer} writes these checkpoints now (it took the lease "
                            "over); this one commits nothing more")
        seqs = self._listed()
        committed = [int(FILE_NAME.match(e["name"]).group(1)) for e in entries or []]  # type: ignore[union-attr]
        seq = max([0, *seqs, *committed]) + 1
        name = f"ckpt-{seq:012d}.ddck"
        self._create(name, data)
        entry = {"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        kept = [entry, *(entries or [])][: self.keep]
        if self._commit(kept, self.writer or writer, token) is None:
            with contextlib.suppress(OSError):
                self.fs.rm_file(self._key(name))
            raise FencedOut(f"{self.url}/{MANIFEST} changed while this syncer wrote {name}: another syncer writes "
                          "this store (this one lost its lease)")
        names = {e["name"] for e in kept}
        for old in seqs:  # older than ours and not committed: superseded, or a dead writer's debris
            if old < seq and f"ckpt-{old:012d}.ddck" not in names:
                with contextlib.suppress(OSError):
                    self.fs.rm_file(self._key(f"ckpt-{old:012d}.ddck"))
        return PurePosixPath(self._key(name))

    def load_latest(self) -> tuple[Loaded | None, list[str]]:
        """The newest committed checkpoint that verifies (or None), and one line per one skipped.
        With no readable manifest, every listed object is a candidate, newest first."""
        skipped: list[str] = []
        entries, _, problem, _ = self._manifest()
        if problem is not None:
            skipped.append(problem)
        if entries is None:
            entries = [{"name": f"ckpt-{s:012d}.ddck"} for s in self._listed()]
        for e in entries:
            name = e["name"]
            try:
                data = bytes(self.fs.cat_file(self._key(name)))
                if "bytes" in e and (len(data) != e["bytes"] or hashlib.sha256(data).hexdigest() != e["sha256"]):
                    raise CheckpointError(f"checksum mismatch: {len(data)} bytes where the manifest committed "
                                          f"{e['bytes']} (the object is torn or was replaced)")
                arrays, meta = deserialize(data)
            except (CheckpointError, OSError) as exc:
                skipped.append(f"{name}: {exc}")
                continue
            return Loaded(PurePosixPath(self._key(name)), int(FILE_NAME.match(name).group(1)), arrays, meta), skipped  # type: ignore[union-attr]
        return None, skipped


def _precondition_failed(exc: BaseException) -> bool:
    """S3's 412 (PreconditionFailed) or 409 (ConditionalRequestConflict), as s3fs raises them."""
    text = f"{type(exc).__name__} {exc} {exc.__cause__!r}"
    return any(k in text for k in ("PreconditionFailed", "Precondition Failed", "412", "ConditionalRequestConflict"))
