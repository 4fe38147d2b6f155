"""The global model Θ on the syncer: fragments, versions, outer optimizers and merging.

No networking and no clock here: the service feeds contributions in and asks for
merges; tests drive it directly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from diloco.core.codecs import encode_tensors
from diloco.core.fragments import FragmentPlan, plan_fragments, specs_from_shapes
from diloco.core.merge import is_embedding, merge_fragment, token_weights
from diloco.core.outer import NesterovSGD
from diloco.core.rounds import Closed, Contribution
from diloco.spec import Syncer as SyncerSpec

Tensors = dict[str, np.ndarray]


@dataclass
class MergeResult:
    fragment: int
    version: int
    learners: list[str]
    tokens: int
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
    # Past values of each fragment by version, for the `reanchor` staleness policy.
    history: list[deque[tuple[int, Tensors]]] = field(init=False)

    def __post_init__(self) -> None:
        specs = specs_from_shapes({k: v.shape for k, v in self.params.items()})
        self.plan = plan_fragments(specs, self.spec.fragments, self.spec.fragmentation)
        if len(self.versions) != self.plan.num_fragments:
            raise ValueError("one version per fragment")
        self.optimizers = [
            NesterovSGD(self.spec.outer_learning_rate, self.spec.outer_momentum)
            for _ in range(self.plan.num_fragments)
        ]
        depth = self.spec.staleness.max_versions if self.spec.staleness.policy == "reanchor" else 0
        self.history = [deque(maxlen=depth) for _ in range(self.plan.num_fragments)]

    @classmethod
    def fresh(cls, spec: SyncerSpec, params: Mapping[str, np.ndarray]) -> GlobalModel:
        tensors = {k: np.array(v, dtype=np.float32) for k, v in params.items()}
        return cls(spec, tensors, [0] * spec.fragments)

    def shapes(self, fragment: int | None = None) -> dict[str, tuple[int, ...]]:
        names = self.params if fragment is None else self.plan.fragments[fragment]
        return {n: self.params[n].shape for n in names}

    def fragment(self, p: int) -> Tensors:
        return {n: self.params[n] for n in self.plan.fragments[p]}

    def full_blob(self) -> bytes:
        return encode_tensors(self.params, "fp32")

    def apply(self, closed: Closed[Tensors], active: int = 1) -> MergeResult:
        """Merge a closed round into Θ_p with the Nesterov outer step; bump its version.

        With `spec.participationScaling`, a round that holds n of the `active` learners moves
        Θ by n/active of the merged update: however rounds split, Θ then advances by the
        average progress of the active learners, as synchronous DiLoCo's mean does, instead
        of by the sum of every lone contribution."""
        p = closed.fragment
        deltas = [self._rebased(c) for c in closed.contributions]
        weights = token_weights(
            [c.tokens for c in closed.contributions],
            [c.steps for c in closed.contributions],
            self.spec.token_weighting,
        ) * np.asarray(closed.scales)
        if not np.any(weights > 0):
            weights = np.ones(len(deltas))  # all zero-step pushes: average them plainly
        embeddings = {n for n in self.plan.fragments[p] if is_embedding(n)}
        merged = merge_fragment(deltas, weights, self.spec.merge, embeddings)
        if self.spec.participation_scaling and active > len(deltas):
            share = np.float32(len(deltas) / active)
            merged = {n: v * share for n, v in merged.items()}
        current = self.fragment(p)
        if self.history[p].maxlen:
            self.history[p].append((self.versions[p], {n: v.copy() for n, v in current.items()}))
        self.params.update(self.optimizers[p].step(current, merged))
        self.versions[p] += 1
        # A contribution's tokens trained every fragment; this merge carries 1/P of their effect,
        # so a token counts once when all P fragments have merged it, not P times.
        tokens = round(sum(c.tokens for c in closed.contributions) / self.plan.num_fragments)
        self.tokens_merged += tokens
        self.outer_steps += 1
        norm = float(np.sqrt(sum(float(np.vdot(v, v)) for v in merged.values())))
        return MergeResult(p, self.versions[p], [c.learner for c in closed.contributions], tokens, norm)

    def _rebased(self, c: Contribution[Tensors]) -> Tensors:
        """Re-anchor a stale outer gradient: Δ' = Θ_now − (Θ_base − Δ), the same local weights
        measured from the current global fragment. Other policies use Δ as it came."""
        lag = self.versions[c.fragment] - c.base_version
        if lag == 0 or self.spec.staleness.policy != "reanchor":
            return c.payload
        for version, old in self.history[c.fragment]:
            if version == c.base_version:
                return {n: self.params[n] - old[n] + d for n, d in c.payload.items()}
        return c.payload  # history shorter than the bound: use it as it came

    # -- checkpoint state ----------------------------------------------------------

    def state(self) -> tuple[dict[str, np.ndarray], dict[str, object]]:
        arrays = {f"param/{n}": v for n, v in self.params.items()}
        for p, opt in enumerate(self.optimizers):
            arrays.update({f"momentum/{p}/{n}": b for n, b in opt.state_dict().items()})
        meta = {"versions": list(self.versions), "tokens_merged": self.tokens_merged,
                "outer_steps": self.outer_steps, "plan": self.plan.to_dict()}
        return arrays, meta

    @classmethod
    def from_state(cls, spec: SyncerSpec, arrays: Mapping[str, np.ndarray], meta: Mapping[str, object],
                   expect: Mapping[str, tuple[int, ...]]) -> GlobalModel:
        """Restore, refusing a checkpoint whose tensors or plan do not match this job."""
        params = {k.removeprefix("param/"): np.array(v, np.float32) for k, v in arrays.items() if k.startswith("param/")}
        got = {k: tuple(v.shape) for k, v in params.items()}
        if got != dict(expect):
            raise ValueError("checkpoint tensors do not match the job's model (different spec.model?)")
        model = cls(spec, params, [0] * spec.fragments)
        if meta.get("plan") != model.plan.to_dict():
            raise ValueError("checkpoint fragment plan differs from the job's spec.syncer fragments")
        versions = meta.get("versions")
        if not isinstance(versions, list) or len(versions) != spec.fragments or any(
                not isinstance(v, int) or v < 0 for v in versions):
            raise ValueError("checkpoint versions are malformed")
        model.versions[:] = versions
        for p, opt in enumerate(model.optimizers):
            prefix = f"momentum/{p}/"
            buffers = {k.removeprefix(prefix): v for k, v in arrays.items() if k.startswith(prefix)}
            if any(n not in model.plan.fragments[p] or v.shape != model.params[n].shape for n, v in buffers.items()):
                raise ValueError(f"checkpoint momentum of fragment {p} does not match its tensors")
            opt.load_state_dict(buffers)
        for key in ("tokens_merged", "outer_steps"):
            value = meta.get(key, 0)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"checkpoint {key} is malformed")
            setattr(model, key, value)
        return model
