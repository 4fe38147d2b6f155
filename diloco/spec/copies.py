"""Data near its learners: a learner group's own copy of the training data (`learnerGroups[].data`,
or a `{region}` placeholder in `spec.data.source.path`), and the one function that says which
files a group reads (`group_data`). The learner, `diloco validate --inputs`, `diloco run` and
the syncer's admission all go through it, so they can never disagree on a group's path.

A platform team keeps one copy of a corpus per region so that learners do not pay cross-region
egress; every copy must hold the same files and sizes (diloco/copy_listings.py checks them), or each
shard would silently hold different documents.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Final, Protocol

from pydantic import Field

from diloco.spec.base import Model

if TYPE_CHECKING:
    from diloco.spec.learner import Data

PLACEHOLDER: Final = "{region}"
_BRACES = re.compile(r"\{([^{}]*)\}")
# What a region may be where it fills a path: no '/', no glob characters, no '..'.
_PATH_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class GroupData(Model):
    """`learnerGroups[].data`: where this group reads its own copy of `spec.data.source`."""

    # A glob replacing spec.data.source.path for this group's learners (its region's copy, e.g.
    # gs://corpus-eu/fineweb/*.parquet); it must match the same files, with the same sizes.
    path: str | None = Field(None, min_length=1, max_length=4096)
    # The group's copy of spec.data.source.heldOutPath; unset: the job's heldOutPath (with
    # {region} filled in), which is small and read once, so a shared one costs little egress.
    held_out_path: str | None = Field(None, min_length=1, max_length=4096)


class Group(Protocol):
    """What these rules read of a learner group (`diloco.spec.LearnerGroup`): a protocol, so this
    module, which the package imports, never imports the package back."""

    @property
    def region(self) -> str: ...

    @property
    def data(self) -> GroupData | None: ...


def _fill(pattern: str | None, region: str) -> str | None:
    return None if pattern is None else pattern.replace(PLACEHOLDER, region)


def group_data(data: Data, group: Group) -> Data:
    """`spec.data` as learners of `group` read it: their group's data.path / heldOutPath where
    set, else the job's, with {region} replaced by the group's region."""
    src = data.source
    own = group.data or GroupData()
    path = _fill(own.path or src.path, group.region)
    held_out = _fill(own.held_out_path or src.held_out_path, group.region)
    if (path, held_out) == (src.path, src.held_out_path):
        return data
    return data.model_copy(update={"source": src.model_copy(update={"path": path, "held_out_path": held_out})})


def path_field(data: Data, group: Group, index: int, held_out: bool = False) -> str:
    """The manifest field a group's (training or held-out) path comes from, for messages."""
    own = group.data
    if own is not None and (own.held_out_path if held_out else own.path) is not None:
        return f"spec.learnerGroups[{index}].data.{'heldOutPath' if held_out else 'path'}"
    field = "spec.data.source." + ("heldOutPath" if held_out else "path")
    pattern = data.source.held_out_path if held_out else data.source.path
    if pattern is not None and PLACEHOLDER in pattern:
        return f"{field} ({PLACEHOLDER} = {group.region!r}, spec.learnerGroups[{index}])"
    return field


def copy_problems(data: Data, groups: Sequence[Group]) -> Iterable[str]:
    """The spec's own rules on copies: only {region} is filled in, a region that fills a path is
    a plain name, and a group's path needs a source that reads files."""
    src = data.source
    for field, pattern in (("spec.data.source.path", src.path), ("spec.data.source.heldOutPath", src.held_out_path)):
        yield from _placeholders(field, pattern)
    uses_region = any(PLACEHOLDER in (p or "") for p in (src.path, src.held_out_path))
    for i, g in enumerate(groups):
        own = g.data
        if own is not None:
            for name, pattern in (("path", own.path), ("heldOutPath", own.held_out_path)):
                yield from _placeholders(f"spec.learnerGroups[{i}].data.{name}", pattern)
            if src.kind == "builtin" and (own.path or own.held_out_path):
                yield (f"spec.learnerGroups[{i}].data.path: the builtin corpus reads no files, so there is no copy "
                       "to read; set spec.data.source.kind and path, or remove the group's data")
            elif own.held_out_path is not None and src.held_out_path is None:
                yield (f"spec.learnerGroups[{i}].data.heldOutPath: spec.data.source.heldOutPath is unset (the held-out "
                       "split is the last heldOutFraction of the data, the same in every copy); set "
                       "spec.data.source.heldOutPath too, or remove the group's heldOutPath")
        own_paths = (own.path, own.held_out_path) if own is not None else ()
        group_uses = uses_region or any(PLACEHOLDER in (p or "") for p in own_paths)
        if group_uses and not _PATH_SAFE.match(g.region):
            yield (f"spec.learnerGroups[{i}].region: {g.region!r} fills {PLACEHOLDER} in a data path; use letters, "
                   "digits, '-', '_' and '.' (no '/' or glob characters), at most 63")


def _placeholders(field: str, pattern: str | None) -> Iterable[str]:
    for name in dict.fromkeys(_BRACES.findall(pattern or "")):
        if name != "region":
            yield (f"{field}: placeholder {{{name}}} is not known; only {PLACEHOLDER} (each learner group's region) "
                   "is filled in")
