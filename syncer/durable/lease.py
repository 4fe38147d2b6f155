"""The publish lease: a durable bound on the versions this job's syncer may have published.

Provenance tags prove that a syncer of this job published a fragment's values at a version;
the lease bounds which versions that can be. Before a fragment's version passes its ceiling,
the syncer raises the ceiling `AHEAD` versions and writes it to its checkpoint store (one small
fsynced file beside the checkpoints, or one object, once per `AHEAD` publishes). A restarted syncer reads it back: nothing
above a ceiling was ever published, so a Recover offer above it is refused even with a tag,
the second lock on the door should the key ever leak from a checkpoint copy.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from diloco.checkpoint import CheckpointStore, Store

log = logging.getLogger("diloco.syncer")
FILE = "publish.lease"
AHEAD = 64  # versions reserved per write: one fsync per 64 publishes of a fragment, a tight bound


@dataclass
class PublishLease:
    """Per fragment, the highest version this job's syncer may have published (`None`: the lease
    file was lost or unreadable, and only the tags bound a recovery)."""

    ceilings: list[int] | None
    store: Store | None = None  # where it is kept; None for a syncer without checkpoints

    @property
    def where(self) -> str:
        return f"{self.store.location.rstrip('/')}/{FILE}" if self.store is not None else FILE

    @classmethod
    def open(cls, where: Path | Store | None, versions: list[int]) -> PublishLease:
        """The lease of a syncer restored at `versions`: what its predecessors wrote, never
        below what the checkpoint itself holds. `where`: the checkpoint store (or its directory)."""
        if where is None:
            return cls(list(versions))
        store = CheckpointStore(where) if isinstance(where, Path) else where
        path = f"{store.location.rstrip('/')}/{FILE}"
        try:
            raw = store.read_file(FILE)
            if raw is None:  # a fresh job: nothing was published yet beyond the checkpoint
                return cls(list(versions), store)
            stored = json.loads(raw)["ceilings"]
            if not isinstance(stored, list) or len(stored) != len(versions) or not all(
                    isinstance(v, int) and v >= 0 for v in stored):
                raise ValueError("one non-negative integer per fragment expected")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("publish lease %s is unreadable (%s); recovery offers are bounded by their tags only "
                      "until the next publish rewrites it", path, exc)
            return cls(None, store)
        return cls([max(c, v) for c, v in zip(stored, versions, strict=True)], store)

    def allows(self, fragment: int, version: int) -> bool:
        return self.ceilings is None or version <= self.ceilings[fragment]

    def reserve(self, fragment: int, version: int, versions: list[int]) -> None:
        """Make `version` of `fragment` publishable, writing a raised ceiling first when it is
        beyond the current one. A failed write (disk full) is logged and publishing goes on: the
        cost is that a recovery of the versions above the old ceiling would be refused."""
        if self.ceilings is not None and version <= self.ceilings[fragment]:
            return
        raised = list(versions) if self.ceilings is None else list(self.ceilings)
        raised[fragment] = version + AHEAD
        if self.store is not None:
            try:
                self.store.write_file(FILE, json.dumps({"ceilings": raised}).encode())
            except OSError as exc:
                log.error("cannot write the publish lease %s: %s; publishing goes on", self.where, exc)
                return
        self.ceilings = raised
