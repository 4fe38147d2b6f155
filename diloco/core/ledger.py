"""The learner's books per fragment: anchor, pushes in flight, exact rebase on adoption.

For fragment p the learner holds an anchor A_p (the newest global value Θ_p it adopted)
and its local weights θ_p; their difference θ_p − A_p is progress the global model does
not hold, except for the part already pushed. A push carries only progress no earlier
push carries (Δ = A_p − θ_p minus what is in flight), and the learner records exactly
what the syncer will decode, so compression error stays local and goes out with the
next push (error feedback). When Θ_p' arrives the learner rebases,

    θ_p ← Θ_p' + (θ_p − A_p) − (progress of its pushes that Θ_p' already merged),

so neither the steps taken while a push was in flight nor progress other learners'
rounds overtook is thrown away, and nothing is counted twice: a push is known merged
once the learner holds the version the syncer said it would be merged into
(`PushReply.merged_into`). The rebase is returned as a shift to add to θ_p,
(Θ_p' − A_p) − (that progress), computed without reading θ_p: a learner adds it on its
devices, where θ_p lives, without waiting for the step they are running. Pure numpy, no
clock and no network: tests script it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from diloco.core.choices import Adoption
from diloco.core.codecs import Blob, Codec, encode_difference
from diloco.core.schedule import Schedule

Tensors = dict[str, np.ndarray]


@dataclass(kw_only=True)
class Push:
    """One push of one fragment: the learner's only record of it. `prepare_push` makes it (by
    keyword: kw_only, so no caller can mix up its counts); the ledger books it while it is in
    flight (`delta`, `merged_into`); the syncer client queues it and `diloco.wire.push_header`,
    the one conversion, puts it on the wire as a `PushHeader` plus `blob`."""

    fragment: int
    base_version: int  # the version of the anchor the outer gradient is against
    push_id: int  # increasing per process: the syncer's answers name it, a retry repeats it
    slot: int  # the schedule slot it is for
    steps: int  # inner steps since the anchor
    tokens: int  # tokens since the anchor: with `steps`, the push's merge weight
    session_tokens: int  # tokens this process has trained in all, up to this push
    delta: Tensors  # exactly what the syncer decodes: −(the progress this push carries)
    blob: bytes | Blob  # `delta` encoded: what goes on the wire (an encoder's view); let go once accepted
    incarnation: str  # the syncer incarnation whose anchors the outer gradient is against
    step_seconds: float  # the learner's recent step time (the syncer's grace window)
    loss: float  # its recent training loss (shown, never trusted)
    train_seconds: float  # its cumulative training time when this was made
    merged_into: int | None = None  # set when the syncer accepts it: the version that merges it


@dataclass
class FragmentBook:
    version: int
    anchor: Tensors
    in_flight: list[Push] = field(default_factory=list)
    steps: int = 0  # inner steps whose progress no push carries yet
    tokens: int = 0  # their tokens


class Ledger:
    def __init__(self, fragments: Sequence[Sequence[str]], anchors: Mapping[str, np.ndarray],
                 versions: Sequence[int], adoption: Adoption = "rebase"):
        if len(fragments) != len(versions):
            raise ValueError("one version per fragment")
        self.fragments = [tuple(f) for f in fragments]
        self.adoption = adoption
        self.books = [FragmentBook(int(v), {n: _copy(anchors[n]) for n in names})
                      for names, v in zip(self.fragments, versions, strict=True)]

    # -- training -------------------------------------------------------------------

    def stepped(self, tokens: int) -> None:
        """One inner step trained every fragment."""
        for b in self.books:
            b.steps += 1
            b.tokens += tokens

    def busy(self, p: int) -> bool:
        """A push of p is in flight: the training loop waits for it before pushing p again."""
        return bool(self.books[p].in_flight)

    def unpushed(self, p: int) -> bool:
        return self.books[p].steps > 0

    def unacknowledged(self) -> bool:
        """Some push in flight has no answer from the syncer yet."""
        return any(f.merged_into is None for b in self.books for f in b.in_flight)

    def carried(self, p: int, local: Mapping[str, np.ndarray]) -> Tensors:
        """θ_p plus what pushes in flight carry (each holds −progress): the weights whose
        difference from A_p no push carries yet."""
        out = {n: np.asarray(local[n], dtype=np.float32) for n in self.fragments[p]}
        for f in self.books[p].in_flight:  # only when flushing at the end: the loop waits for p's push first
            out = {n: out[n] + f.delta[n] for n in out}
        return out

    def outer_gradient(self, p: int, local: Mapping[str, np.ndarray]) -> Tensors:
        """Δ = A_p − θ_p, less what pushes in flight already carry."""
        anchor = self.books[p].anchor
        return {n: anchor[n] - v for n, v in self.carried(p, local).items()}

    def pushed(self, push: Push) -> Push:
        """Book a push handed to the sender (`prepare_push` makes it): it carries the fragment's
        unpushed steps and tokens, and its `delta` (fresh fp32 arrays, kept as they are)."""
        b = self.books[push.fragment]
        if (push.base_version, push.steps, push.tokens) != (b.version, b.steps, b.tokens):
            raise ValueError(f"push {push.push_id} of fragment {push.fragment} does not carry its book's "
                             f"version, steps and tokens")
        b.in_flight.append(push)
        b.steps, b.tokens = 0, 0
        return push

    # -- what the syncer said ---------------------------------------------------------

    def accepted(self, p: int, push_id: int, merged_into: int) -> None:
        for f in self.books[p].in_flight:
            if f.push_id == push_id:
                f.merged_into = merged_into
                f.blob = b""  # answered: never sent again, and the rebase needs only `delta`

    def refused(self, p: int, push_id: int) -> None:
        """Its progress was never merged: it is still in θ − A and goes out with the next push."""
        b = self.books[p]
        for f in [f for f in b.in_flight if f.push_id == push_id]:
            b.in_flight.remove(f)
            b.steps += f.steps
            b.tokens += f.tokens

    def _merged(self, p: int) -> list[Push]:
        """Take the pushes the held global version already contains off the books."""
        b = self.books[p]
        merged = [f for f in b.in_flight if f.merged_into is not None and f.merged_into <= b.version]
        for f in merged:
            b.in_flight.remove(f)
        return merged

    def settle(self, p: int) -> Tensors | None:
        """Drop the progress of pushes the held global version already contains: returns the
        shift to add to θ_p (the sum of their Δ, each −progress), or None if there is none."""
        merged = self._merged(p)
        if not merged:
            return None
        return {n: _sum(f.delta[n] for f in merged) for n in self.fragments[p]}

    def adopt(self, p: int, version: int, global_values: Mapping[str, np.ndarray],
              local: Callable[[], Mapping[str, np.ndarray]]) -> Tensors:
        """Adopt Θ_p at `version`; returns the shift to add to θ_p,

            (Θ_p − A_p) + (the Δ of each push Θ_p already merged),

        so that θ_p becomes Θ_p + (θ_p − A_p) + those Δ. Only the overwrite ablation reads
        θ_p (`local()`): its shift is Θ_p − θ_p, dropping every unmerged step."""
        b = self.books[p]
        fresh = {n: _copy(global_values[n]) for n in self.fragments[p]}
        if self.adoption == "overwrite":  # the ablation: θ_p ← Θ_p, losing unmerged progress
            b.in_flight.clear()
            b.steps, b.tokens = 0, 0
            b.anchor, b.version = fresh, int(version)
            theta = local()
            return {n: g - np.asarray(theta[n], dtype=np.float32) for n, g in fresh.items()}
        b.version = int(version)
        merged = self._merged(p)
        out = {}
        for n, g in fresh.items():
            x = np.subtract(g, b.anchor[n])
            for f in merged:
                x += f.delta[n]
            out[n] = x
        b.anchor = fresh
        return out

    def restart(self, anchors: Mapping[str, np.ndarray] | None = None,
                versions: Sequence[int] | None = None, only: Sequence[int] | None = None) -> None:
        """Forget every push in flight (the syncer restarted, or our weights are being reset)
        and optionally take new anchors; with `only`, of those fragments (a syncer shard's).
        Progress of forgotten pushes stays unpushed."""
        for p, b in enumerate(self.books):
            if only is not None and p not in only:
                continue
            for f in b.in_flight:
                b.steps += f.steps
                b.tokens += f.tokens
            b.in_flight.clear()
            if anchors is not None and versions is not None:
                b.anchor = {n: _copy(anchors[n]) for n in self.fragments[p]}
                b.version = int(versions[p])

    def reset_counters(self) -> None:
        for b in self.books:
            b.steps, b.tokens = 0, 0

    def anchors(self) -> Tensors:
        return {n: v for b in self.books for n, v in b.anchor.items()}

    @property
    def versions(self) -> list[int]:
        return [b.version for b in self.books]


def _copy(x: np.ndarray) -> np.ndarray:
    return np.array(x, dtype=np.float32, copy=True)


def _sum(arrays: Iterable[np.ndarray]) -> np.ndarray:
    it = iter(arrays)
    out = _copy(next(it))
    for x in it:
        out += x
    return out


@dataclass(frozen=True)
class Arrival:
    """A published fragment as the learner holds it: version, values, the schedule position
    it implies (one past the newest slot merged), and the job's trained tokens when it was sent."""

    version: int
    tensors: Tensors
    next_slot: int
    job_tokens: int = 0


def absorb(ledger: Ledger, schedule: Schedule, local: Callable[[int], Tensors], shift: Callable[[Tensors], None], *,
           refused: Iterable[tuple[int, int]] = (), accepted: Iterable[tuple[int, int, int, bool]] = (),
           published: Mapping[int, Arrival] | None = None) -> None:
    """One step boundary's news, in the order that keeps the books exact: refusals, then
    acceptances (settling pushes the held version already merged; a late one moves the
    schedule a slot forward), then new global fragments (rebase) and the schedule
    position they carry. `shift` adds its values to θ (by name); `local(p)` reads θ_p, which
    only the overwrite ablation needs. The learner and the replay harness share this."""
    for p, push_id in refused:
        ledger.refused(p, push_id)
    for p, push_id, merged_into, late in accepted:
        ledger.accepted(p, push_id, merged_into)
        if late:
            schedule.late(p)
        settled = ledger.settle(p)
        if settled is not None:
            shift(settled)
    for p, arrival in (published or {}).items():
        if arrival.version > ledger.books[p].version:
            shift(ledger.adopt(p, arrival.version, arrival.tensors, partial(local, p)))
        schedule.observe(arrival.next_slot)


def prepare_push(ledger: Ledger, p: int, local: Tensors, *, codec: Codec, block_size: int, push_id: int, slot: int,
                 session_tokens: int, incarnation: str, step_seconds: float, loss: float,
                 train_seconds: float) -> Push:
    """Encode fragment p's unpushed progress and book it as the syncer will decode it, so the
    compression error stays in θ − A and leaves with the next push (error feedback).
    Δ = A_p − ledger.carried(p, θ_p) (`outer_gradient`), encoded and decoded in one fused pass.
    The keywords after `block_size` are what the push reports beside its books (`Push`)."""
    b = ledger.books[p]
    blob, sent = encode_difference(b.anchor, ledger.carried(p, local), codec, block_size)
    return ledger.pushed(Push(
        fragment=p, base_version=b.version, push_id=push_id, slot=slot, steps=b.steps, tokens=b.tokens,
        session_tokens=session_tokens, delta={n: sent[n] for n in ledger.fragments[p]}, blob=blob,
        incarnation=incarnation, step_seconds=step_seconds, loss=loss, train_seconds=train_seconds))
