"""Folds the event stream of a local run into what the view and the summary show.

Pure bookkeeping over events (each has `t`, `event` and `source`), so it can be
replayed from events.jsonl and tested without processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from diloco.contract import REFUSED_WITHOUT_WORK, Event


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


@dataclass
class RunTracker:
    learners: list[str]
    slots: dict[str, Slot] = field(init=False)
    kills: list[tuple[float, str]] = field(default_factory=list)
    evals: list[tuple[float, str, float]] = field(default_factory=list)
    status: list[tuple[float, int, int]] = field(default_factory=list)  # (t, tokens_merged, versions)
    tokens_merged: int = 0
    outer_versions: int = 0
    outer_steps: int = 0
    active_learners: int = 0
    syncer_incarnations: set[str] = field(default_factory=set)
    syncer_up_since: float | None = None
    some_up_since: float | None = None
    max_publish_gap: float = 0.0
    last_chaos: str = ""
    refused: int = 0
    refused_by: dict[str, int] = field(default_factory=dict)  # by outcome, this syncer incarnation
    refused_work: int = 0  # pushes refused for what they held, every incarnation (badput)
    _refused_work_now: int = 0  # of the current incarnation
    max_norm_ratio: float = 0.0  # the largest push norm over its fragment's median, any incarnation
    max_steps_ratio: float = 0.0  # the largest push steps over its bound's base (syncer/admission.py Counters)

    def __post_init__(self) -> None:
        self.slots = {n: Slot(n) for n in self.learners}

    @property
    def up_count(self) -> int:
        return sum(s.up for s in self.slots.values())

    def observe(self, e: dict[str, Any]) -> None:
        t, kind, src = float(e.get("t", 0.0)), e.get("event"), e.get("source")
        if src in self.slots:
            self._learner_event(self.slots[src], t, kind, e)
        elif src == "runner":
            self._runner_event(t, kind, e)

    def _learner_event(self, slot: Slot, t: float, kind: Any, e: dict[str, Any]) -> None:
        if kind == Event.JOINED:
            if self.up_count == 0:
                self.some_up_since = t
            spawned = slot.spawned_at if slot.spawned_at is not None else t
            slot.incarnations.append(Incarnation(int(e.get("restart", 0)), t, float(e.get("eval_loss", "nan")),
                                                 spawned, float(e.get("pull_seconds", 0.0))))
            slot.spawned_at = None
            if slot.down_at is not None:
                slot.intervals.append((slot.down_at, t, "down"))
                slot.down_at = None
            slot.up = True
        elif kind in (Event.PROGRESS, Event.EXIT) and slot.incarnations:
            inc = slot.incarnations[-1]
            inc.train_seconds = float(e.get("train_seconds", inc.train_seconds))
            inc.acked_train_seconds = float(e.get("acked_train_seconds", inc.acked_train_seconds))
            inc.bytes_sent = int(e.get("bytes_sent", inc.bytes_sent))
            inc.bytes_received = int(e.get("bytes_received", inc.bytes_received))
            inc.steps = int(e.get("step", inc.steps))
            inc.trained_tokens = int(e.get("trained_tokens", inc.trained_tokens))
            if kind == Event.EXIT:
                self._down(slot, t, killed=False)
        elif kind == Event.EVAL:
            self.evals.append((t, slot.name, float(e["eval_loss"])))

    def _down(self, slot: Slot, t: float, killed: bool) -> None:
        if slot.spawned_at is not None:  # died before it joined
            slot.unjoined_seconds += t - slot.spawned_at
            slot.spawned_at = None
        if slot.up and slot.incarnations:
            inc = slot.incarnations[-1]
            inc.end, inc.killed = t, killed
            slot.intervals.append((inc.joined_at, t, "up"))
        slot.up = False
        slot.down_at = t

    def _runner_event(self, t: float, kind: Any, e: dict[str, Any]) -> None:
        target = e.get("target")
        if kind == "kill":
            self.kills.append((t, str(target)))
            self.last_chaos = f"killed {target}"
            if target in self.slots:
                self._down(self.slots[target], t, killed=True)
            elif target == "syncer":
                self.syncer_up_since = None
        elif kind == "exited" and target in self.slots:
            self._down(self.slots[target], t, killed=True)
        elif kind == "exited" and target == "syncer":
            self.syncer_up_since = None
        elif kind == "restart":
            self.last_chaos = f"restarted {target}"
        elif kind == "spawned" and target in self.slots:
            self.slots[target].spawned_at = t
        elif kind == "status":
            self._status(t, e)

    def _status(self, t: float, e: dict[str, Any]) -> None:
        incarnation = str(e.get("incarnation", ""))
        if incarnation not in self.syncer_incarnations:
            self.syncer_incarnations.add(incarnation)
            self.syncer_up_since = t
        self.tokens_merged = int(e["tokens_merged"])
        self.outer_versions = int(sum(e["versions"]))
        self.outer_steps = int(e["outer_steps"])
        self.active_learners = int(e["active_learners"])
        self.refused = int(e.get("refused", 0))
        self.refused_by = {str(k): int(v) for k, v in dict(e.get("refused_by", {})).items()}
        work = sum(v for k, v in self.refused_by.items() if k not in REFUSED_WITHOUT_WORK)
        if work < self._refused_work_now:  # a new syncer incarnation counts from 0
            self._refused_work_now = 0
        self.refused_work += work - self._refused_work_now
        self._refused_work_now = work
        self.max_norm_ratio = max(self.max_norm_ratio, float(e.get("max_norm_ratio", 0.0)))
        self.max_steps_ratio = max(self.max_steps_ratio, float(e.get("max_steps_ratio", 0.0)))
        for name, tokens in dict(e.get("learners_trained", {})).items():
            if name in self.slots:
                self.slots[name].reported_tokens = max(self.slots[name].reported_tokens, int(tokens))
        self.status.append((t, self.tokens_merged, self.outer_versions))
        # A publishing gap counts only while the syncer and at least one joined learner are up.
        if self.up_count and self.syncer_up_since is not None and self.some_up_since is not None:
            since = max(t - float(e["seconds_since_publish"]), self.some_up_since, self.syncer_up_since)
            self.max_publish_gap = max(self.max_publish_gap, t - since)

    # -- derived figures -----------------------------------------------------------

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
        others' median): the denominator of goodput, as the operator's (operator/goodput.py)."""
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
