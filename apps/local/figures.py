"""What the view and the summary of a local run show, derived from the state its events fold
into (apps/local/tracker.py): goodput, availability, badput by reason, learner seconds by kind.

Apart from the fold so each reads on its own: the tracker says how an event changes the
state, these say what a state means; both pure, replayable from events.jsonl.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Incarnation:
    """One process lifetime of a learner."""

    restart: int
    joined_at: float
    join_eval: float
    spawned_at: float
    pull_seconds: float = 0.0
    end: float | None = None
    killed: bool = False
    train_seconds: float = 0.0
    acked_train_seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    steps: int = 0
    trained_tokens: int = 0  # as the learner counts them: its steps times its batch's tokens


@dataclass
class Slot:
    name: str
    incarnations: list[Incarnation] = field(default_factory=list)
    up: bool = False
    down_at: float | None = None
    spawned_at: float | None = None  # set while a process runs that has not joined yet
    unjoined_seconds: float = 0.0  # processes that died before joining: all startup
    reported_tokens: int = 0  # trained tokens its processes' pushes reported to the syncer (the largest seen)
    intervals: list[tuple[float, float, str]] = field(default_factory=list)  # (start, end, state)

    @property
    def current(self) -> Incarnation | None:
        return self.incarnations[-1] if self.incarnations and self.up else None


class RunFigures:
    """The derived figures, over the fields RunTracker folds (declared here, set there)."""

    slots: dict[str, Slot]
    evals: list[tuple[float, str, float]]  # (t, learner, eval loss)
    status: list[tuple[float, int, int]]  # (t, tokens_merged, versions)
    tokens_merged: int
    refused_work: int  # pushes refused for what they held, every syncer incarnation

    def latest_eval(self) -> float | None:
        latest: dict[str, float] = {}
        for _, name, loss in self.evals:
            latest[name] = loss
        return sum(latest.values()) / len(latest) if latest else None

    def tokens_at(self, t: float) -> float:
        """Tokens merged at time t, interpolated between status polls."""
        prev = (0.0, 0)
        for ts, tokens, _ in self.status:
            if ts >= t:
                if ts == prev[0]:
                    return float(tokens)
                frac = (t - prev[0]) / (ts - prev[0]) if prev[0] else 1.0
                return prev[1] + frac * (tokens - prev[1])
            prev = (ts, tokens)
        return float(prev[1])

    @property
    def tokens_trained(self) -> int:
        """Tokens the learners trained, every incarnation included (a kill's lost work too). Per
        learner, its progress events' count or what its pushes reported to the syncer, whichever
        is larger: a killed process's steps after its last progress event (up to a second of
        them) reached the syncer with its pushes."""
        return sum(max(sum(inc.trained_tokens for inc in s.incarnations), s.reported_tokens)
                   for s in self.slots.values())

    def readmissions(self) -> int:
        return sum(1 for s in self.slots.values() for inc in s.incarnations if inc.restart > 0)

    def capacity_tokens(self, wall: float) -> float:
        """What the learners could have trained in `wall` seconds, each at its own measured rate
        (its processes' trained tokens over their training time; one never measured takes the
        others' median): the denominator of goodput, as the operator's (operator/status/goodput.py)."""
        rates = {name: sum(i.trained_tokens for i in s.incarnations) / seconds
                 for name, s in self.slots.items() if (seconds := sum(i.train_seconds for i in s.incarnations)) > 0}
        if not rates:
            return 0.0
        fallback = sorted(rates.values())[len(rates) // 2]
        return wall * sum(rates.get(name, fallback) for name in self.slots)

    def goodput(self, wall: float) -> float:
        """Tokens merged into the global model over what the learners' capacity could have trained."""
        capacity = self.capacity_tokens(wall)
        return min(1.0, self.tokens_merged / capacity) if capacity > 0 else 0.0

    def availability(self, wall: float) -> float:
        """Learner-seconds some process of each learner was joined to the syncer, over wall x
        learners. Joined is not productive: a learner whose pushes are refused is available."""
        t_end = max([t for t, _, _ in self.status] + [0.0])
        up = sum(max(0.0, (inc.end if inc.end is not None else t_end) - inc.joined_at)
                 for s in self.slots.values() for inc in s.incarnations)
        provisioned = wall * max(len(self.slots), 1)
        return min(1.0, up / provisioned) if provisioned > 0 else 0.0

    def badput(self, wall: float, tokens_per_step: int) -> dict[str, float]:
        """Capacity that did not reach the global model, by reason, as shares of it: joining
        (process start to joined, and pulling the model), down (no process running), lost to
        kills (training thrown away before it was pushed), refused (one learner-step per refused
        push, a lower bound), other (evaluations, merges in flight at the end, idling)."""
        capacity = self.capacity_tokens(wall)
        if capacity <= 0:
            return {}
        rate = capacity / (wall * max(len(self.slots), 1))  # tokens per learner-second
        secs = self.accounting(wall)
        joined = self.availability(wall) * wall * len(self.slots)
        shares = {"joining": (secs["startup"] + secs["state_pull"]) * rate / capacity,
                  "down": max(0.0, wall * len(self.slots) - joined - secs["startup"] - secs["state_pull"]) * rate / capacity,
                  "lost_to_kills": secs["lost"] * rate / capacity,
                  "refused": self.refused_work * tokens_per_step / capacity}
        left = max(0.0, 1.0 - self.goodput(wall))
        out = {}
        for reason, share in shares.items():  # each within what is left, in this order
            out[reason] = round(min(share, left), 4)
            left -= out[reason]
        out["other"] = round(left, 4)
        return out

    def accounting(self, wall: float) -> dict[str, float]:
        """Learner seconds by kind, summed over slots; they add up to wall x learners.

        productive: training the syncer acknowledged; startup: process start to joining
        (interpreter, data, compilation); state_pull: joining; lost: training a kill threw
        away before it was pushed; waiting: the rest (down until restarted, evals, idling)."""
        out = dict.fromkeys(("productive", "startup", "state_pull", "lost"), 0.0)
        for slot in self.slots.values():
            out["startup"] += slot.unjoined_seconds
            for inc in slot.incarnations:
                out["productive"] += inc.acked_train_seconds
                out["state_pull"] += inc.pull_seconds
                out["startup"] += max(0.0, inc.joined_at - inc.spawned_at - inc.pull_seconds)
                if inc.killed:
                    out["lost"] += max(0.0, inc.train_seconds - inc.acked_train_seconds)
        out["waiting"] = max(0.0, wall * len(self.slots) - sum(out.values()))
        return out

    def bytes(self) -> tuple[int, int]:
        incs = [inc for s in self.slots.values() for inc in s.incarnations]
        return sum(i.bytes_sent for i in incs), sum(i.bytes_received for i in incs)
