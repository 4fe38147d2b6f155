"""The learner's fragments between its devices and the syncer (docs/ALGORITHM.md, "The learner loop").

`Fragments` holds θ on the devices and each fragment's books (core/ledger.py). At a step boundary
it adopts the global fragments that arrived (a rebase: a shift of θ_p queued on the devices)
and sends the outer gradient of each fragment the shared schedule made due a step earlier:
behind the next step where the loop's host work has a core of its own, before it where it would
share the step's (trainer/bringup.py, `overlaps`). At the end it flushes every fragment's
unmerged progress. `Progress` is the loop's
running counters, which every outer gradient carries to the syncer.

Imported by the learner once JAX is configured (trainer/learner.py): it imports numpy and JAX.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from diloco.contract import Event
from diloco.core.ledger import Adoption, Ledger, absorb, prepare_push
from diloco.core.schedule import JobProgress, Schedule
from diloco.trainer.hosts import Hosts
from diloco.trainer.recipe import Recipe
from diloco.trainer.sync.link import LearnerLink
from diloco.trainer.sync.messages import JoinState, Updates

# A push that waits for the next step's dispatch: (fragment, its slot, θ_p on the devices).
Waiting = tuple[int, int, dict[str, Any]]


@dataclass
class Progress:
    """The loop's running counters; every push reports the latest (diloco/core/ledger.py `Push`)."""

    step: int = 0  # inner steps taken, the ones a divergence threw away included
    train_seconds: float = 0.0  # time in inner steps, stretched by the group's slowdown
    step_ema: float = 0.0  # a step's seconds, smoothed; 0 until the first step is read
    loss: float = float("nan")  # the last step's loss; NaN until the first is read
    session_tokens: int = 0  # this process's trained tokens since it started
    host_wait: float = 0.0  # the devices' wait on this loop between two steps (the gap)
    step_done: float | None = None  # when the devices last finished (monotonic); None before the first step

    def dispatched(self, t0: float) -> None:
        """A step went to the devices at `t0`: they waited since the last one finished."""
        if self.step_done is not None:
            self.host_wait += t0 - self.step_done

    def read(self, t0: float, tokens: int) -> float:
        """The step dispatched at `t0` is done: book it; its seconds."""
        self.step_done = time.monotonic()
        dt = self.step_done - t0
        self.train_seconds += dt
        self.step_ema = dt if self.step == 0 else 0.9 * self.step_ema + 0.1 * dt  # about the last 10 steps
        self.session_tokens += tokens
        return dt


class Fragments:
    """θ on the devices, each fragment's books and schedule, and the pushes of due fragments.

    An adoption's rebase is a shift of θ_p (core/ledger.py) that needs no read of θ_p, so it can
    be queued behind a step in flight. A due fragment's θ_p is kept as its step left it
    (`pending`) until the next boundary, `at_boundary`, which the loop calls after dispatching
    the next step where that host work then overlaps the devices' step, before it otherwise.
    """

    def __init__(self, *, joined: JoinState, plan: tuple[tuple[str, ...], ...], recipe: Recipe, hosts: Hosts,
                 link: LearnerLink, adoption: Adoption, shards: int, learners: int, tokens_per_step: int,
                 emit: Callable[..., None]) -> None:
        self.plan, self.recipe, self.hosts, self.link, self.emit = plan, recipe, hosts, link, emit
        self.progress = Progress()
        # The learning rate follows the job's tokens, not slots (core/schedule.py, JobProgress): a
        # (re)joiner resumes the decay where the job is, and no learner decays faster than the job
        # trains. The syncer reports the job's tokens at the join, a re-join and in every publish.
        self.job = JobProgress(learners, tokens_per_step)
        self.job.observe(joined.job_tokens)
        self.theta = recipe.place(joined.params)  # θ, on the devices
        self.ledger = Ledger(plan, joined.params, joined.versions, adoption)
        self.schedule = Schedule(len(plan), joined.slot, per_slot=shards)  # one fragment per syncer shard each slot
        self.incarnation = joined.incarnation  # the syncer's, whose anchors our pushes are against
        self.codec, self.block_size = joined.codec, joined.block_size  # the syncer decides the wire format
        self.push_seq = 0  # numbers our pushes: the answers name them, and the syncer ignores a repeat
        self.shifts: list[dict[str, np.ndarray]] = []  # adoptions' rebases not yet added to θ
        self.pending: list[Waiting] = []  # the due pushes of the last step, one per syncer shard

    def fragment(self, p: int) -> dict[str, Any]:
        """θ_p as it is now, on the devices."""
        return {n: self.theta[n] for n in self.plan[p]}

    def shifted(self) -> None:
        """Add the adoptions' shifts to θ (queued on the devices, behind whatever runs there)."""
        for by in self.shifts:
            self.theta.update(self.recipe.shift(self.theta, by))
        self.shifts.clear()

    def _local(self, p: int) -> dict[str, np.ndarray]:
        self.shifted()
        return self.hosts.host_copy(self.fragment(p))

    def adopt(self, u: Updates) -> None:
        """Adopt at a step boundary what the syncer sent: a re-join, answers, fragments."""
        if u.rejoined is not None:  # the syncer (shard) restarted: rebase its fragments onto its state
            anchors = self.ledger.anchors()
            self.shifts.append({n: u.rejoined.params[n] - anchors[n] for n in u.rejoined.params})
            self.ledger.restart(u.rejoined.params, u.rejoined.versions, u.rejoined.owned)
            self.schedule.observe(u.rejoined.slot)
            self.job.observe(u.rejoined.job_tokens)
            self.incarnation = u.rejoined.incarnation
            self.emit(Event.READOPTED, incarnation=self.incarnation, versions=self.ledger.versions)
        absorb(self.ledger, self.schedule, self._local, self.shifts.append, refused=u.refused, accepted=u.accepted,
               published=u.published)
        for arrival in u.published.values():
            self.job.observe(arrival.job_tokens)

    def at_boundary(self, u: Updates) -> list[Waiting]:
        """Adopt `u`: θ_p += Θ_p − A_p − (progress Θ_p already holds), queued on the devices. A
        waiting push whose fragment this news concerns goes out first (the books take it before
        the news), one against a restarted syncer is dropped; the rest are returned, for `send`."""
        kept = []
        for waiting in self.pending:
            fate = u.before(waiting[0])  # rarely not "keep": its fragment's news just came
            if fate == "send":
                self.push(*waiting)
            elif fate == "keep":
                kept.append(waiting)
        self.pending = []
        self.adopt(u)
        self.shifted()
        return kept

    def send(self, waiting: list[Waiting]) -> None:
        for w in waiting:
            self.push(*w)

    def push(self, p: int, slot: int, theta: dict[str, Any]) -> None:
        """Hand fragment p's unpushed progress (θ_p as the step that filled `slot` left it, still
        on the devices) to the sender, recorded as the syncer will decode it."""
        self.push_seq += 1
        pr = self.progress
        self.link.submit(prepare_push(
            self.ledger, p, self.hosts.host_copy(theta), codec=self.codec, block_size=self.block_size,
            push_id=self.push_seq, slot=slot, session_tokens=pr.session_tokens, incarnation=self.incarnation,
            step_seconds=pr.step_ema, loss=pr.loss, train_seconds=pr.train_seconds))

    def take_due(self, *, poison: bool) -> int:
        """Our slot in the shared schedule: its due fragments' outer gradients (one per syncer
        shard) go out at the next boundary, each unless its previous push is still in flight
        (then its progress goes out with the next one). `poison`: fault injection, a learner
        whose state went bad (its due fragments become NaN, and go out regardless)."""
        slot, due = self.schedule.take()
        if poison:
            bad = {n for p in due for n in self.plan[p]}
            self.theta = {n: v * np.nan if n in bad else v for n, v in self.theta.items()}
        self.pending = [(p, slot, self.fragment(p)) for p in due if poison or not self.ledger.busy(p)]
        return slot

    def stepped(self, t0: float, tokens: int) -> float:
        """The step dispatched at `t0` is done: book it (the counters every push carries, and
        each fragment's unpushed steps and tokens); its seconds."""
        dt = self.progress.read(t0, tokens)
        self.ledger.stepped(tokens)
        return dt

    def start_over(self) -> Any:
        """A diverged learner (its loss not finite), or one whose outer gradient the syncer
        refused as malformed, pushes nothing and starts over from the global model: θ from the
        anchors, the pushes in flight forgotten, this step's slot skipped. The fresh optimizer state."""
        pr = self.progress
        self.emit(Event.DIVERGED if not math.isfinite(pr.loss) else Event.RESYNCED, step=pr.step)
        self.link.clear_resync()
        self.theta = self.recipe.place(self.ledger.anchors())
        opt_state = self.recipe.init_state(self.theta)
        self.ledger.restart()
        self.ledger.reset_counters()
        self.schedule.take()
        pr.step += 1
        return opt_state

    def flush(self, seconds: float) -> bool:
        """Push every fragment's unmerged progress and wait, up to `seconds`, until the syncer has
        accepted all of it, so no trained step is lost at the end of a run. A fragment is pushed
        once per global version it holds: one the syncer refused (too stale) goes out again only
        after a newer version arrived, not in a loop of refusals. Whether all was accepted."""
        self.send(self.pending)
        self.pending = []
        self.shifted()
        flushed_at: dict[int, int] = {}
        deadline = time.monotonic() + seconds
        while self.link.until(deadline):
            self.adopt(self.link.take_updates())
            self.shifted()
            for p in range(len(self.plan)):
                if self.ledger.unpushed(p) and flushed_at.get(p) != self.ledger.books[p].version:
                    flushed_at[p] = self.ledger.books[p].version
                    self.push(p, self.schedule.next_slot_of(p), self.fragment(p))
            if not self.ledger.unacknowledged():
                return self.link.flush(timeout=max(0.0, deadline - time.monotonic()))
            self.link.wait_for_news(0.2)
        return False
