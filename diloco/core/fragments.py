"""Fragment plans: which whole tensors travel together as fragment p.

Every party (learners, syncer, operator) derives the same plan from parameter names
and shapes alone, so the plan is never sent as a source of truth; the syncer hands it
out on join only so a learner can check it agrees.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Method = Literal["balanced", "layer", "strided"]


@dataclass(frozen=True, order=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    itemsize: int = 4  # fp32 master weights

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class FragmentPlan:
    method: Method
    fragments: tuple[tuple[str, ...], ...]

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    def fragment_of(self, name: str) -> int:
        for p, names in enumerate(self.fragments):
            if name in names:
                return p
        raise KeyError(name)

    def fragment_bytes(self, specs: Iterable[TensorSpec]) -> list[int]:
        size = {s.name: s.nbytes for s in specs}
        return [sum(size[n] for n in names) for names in self.fragments]

    def imbalance(self, specs: Iterable[TensorSpec]) -> float:
        """Largest fragment's bytes over the mean: 1.0 is perfect balance."""
        sizes = self.fragment_bytes(specs)
        mean = sum(sizes) / len(sizes)
        return max(sizes) / mean if mean else 1.0

    def to_dict(self) -> dict[str, object]:
        return {"method": self.method, "fragments": [list(f) for f in self.fragments]}


def specs_from_shapes(shapes: Mapping[str, Sequence[int]], itemsize: int = 4) -> list[TensorSpec]:
    return [TensorSpec(n, tuple(int(d) for d in s), itemsize) for n, s in shapes.items()]


def plan_fragments(specs: Sequence[TensorSpec], num_fragments: int, method: Method) -> FragmentPlan:
    """Cut the tensors into `num_fragments` non-empty groups, deterministically."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("tensor names must be unique")
    if num_fragments < 1:
        raise ValueError(f"fragments must be at least 1, got {num_fragments}")
    if num_fragments > len(specs):
        raise ValueError(
            f"fragments: {num_fragments} exceeds the {len(specs)} tensors of the model; "
            "fragments hold whole tensors, so use at most one per tensor"
        )
    ordered = sorted(specs, key=lambda s: s.name)
    if method == "balanced":
        groups = _balanced(ordered, num_fragments)
    elif method == "layer":
        groups = _by_layer(ordered, num_fragments)
    elif method == "strided":
        groups = [[s.name for s in ordered[p::num_fragments]] for p in range(num_fragments)]
    else:
        raise ValueError(f"unknown fragmentation method {method!r}")
    return FragmentPlan(method, tuple(tuple(sorted(g)) for g in groups))


def _balanced(ordered: list[TensorSpec], p: int) -> list[list[str]]:
    """Greedy bin packing: largest tensor first, into the lightest fragment (lowest index on ties)."""
    load = [0] * p
    groups: list[list[str]] = [[] for _ in range(p)]
    for spec in sorted(ordered, key=lambda s: (-s.nbytes, s.name)):
        # An empty fragment wins over a lighter non-empty one so none stays empty.
        target = min(range(p), key=lambda i: (bool(groups[i]), load[i], i))
        groups[target].append(spec.name)
        load[target] += spec.nbytes
    return groups


_LAYER = re.compile(r"(?:^|/)(?:layers?|blocks?|h)_?(\d+)(?:/|$)")


def is_embedding(name: str) -> bool:
    """A lookup table (`embed`, `pos_embed`, ...: the first path component names it). Such tables
    sit first in the plan and are merged by plain weighted averaging, since rows a learner never
    looked up have zero outer gradient (docs/ALGORITHM.md, "The syncer": Merge)."""
    return "embed" in name.split("/")[0]


def layer_key(name: str) -> tuple[int, int]:
    """Sort key placing embeddings first, numbered layers in order, and the head last."""
    match = _LAYER.search(name)
    if match:
        return (1, int(match.group(1)))
    return (0, 0) if is_embedding(name) else (2, 0)


def _by_layer(ordered: list[TensorSpec], p: int) -> list[list[str]]:
    """Consecutive layers per fragment, cut by cumulative bytes (bursty by design)."""
    units: dict[tuple[int, int], list[TensorSpec]] = {}
    for spec in ordered:
        units.setdefault(layer_key(spec.name), []).append(spec)
    chunks = [units[k] for k in sorted(units)]
    if len(chunks) < p:  # fewer layers than fragments: split the biggest units by tensor
        flat = [[s] for chunk in chunks for s in chunk]
        chunks = flat
    total = sum(s.nbytes for chunk in chunks for s in chunk)
    groups: list[list[str]] = [[] for _ in range(p)]
    done, g = 0, 0
    for i, chunk in enumerate(chunks):
        remaining_chunks, remaining_groups = len(chunks) - i, p - g
        groups[g].extend(s.name for s in chunk)
        done += sum(s.nbytes for s in chunk)
        full = done >= total * (g + 1) / p
        must_move = remaining_chunks - 1 < remaining_groups  # keep later fragments non-empty
        if g < p - 1 and (full or must_move) and remaining_chunks > 1:
            g += 1
    return groups


def owner(fragment: int, shards: int) -> int:
    """The syncer shard that merges, checkpoints and publishes `fragment`: round robin, so each
    slot's N due fragments (core/schedule.py) go one to each shard, and a balanced plan gives
    every shard the same bytes."""
    return fragment % shards


def owned_by(shard: int, num_fragments: int, shards: int) -> tuple[int, ...]:
    """The fragments syncer shard `shard` of `shards` owns (every fragment when unsharded)."""
    return tuple(p for p in range(num_fragments) if owner(p, shards) == shard)
