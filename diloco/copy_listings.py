"""Every copy of a job's data holds the same files and sizes (docs/DATA.md, "Data near its
learners"). A copy's listing is the names of the files its globs match, relative to each glob's
fixed prefix, and their sizes: metadata only (one fsspec glob per pattern), nothing downloaded.

Where it is checked: `diloco validate --inputs` and `diloco run` list every group's copy from
here (`copy_problems`); on Kubernetes, where neither the operator nor `kubectl apply` reads
buckets, each learner sends its copy's listing in its Join and the syncer keeps the first one
admitted (in its checkpoint) and refuses any other (syncer/joins/readmission.py).

On the wire a listing names at most MAX_LISTED files of at most MAX_NAME characters (about a
megabyte for 10,000 FineWeb-style names); a larger copy sends its count, total size and digest
only, so a mismatch is still refused, without naming the file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from diloco.spec import DataSource, JobSpec
    from diloco.wire import pb

MAX_LISTED: Final = 10_000  # files named one by one on the wire; past it, only count, size and digest
MAX_NAME: Final = 256  # characters of one relative name on the wire
MAX_FILES: Final = 10_000_000  # the most files a listing may claim (a malformed count is refused)
MAX_ROOT: Final = 4096  # spec.data.source.path's own bound
DIGEST_BYTES: Final = 32  # sha256

Entry = tuple[bool, str, int]  # (held out, name relative to its glob's fixed prefix, size in bytes)


class ListingError(ValueError):
    """A listing that is malformed (from outside) or that differs from the kept one."""


@dataclass(frozen=True)
class Listing:
    """One copy's files: sorted (training first, then held-out), with a digest over all of them."""

    root: str  # the training glob's fixed prefix (gs://eu/train/), to name files in messages
    held_out_root: str  # the held-out glob's, or ""
    files: tuple[Entry, ...]  # every file, or () when there are more than MAX_LISTED (or a name is too long)
    count: int
    total_bytes: int
    digest: bytes

    def name(self, entry: Entry) -> str:
        """An entry's full name, as the manifest's glob would show it."""
        return (self.held_out_root if entry[0] else self.root) + entry[1]


def digest(entries: Iterable[Entry]) -> bytes:
    """sha256 over (held out, name, size) of every entry, in order."""
    h = hashlib.sha256()
    for held, name, size in entries:
        h.update(b"H" if held else b"T")
        h.update(name.encode("utf-8", "surrogatepass"))
        h.update(b"\0%d\n" % size)
    return h.digest()


def make(root: str, held_out_root: str, entries: Iterable[Entry]) -> Listing:
    """A listing of these entries; the names go on the wire only while they stay small."""
    files = tuple(sorted(entries))
    small = len(files) <= MAX_LISTED and all(len(n) <= MAX_NAME for _, n, _ in files)
    return Listing(root, held_out_root, files if small else (), len(files), sum(s for _, _, s in files), digest(files))


def fixed_prefix(pattern: str) -> str:
    """The part of a glob before its first wildcard, up to its last '/' (gs://eu/train/ of
    gs://eu/train/*.parquet): the names of a copy are relative to it."""
    cut = min((i for i in (pattern.find(c) for c in "*?[") if i >= 0), default=len(pattern))
    return pattern[: pattern.rfind("/", 0, cut) + 1]


def _list(pattern: str, field: str) -> dict[str, int]:
    """Relative name -> size of every file a glob matches (fsspec; metadata only)."""
    from fsspec.core import url_to_fs

    try:
        fs, stripped = url_to_fs(pattern)
        found = fs.glob(stripped, detail=True)
    except ImportError as exc:
        raise ListingError(f"{field}: cannot read {pattern!r}: {exc}") from None
    except (OSError, ValueError) as exc:
        raise ListingError(f"{field}: cannot list {pattern!r} ({exc}); check the path and your access to it") from None
    base = fixed_prefix(stripped)
    out: dict[str, int] = {}
    for path, info in found.items():
        if info.get("type") == "file":
            name = path[len(base):] if path.startswith(base) else path
            out[name] = int(info.get("size") or 0)
    return out


def list_copy(source: DataSource, fields: tuple[str, str] = ("spec.data.source.path", "spec.data.source.heldOutPath")
              ) -> Listing | None:
    """The listing of the files `source` (one group's resolved copy) reads; None for the builtin corpus."""
    if source.kind == "builtin" or source.path is None:
        return None
    entries: list[Entry] = [(False, n, s) for n, s in _list(source.path, fields[0]).items()]
    held_root = ""
    if source.held_out_path is not None:
        held_root = fixed_prefix(source.held_out_path)
        entries += [(True, n, s) for n, s in _list(source.held_out_path, fields[1]).items()]
    return make(fixed_prefix(source.path), held_root, entries)


def difference(kept: Listing, new: Listing, kept_by: str) -> tuple[bool, str] | None:
    """(whether it is a held-out file, one line naming the first file the two copies disagree on
    with both sizes); None when they hold the same files."""
    if kept.digest == new.digest and kept.count == new.count and kept.total_bytes == new.total_bytes:
        return None
    tail = "every copy must hold the same files"
    if all(x.files or not x.count for x in (kept, new)):  # both named in full: name the file
        a, b = {(h, n): s for h, n, s in new.files}, {(h, n): s for h, n, s in kept.files}
        for key in sorted(a.keys() | b.keys()):
            if a.get(key) != b.get(key):
                held, name = key
                mine = f"{new.name((held, name, 0))} is " + (f"{a[key]:,} bytes" if key in a else "missing")
                unit = "" if key in a else " bytes"  # "is 1,048,576 bytes, ... is 1,048,000"
                theirs = f"{kept.name((held, name, 0))} ({kept_by}) is " + (f"{b[key]:,}{unit}" if key in b else "missing")
                return held, f"{mine}, {theirs}: {tail}"
    return False, (f"{new.root} holds {new.count:,} files of {new.total_bytes:,} bytes, {kept.root} ({kept_by}) "
                   f"holds {kept.count:,} files of {kept.total_bytes:,} bytes (or files of other names or sizes): {tail}")


# -- on the wire and in the syncer's checkpoint ---------------------------------------------------


def to_pb(listing: Listing) -> pb.DataListing:
    from diloco.wire import pb

    return pb.DataListing(root=listing.root, held_out_root=listing.held_out_root, count=listing.count,
                          total_bytes=listing.total_bytes, digest=listing.digest,
                          files=[pb.DataFile(name=n, size=s, held_out=h) for h, n, s in listing.files])


def from_pb(msg: pb.DataListing) -> Listing:
    """A listing from a Join, validated (ListingError names what is wrong)."""
    return checked(msg.root, msg.held_out_root, [(f.held_out, f.name, int(f.size)) for f in msg.files],
                   int(msg.count), int(msg.total_bytes), bytes(msg.digest))


def checked(root: str, held_out_root: str, files: Sequence[Entry], count: int, total: int, sent: bytes) -> Listing:
    """Every rule a listing from outside must keep: bounded, sorted without repeats, its count,
    total and digest those of its files."""
    if len(root) > MAX_ROOT or len(held_out_root) > MAX_ROOT:
        raise ListingError(f"data listing: a root of more than {MAX_ROOT} characters")
    if not 0 <= count <= MAX_FILES:
        raise ListingError(f"data listing: {count} files; at most {MAX_FILES:,} are allowed")
    if len(sent) != DIGEST_BYTES:
        raise ListingError(f"data listing: a digest of {len(sent)} bytes, expected {DIGEST_BYTES} (sha256)")
    if total < 0:
        raise ListingError("data listing: a negative total size")
    if not files:
        return Listing(root, held_out_root, (), count, total, sent)
    if len(files) != count or count > MAX_LISTED:
        raise ListingError(f"data listing: {len(files)} files named for a count of {count} (at most {MAX_LISTED:,} "
                           "named, or none)")
    for i, (_, name, size) in enumerate(files):
        if not 0 < len(name) <= MAX_NAME or "\0" in name or "\n" in name:
            raise ListingError(f"data listing: file {i}'s name is empty, longer than {MAX_NAME} or holds a NUL "
                               "or newline")
        if size < 0:
            raise ListingError(f"data listing: file {name!r} has a negative size")
        if i and files[i - 1][:2] >= files[i][:2]:
            raise ListingError(f"data listing: files out of order or repeated at {name!r}")
    if sum(s for _, _, s in files) != total:
        raise ListingError("data listing: the total size is not the sum of its files' sizes")
    if digest(files) != sent:
        raise ListingError("data listing: the digest does not match its files")
    return Listing(root, held_out_root, tuple(files), count, total, sent)


def to_dict(listing: Listing, kept_by: str) -> dict[str, Any]:
    """A kept listing as the syncer's checkpoint metadata holds it (JSON)."""
    return {"root": listing.root, "held_out_root": listing.held_out_root, "count": listing.count,
            "total_bytes": listing.total_bytes, "digest": listing.digest.hex(), "by": kept_by,
            "files": [[int(h), n, s] for h, n, s in listing.files]}


def from_dict(raw: Mapping[str, Any]) -> tuple[Listing, str]:
    """A kept listing and who sent it, from the checkpoint (ValueError if malformed)."""
    try:
        files = [(bool(h), str(n), int(s)) for h, n, s in raw["files"]]
        return checked(str(raw["root"]), str(raw["held_out_root"]), files, int(raw["count"]),
                       int(raw["total_bytes"]), bytes.fromhex(raw["digest"])), str(raw["by"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint data_listing is malformed ({exc})") from None


# -- before a job starts: every group's copy, from where `diloco run` or `validate --inputs` runs --


def compare_copies(spec: JobSpec) -> tuple[list[str], list[str]]:
    """(one problem line per group whose copy differs from the first group's, one line per copy
    saying what it holds). Both empty where the job has one copy; groups that read the same
    globs are listed once."""
    from diloco.spec import path_field

    seen: set[tuple[str | None, str | None]] = set()
    first: tuple[Listing, str] | None = None
    out: list[str] = []
    held: list[str] = []
    for i, g in enumerate(spec.learner_groups):
        data = spec.data_for(g.name)
        key = (data.source.path, data.source.held_out_path)
        if key in seen:
            continue
        seen.add(key)
        fields = (path_field(spec.data, g, i), path_field(spec.data, g, i, held_out=True))
        try:
            listing = list_copy(data.source, fields)
        except ListingError as exc:
            out.append(str(exc))
            continue
        if listing is None:
            return [], []
        held.append(f"spec.learnerGroups[{i}] ({g.region}) reads {listing.root}: {listing.count:,} files, "
                    f"{listing.total_bytes:,} bytes")
        if first is None:
            first = (listing, f"spec.learnerGroups[{i}]")
        elif (found := difference(first[0], listing, first[1])) is not None:
            out.append(f"{fields[int(found[0])]}: {found[1]}")
    return (out, held) if len(seen) > 1 else ([], [])


def copy_problems(spec: JobSpec) -> list[str]:
    """`compare_copies`' problems: empty when every copy holds the same files and sizes."""
    return compare_copies(spec)[0]
