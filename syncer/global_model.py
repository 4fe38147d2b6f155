"""The global model Θ on the syncer: fragments, versions, outer optimizers and merging; the
job's token count is its `TokenCredits` (syncer/credits.py), a checkpoint's metadata is read in
syncer/durable/model_meta.py, and its round book is built in syncer/round.py.

No networking and no clock here: the service feeds contributions in and asks for
merges; tests drive it directly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from diloco import copy_listings
from diloco.checkpoint import PARAM, momentum_key, params_of
from diloco.core.fragments import FragmentPlan, is_embedding, plan_fragments, specs_from_shapes
from diloco.core.merge import Source, merge_updates, token_weights
from diloco.core.outer import NesterovSGD
from diloco.core.rounds import Closed, RoundPolicy
from diloco.spec import Syncer as SyncerSpec
from diloco.syncer import provenance
from diloco.syncer.credits import TokenCredits
from diloco.syncer.durable.model_meta import checkpoint_shapes, read_meta

Tensors = dict[str, np.ndarray]
Outer = dict[str, Source]  # a contribution's outer gradient, per tensor: fp32 values or still encoded


def placeholder(shape: Sequence[int]) -> np.ndarray:
    """A tensor a shard does not hold: its shape, zero-stride, no memory."""
    return np.broadcast_to(np.float32(0), tuple(shape))


def placeholders(shapes: Mapping[str, Sequence[int]]) -> dict[str, np.ndarray]:
    return {n: placeholder(s) for n, s in shapes.items()}


@dataclass
class MergeResult:
    fragment: int
    version: int
    learners: list[str]
    tokens_merged: int  # trained tokens this merge credited, each counted once over the whole job
    update_norm: float
    credits: dict[str, int]  # the same, by learner


@dataclass(frozen=True)
class Merged:
    """A closed round's result before it is committed to Θ."""

    closed: Closed[Outer]
    values: Tensors  # the fragment's new tensors
    learners: list[str]
    update_norm: float


@dataclass
class GlobalModel:
    spec: SyncerSpec
    params: Tensors
    versions: list[int]
    plan: FragmentPlan = field(init=False)
    optimizers: list[NesterovSGD] = field(init=False)
    tokens_merged: int = 0
    outer_steps: int = 0
    credits: TokenCredits = field(default_factory=TokenCredits)  # the job's trained tokens (syncer/credits.py)
    schedule: dict[str, object] = field(default_factory=dict)  # the round book's, as last checkpointed
    # The MAC key of provenance tags (syncer/provenance.py): checkpointed, so a restarted syncer
    # recognises what its predecessors published.
    publish_key: bytes = field(default_factory=provenance.new_key)
    # A syncer shard's fragments (spec.syncer.shards): the others' tensors are zero-stride
    # placeholders (their shapes, no memory), never merged and never checkpointed. None: all.
    owned: tuple[int, ...] | None = None
    # The fingerprint of Θ₀ as the first learner seeded it (diloco/core/seed.py): every learner
    # that joins must present the same. Empty: from a checkpoint older than seeding.
    init_hash: bytes = b""
    # The files of the data as the first admitted learner's copy holds them, and that learner
    # (diloco/copy_listings.py): every learner's copy must hold the same. None: none admitted yet.
    data_listing: tuple[copy_listings.Listing, str] | None = None
    # The merge's accumulator, lent to every round (one merge at a time) and sized to the largest
    # fragment merged so far: each round reuses one buffer instead of a fresh fragment-sized array.
    _scratch: np.ndarray = field(default_factory=lambda: np.empty(0, np.float32), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        specs = specs_from_shapes({k: v.shape for k, v in self.params.items()})
        self.plan = plan_fragments(specs, self.spec.plan_size, self.spec.fragmentation)
        if len(self.versions) != self.plan.num_fragments:
            raise ValueError("one version per fragment")
        self.optimizers = [NesterovSGD(self.spec.outer_learning_rate, self.spec.outer_momentum)
                           for _ in range(self.plan.num_fragments)]

    @classmethod
    def fresh(cls, spec: SyncerSpec, params: Mapping[str, np.ndarray], owned: Sequence[int] | None = None,
              *, copy: bool = True) -> GlobalModel:
        """Θ₀ of `owned` fragments (None: all), each held tensor an fp32 copy of `params`' (with
        `copy` false, the caller's own fp32 arrays: a seed's freshly decoded tensors). The
        others are placeholders from the start: a shard of a large model never materialises
        the tensors it does not hold, not even while it is built."""
        model = cls(spec, placeholders({k: np.shape(v) for k, v in params.items()}), [0] * spec.plan_size)
        model.keep_only(owned)
        held = model.held()
        model.params = {k: (np.array(v, np.float32) if copy else np.asarray(v, np.float32)) if k in held else model.params[k]
                        for k, v in params.items()}
        return model

    def keep_only(self, owned: Sequence[int] | None) -> None:
        """Hold the tensors of `owned` fragments only (None or every fragment: all); the rest
        become placeholders. Holding the same already changes nothing."""
        normal = None if owned is None or len(owned) == self.plan.num_fragments else tuple(owned)
        if normal == self.owned:
            return
        self.owned = normal
        held = self.held()
        self.params = {n: v if n in held else placeholder(v.shape) for n, v in self.params.items()}

    def job_tokens(self) -> int:
        """The job's trained tokens: those merged, plus what accepted pushes carry beyond their credit."""
        return self.tokens_merged + self.credits.unmerged()

    def held(self) -> set[str]:
        """The tensors this syncer (shard) holds and checkpoints."""
        fragments = range(self.plan.num_fragments) if self.owned is None else self.owned
        return {n for p in fragments for n in self.plan.fragments[p]}

    def shapes(self, fragment: int | None = None) -> dict[str, tuple[int, ...]]:
        names = self.params if fragment is None else self.plan.fragments[fragment]
        return {n: self.params[n].shape for n in names}

    def fragment(self, p: int) -> Tensors:
        return {n: self.params[n] for n in self.plan.fragments[p]}

    def apply(self, closed: Closed[Outer], active: int = 1) -> MergeResult:
        """Merge a closed round into Θ_p with the Nesterov outer step; bump its version."""
        return self.commit(self.merge(closed, active))

    def merge(self, closed: Closed[Outer], active: int = 1) -> Merged:
        """The new Θ_p of a closed round: RDA of its outer gradients, then the Nesterov step
        (which advances the fragment's momentum). Θ and the versions are untouched, so the
        syncer runs this outside its admission lock; one merge at a time.

        Stale outer gradients are scaled by the round book's absolute factors. With
        `spec.participationScaling`, a round that holds n of the `active` learners moves
        Θ by n/active of the merged update: a partial round (a learner down or late) then
        moves Θ by the active learners' average progress, as a full one does."""
        p = closed.fragment
        deltas = [c.payload for c in closed.contributions]
        weights = token_weights(
            [c.tokens for c in closed.contributions],
            [c.steps for c in closed.contributions],
            self.spec.token_weighting,
        )
        if not np.any(weights > 0):
            weights = np.ones(len(deltas))  # all zero-step pushes: average them plainly
        embeddings = {n for n in self.plan.fragments[p] if is_embedding(n)}
        merged = merge_updates(deltas, [float(w) for w in weights], self.spec.merge, plain_average=embeddings,
                               scales=closed.scales, out=self._accumulators(p))
        learners = {c.learner for c in closed.contributions}
        share = len(learners) / active if self.spec.participation_scaling and active > len(learners) else 1.0
        factors = {n: share * u.factor for n, u in merged.items()}  # applied inside the outer step's pass
        norm = math.sqrt(sum(factors[n] ** 2 * u.sumsq for n, u in merged.items()))
        values = self.optimizers[p].step(self.fragment(p), {n: u.values for n, u in merged.items()}, factors)
        return Merged(closed, values, sorted(learners), norm)

    def _accumulators(self, p: int) -> dict[str, np.ndarray]:
        """Flat views of the scratch buffer, one per tensor of fragment p. The outer step reads
        them and keeps nothing of them (it writes Θ's new tensors and its momentum elsewhere)."""
        sizes = {n: math.prod(self.params[n].shape) for n in self.plan.fragments[p]}
        if self._scratch.size < sum(sizes.values()):
            self._scratch = np.empty(sum(sizes.values()), np.float32)
        views, at = {}, 0
        for n, size in sizes.items():
            views[n], at = self._scratch[at:at + size], at + size
        return views

    def commit(self, m: Merged) -> MergeResult:
        """Θ_p ← the merge's tensors, version + 1, and each learner's new tokens credited once."""
        p = m.closed.fragment
        self.params.update(m.values)
        self.versions[p] += 1
        credits = self.credits.credit(m.closed.contributions)
        self.tokens_merged += (tokens := sum(credits.values()))
        self.outer_steps += 1
        return MergeResult(p, self.versions[p], m.learners, tokens, m.update_norm, credits)

    # -- checkpoint state ----------------------------------------------------------

    def state(self) -> tuple[dict[str, np.ndarray], dict[str, object]]:
        held = self.held()
        arrays = {f"{PARAM}{n}": v for n, v in self.params.items() if n in held}
        for p, opt in enumerate(self.optimizers):
            arrays.update({momentum_key(p, n): b for n, b in opt.state_dict().items()})
        meta = {"versions": list(self.versions), "tokens_merged": self.tokens_merged,
                "outer_steps": self.outer_steps, "plan": self.plan.to_dict(), "credited": dict(self.credits.credited),
                "schedule": dict(self.schedule), "publish_key": self.publish_key.hex(),
                "init_hash": self.init_hash.hex(), "shapes": {n: list(v.shape) for n, v in self.params.items()}}
        if self.owned is not None:
            meta["owned"] = list(self.owned)
        if self.data_listing is not None:
            meta["data_listing"] = copy_listings.to_dict(*self.data_listing)
        return arrays, meta

    @classmethod
    def from_state(cls, spec: SyncerSpec, arrays: Mapping[str, np.ndarray], meta: Mapping[str, object], *,
                   expect: Mapping[str, tuple[int, ...]] | None = None, owned: Sequence[int] | None = None
                   ) -> GlobalModel:
        """Restore, refusing a checkpoint whose tensors, plan or shard do not match this job's
        (and this shard's: `owned`). `expect`: the model's shapes where the caller knows them;
        the syncer does not (it runs no model code) and takes the checkpoint's own."""
        params = params_of(arrays)
        mismatch = "checkpoint tensors do not match the job's model (different spec.model?)"
        got = {k: tuple(v.shape) for k, v in params.items()}
        if expect is None:
            expect = checkpoint_shapes(meta, got)
        if any(tuple(expect.get(k, ())) != s for k, s in got.items()):
            raise ValueError(mismatch)
        model = cls(spec, placeholders(expect), [0] * spec.plan_size)
        if meta.get("plan") != model.plan.to_dict():
            raise ValueError("checkpoint fragment plan differs from the job's (spec.syncer fragments x shards)")
        model.keep_only(owned)
        stored = meta.get("owned")
        if (list(model.owned) if model.owned is not None else None) != stored:
            raise ValueError(f"the checkpoint holds fragments {stored if stored is not None else 'all'} and this syncer "
                             f"shard owns {list(model.owned) if model.owned is not None else 'all'}: "
                             "spec.syncer.shards changed since it was written; set it back")
        if set(got) != model.held():
            raise ValueError(mismatch)
        model.params.update(params)
        versions = meta.get("versions")
        if not isinstance(versions, list) or len(versions) != spec.plan_size or any(
                not isinstance(v, int) or v < 0 for v in versions):
            raise ValueError("checkpoint versions are malformed")
        model.versions[:] = versions
        for p, opt in enumerate(model.optimizers):
            prefix = momentum_key(p, "")
            buffers = {k.removeprefix(prefix): v for k, v in arrays.items() if k.startswith(prefix)}
            if any(n not in model.plan.fragments[p] or v.shape != model.params[n].shape for n, v in buffers.items()):
                raise ValueError(f"checkpoint momentum of fragment {p} does not match its tensors")
            opt.load_state_dict(buffers)
        stored_meta = read_meta(meta, model.plan.num_fragments)
        model.tokens_merged, model.outer_steps = stored_meta.tokens_merged, stored_meta.outer_steps
        model.credits, model.schedule = stored_meta.credits, stored_meta.schedule
        model.init_hash, model.data_listing = stored_meta.init_hash, stored_meta.data_listing
        model.publish_key = stored_meta.publish_key or model.publish_key  # none stored: keep the fresh key
        return model

    def tag_matches(self, p: int, version: int, values: Mapping[str, np.ndarray], presented: bytes) -> bool:
        return provenance.verify(self.publish_key, p, version, values, names=self.plan.fragments[p],
                                 presented=presented)

    def tag(self, p: int, version: int, values: Mapping[str, np.ndarray]) -> bytes:
        """The provenance tag of fragment p's `values` at `version` (what a learner then holds)."""
        return provenance.tag(self.publish_key, p, version, values, names=self.plan.fragments[p])


def round_policy(spec: SyncerSpec, num_fragments: int) -> RoundPolicy:
    """The rounds' rules, from spec.syncer: the one place the spec's names meet the core's."""
    g, st = spec.grace_window, spec.staleness
    return RoundPolicy(spec.quorum, g.gamma, g.tau, g.cap_seconds, st.max_versions, st.policy, num_fragments)
